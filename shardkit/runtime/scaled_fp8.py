"""fp8 weights with scales kept in fp8 in memory, dequantized per layer at compute.

The disk counterpart of diffusers' ``enable_layerwise_casting`` for checkpoints that carry scales
(transformers FineGrainedFP8, compressed-tensors, ComfyUI scaled fp8): each scaled module holds its
stored fp8 ``weight`` and its scale as a buffer (named as in the checkpoint, so the normal loader
fills both); its ``forward`` is wrapped to swap in ``weight.to(float32) × scale`` in the dtype of its
input for the call, and the fp8 tensor back afterwards. Memory = fp8 bytes + scales, plus one layer's
dequantized weight while it runs. The arithmetic is :func:`shardkit.layouts.fp8_math.dequantize_band`, so a
layer computes exactly what it computes after ``convert --dtype`` of the same checkpoint.

The wrapper is an instance ``forward``, installed before accelerate dispatches the model: accelerate
wraps it in turn, so its hooks move an offloaded weight to the device before the weight is dequantized.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from ..layouts.fp8 import ScaledModule, ScaledWeight

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["attach_scaled_fp8"]


def attach_scaled_fp8(model: nn.Module, modules: list[ScaledModule],
                      scale_shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> list[str]:
    """Give each module its scale buffer (meta, to be loaded) and the dequantizing ``forward``.

    Args:
        model: the skeleton, on the meta device.
        modules: from :func:`scaled_modules`.
        scale_shapes: scale tensor name → (shape, stored dtype).

    Returns:
        The weight names that keep their stored fp8 dtype (every other float tensor may be cast).
    """
    import torch

    kept = []
    for entry in modules:
        try:
            module = model.get_submodule(entry.module)
        except AttributeError:
            continue  # not a module of this model: key matching reports the tensors
        if not isinstance(getattr(module, "weight", None), torch.nn.Parameter) or hasattr(module, entry.scale_attr):
            continue
        shape, dtype = scale_shapes[entry.weight.scale]
        module.register_buffer(entry.scale_attr, torch.empty(shape, dtype=dtype, device="meta"))
        module.forward = _dequantizing(module, module.forward, entry)
        kept.append(entry.weight.weight)
    return kept


P = ParamSpec("P")  # the wrapped forward's parameters
R = TypeVar("R")


def _dequantizing(module: nn.Module, forward: Callable[P, R], entry: ScaledModule) -> Callable[P, R]:
    def dequantizing_forward(*args: P.args, **kwargs: P.kwargs) -> R:
        import torch

        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        stored = weight.data
        compute = next((a.dtype for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)
                        and a.is_floating_point()), torch.bfloat16)
        scale = getattr(module, entry.scale_attr)
        assert isinstance(scale, torch.Tensor), entry.scale_attr  # registered as a buffer by the loader
        weight.data = dequantized(stored, scale, entry.weight, compute)
        try:
            return forward(*args, **kwargs)
        finally:
            weight.data = stored

    return dequantizing_forward


def dequantized(stored: torch.Tensor, scale: torch.Tensor, weight: ScaledWeight,
                compute: torch.dtype) -> torch.Tensor:
    """``stored`` × ``scale`` in ``compute``, band by band of rows: the float32 temporaries are one band's,
    not the layer's (the layer's compute-dtype copy is the only full-size allocation)."""
    import torch

    from ..layouts.fp8_math import band_rows, dequantize_band, scale_to_float32

    flat = stored.reshape(stored.shape[0], -1) if stored.dim() != 2 else stored
    rows, cols = flat.shape
    factors = scale_to_float32(scale)
    out = torch.empty((rows, cols), dtype=compute, device=stored.device)
    step = band_rows(weight, cols)
    for row0 in range(0, rows, step):
        out[row0:row0 + step] = dequantize_band(flat[row0:row0 + step], factors, weight, row0, compute)
    return out.reshape(stored.shape)
