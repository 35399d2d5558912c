"""fp4 weights (NVFP4, MXFP4) kept packed in memory, dequantized per layer at compute.

:mod:`shardkit.runtime.scaled_fp8`'s counterpart for :mod:`shardkit.layouts.fp4`: a packed module's dense
parameter (``weight``; gpt-oss experts' ``gate_up_proj`` / ``down_proj``) is replaced by the packed
uint8 tensor under its checkpoint name (``weight``, ``weight_packed``, ``gate_up_proj_blocks``) and its
scales become buffers, so the normal loader fills them all in their stored dtypes. The module's
``forward`` is wrapped to put the dense weight (computed by :mod:`shardkit.layouts.fp4_math`, in the
dtype of its input, exactly as ``convert --dtype`` writes it) in place for the call, and the packed one
back afterwards. Memory = packed bytes + scales, plus one layer's dense weight while it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from ..layouts.fp4 import MODELOPT_NVFP4, MXFP4, PackedModule, PackedSlot

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["attach_packed_fp4"]

BAND_BYTES = 16 * 2**20


def attach_packed_fp4(model: nn.Module, modules: list[PackedModule],
                      shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> list[str]:
    """Give each module its packed tensors (meta, to be loaded) and the dequantizing ``forward``.

    Args:
        model: the skeleton, on the meta device.
        modules: from :func:`packed_modules`.
        shapes: checkpoint tensor name → (shape, stored dtype), for every packed and scale tensor.

    Returns:
        The checkpoint names now held by the model in their stored dtypes (packed weights and scales).
    """
    import torch

    kept: list[str] = []
    for entry in modules:
        try:
            module = model.get_submodule(entry.module)
        except AttributeError:
            continue  # not a module of this model: key matching reports the tensors
        if not all(isinstance(p := getattr(module, s.dense, None), torch.nn.Parameter) and tuple(p.shape) == s.shape
                   for s in entry.slots):
            continue
        for slot in entry.slots:
            del module._parameters[slot.dense]
            packed_shape, packed_dtype = shapes[slot.names[0]]
            module.register_parameter(slot.packed, torch.nn.Parameter(
                torch.empty(packed_shape, dtype=packed_dtype, device="meta"), requires_grad=False))
            scales = [(slot.scale, slot.names[1])] + ([(slot.global_scale, slot.names[2])] if slot.global_scale else [])
            for attr, name in scales:
                shape, dtype = shapes[name]
                module.register_buffer(attr, torch.empty(shape, dtype=dtype, device="meta"))
            kept += slot.names
        module.forward = _dequantizing(module, module.forward, entry)
    return kept


P = ParamSpec("P")  # the wrapped forward's parameters
R = TypeVar("R")


def _dequantizing(module: nn.Module, forward: Callable[P, R], entry: PackedModule) -> Callable[P, R]:
    def dequantizing_forward(*args: P.args, **kwargs: P.kwargs) -> R:
        import torch

        compute = next((a.dtype for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)
                        and a.is_floating_point()), torch.bfloat16)
        swapped: list[tuple[PackedSlot, torch.Tensor]] = []
        try:
            for slot in entry.slots:
                dense = dense_weight(module, slot, entry.scheme, compute)
                if slot.packed == slot.dense:  # ModelOpt: the packed tensor is the ``weight`` parameter itself
                    param = getattr(module, slot.packed)
                    swapped.append((slot, param.data))
                    param.data = dense
                else:
                    object.__setattr__(module, slot.dense, dense)
                    swapped.append((slot, dense))
            return forward(*args, **kwargs)
        finally:
            for slot, stored in swapped:
                if slot.packed == slot.dense:
                    getattr(module, slot.packed).data = stored
                else:
                    object.__delattr__(module, slot.dense)

    return dequantizing_forward


def dense_weight(module: nn.Module, slot: PackedSlot, scheme: str, compute: torch.dtype) -> torch.Tensor:
    """The dense weight of ``slot`` in ``compute``: band by band of rows (NVFP4) or expert by expert (MXFP4), so
    the float32 temporaries are one band's; the result equals ``convert --dtype`` of the same tensors."""
    import torch

    from ..layouts.fp4_math import dequantize_mxfp4, dequantize_nvfp4

    packed, scale = getattr(module, slot.packed), getattr(module, slot.scale)
    out = torch.empty(slot.shape, dtype=compute, device=packed.device)
    if scheme == MXFP4:
        for expert in range(slot.shape[0]):
            out[expert] = dequantize_mxfp4(packed[expert], scale[expert], compute).transpose(0, 1)
        return out
    global_scale = getattr(module, slot.global_scale or "")
    rows, cols = slot.shape
    step = max(1, BAND_BYTES // (cols * 4))
    for row0 in range(0, rows, step):
        out[row0:row0 + step] = dequantize_nvfp4(packed[row0:row0 + step], scale[row0:row0 + step], global_scale,
                                                 modelopt=scheme == MODELOPT_NVFP4, out_dtype=compute)
    return out
