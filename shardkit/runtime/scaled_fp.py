"""Quantized weights (fp8 with scales, NVFP4, MXFP4) kept as stored in memory, dequantized per layer at compute.

The disk counterpart of diffusers' ``enable_layerwise_casting`` for checkpoints that carry scales. Each
module of a quantized weight (:meth:`~shardkit.layouts.quant.Dequantizer.weights`) holds the stored tensor
under its checkpoint name (fp8: ``weight`` itself; fp4: ``weight`` packed, ``weight_packed``,
``gate_up_proj_blocks``) and its scales as buffers, so the normal loader fills them all in their stored
dtypes. The module's ``forward`` is wrapped to put the dense weight in place for the call, in the dtype of
its input, and the stored one back afterwards. The dense weight is computed band by band by the layout's
own :meth:`~shardkit.layouts.quant.Dequantizer.dense_bands`, the same bands ``convert --dtype`` writes, so
a layer computes exactly what it computes after a conversion of the same checkpoint. Memory = stored bytes
+ scales, plus one layer's dense weight while it runs.

The wrapper is an instance ``forward``, installed before accelerate dispatches the model: accelerate
wraps it in turn, so its hooks move an offloaded weight to the device before the weight is dequantized.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from ..layouts.quant import DenseWeight, Dequantizer, TensorsReader, dense_tensor

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["attach_dequantizing", "dense_weight"]


def _attr(name: str) -> str:
    return name.rpartition(".")[2]


def _module_of(weight: DenseWeight) -> str | None:
    """The module holding ``weight``'s dense, stored and scale tensors, or None when they are not one module's."""
    modules = {name.rpartition(".")[0] for name in (weight.name, weight.stored, *weight.scales)}
    return modules.pop() if len(modules) == 1 else None


def attach_dequantizing(model: nn.Module, dequantizer: Dequantizer,
                        shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> list[str]:
    """Give each module its stored tensors and scales (meta, to be loaded) and the dequantizing ``forward``.

    Args:
        model: the skeleton, on the meta device.
        dequantizer: the checkpoint's quantized weights (:func:`shardkit.layouts.registry.dequantizer`).
        shapes: checkpoint tensor name → (shape, stored dtype), for every stored and scale tensor.

    Returns:
        The checkpoint names now held by the model in their stored dtypes (quantized weights and scales).
    """
    import torch

    grouped: dict[str, list[DenseWeight]] = {}
    for weight in dequantizer.weights():
        module_name = _module_of(weight)
        if module_name is not None:
            grouped.setdefault(module_name, []).append(weight)
    kept: list[str] = []
    for module_name, weights in grouped.items():
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            continue  # not a module of this model: key matching reports the tensors
        if not all(isinstance(p := getattr(module, _attr(w.name), None), torch.nn.Parameter) and tuple(p.shape) == w.shape
                   and not any(hasattr(module, _attr(s)) for s in w.scales) for w in weights):
            continue
        for weight in weights:
            _register(module, weight, shapes)
            kept += [weight.stored, *weight.scales]
        module.forward = _dequantizing(module, module.forward, dequantizer, weights)
    return kept


def _register(module: nn.Module, weight: DenseWeight, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
    """The stored tensor in place of the dense parameter (kept where it is the same tensor, fp8), its scales as buffers."""
    import torch

    shape, dtype = shapes[weight.stored]
    if weight.stored != weight.name or tuple(shape) != weight.shape:  # packed: another tensor than the dense one
        del module._parameters[_attr(weight.name)]
        module.register_parameter(_attr(weight.stored), torch.nn.Parameter(
            torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False))
    for scale in weight.scales:
        shape, dtype = shapes[scale]
        module.register_buffer(_attr(scale), torch.empty(shape, dtype=dtype, device="meta"))


P = ParamSpec("P")  # the wrapped forward's parameters
R = TypeVar("R")


def _dequantizing(module: nn.Module, forward: Callable[P, R], dequantizer: Dequantizer,
                  weights: Sequence[DenseWeight]) -> Callable[P, R]:
    def dequantizing_forward(*args: P.args, **kwargs: P.kwargs) -> R:
        import torch

        compute = next((a.dtype for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)
                        and a.is_floating_point()), torch.bfloat16)
        swapped: list[tuple[DenseWeight, torch.Tensor]] = []
        try:
            for weight in weights:
                dense = dense_weight(module, dequantizer, weight, compute)
                if _attr(weight.stored) == _attr(weight.name):  # the stored tensor is the parameter itself
                    param = getattr(module, _attr(weight.stored))
                    swapped.append((weight, param.data))
                    param.data = dense
                else:
                    object.__setattr__(module, _attr(weight.name), dense)
                    swapped.append((weight, dense))
            return forward(*args, **kwargs)
        finally:
            for weight, stored in swapped:
                if _attr(weight.stored) == _attr(weight.name):
                    getattr(module, _attr(weight.stored)).data = stored
                else:
                    object.__delattr__(module, _attr(weight.name))

    return dequantizing_forward


def dense_weight(module: nn.Module, dequantizer: Dequantizer, weight: DenseWeight,
                 compute: torch.dtype) -> torch.Tensor:
    """The dense ``weight`` of ``module`` in ``compute``, band by band: the float32 temporaries are one band's, not
    the layer's (the layer's compute-dtype copy is the only full-size allocation)."""
    import torch

    def lookup(name: str) -> torch.Tensor:
        found = getattr(module, _attr(name))
        if not isinstance(found, torch.Tensor):
            raise TypeError(f"{name}: not a tensor of the module")  # registered by attach_dequantizing
        return found

    return dense_tensor(dequantizer, TensorsReader(lookup), weight, compute)
