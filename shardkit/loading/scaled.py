"""Loading fp8 / fp4 checkpoints with scales without upcasting: the skeleton gets the scales as buffers.

:func:`attach_scales` runs on the meta skeleton before key matching: it recognises the checkpoint's
layout (:func:`shardkit.layouts.registry.find_quant_layout`), puts each stored quantized tensor (fp8
weights; fp4 packed tensors in place of the dense parameters) and its scales on its module, and wraps the
module's ``forward`` to dequantize at compute (:mod:`shardkit.runtime.scaled_fp`). Key matching then loads
them like any other tensor, in their stored dtypes, whatever ``dtype`` asks for the rest; input scales and
markers are not model tensors.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..layouts.fp8 import QuantLayout
from ..layouts.registry import dequantizer, find_quant_layout, quant_config
from ..runtime.scaled_fp import attach_dequantizing
from .lazy import LazyCheckpoint

if TYPE_CHECKING:
    import torch

__all__ = ["ScaledLoad", "attach_scales"]


@dataclass(frozen=True)
class ScaledLoad:
    """What :func:`attach_scales` did: the tensors kept in their stored dtype, the names that are not parameters."""

    stored: dict[str, torch.dtype] = field(default_factory=dict)  # model name → stored dtype (fp8 weights, scales)
    extra: frozenset[str] = frozenset()  # input scales and markers: not model tensors
    description: str | None = None  # the layout, e.g. "fp8, 128×128 blocks, float32 scales (...)"

    def dtype_for(self, fallback: Callable[[str], torch.dtype | None]) -> Callable[[str], torch.dtype | None]:
        """``fallback``'s dtypes, except the fp8 weights and their scales, which stay as stored."""
        return lambda name: self.stored.get(name) or fallback(name)


def attach_scales(skeleton: torch.nn.Module, checkpoint: LazyCheckpoint) -> ScaledLoad:
    """Prepare ``skeleton`` for ``checkpoint``'s fp8 weights and scales (nothing when it has none).

    Raises:
        InvalidInputError: an inconsistent scaled checkpoint, or fused scales that disagree.
    """
    from ..layouts.fp8_math import refuse_disagreeing, scale_to_float32

    entries = [checkpoint.entry(name) for name in checkpoint]
    folder = os.path.dirname(os.path.abspath(checkpoint.paths[0])) if checkpoint.paths else None
    layout = find_quant_layout(entries, config=quant_config(folder) if folder else None, metadata=checkpoint.metadata,
                               where=checkpoint.description)
    if layout is None:
        return ScaledLoad()
    if isinstance(layout, QuantLayout):  # fused fp8 scales that disagree cannot be used (fp4 scales: verify reads them)
        refuse_disagreeing({w.scale: scale_to_float32(checkpoint.get_tensor(w.scale)) for w in layout.weights
                            if w.granularity == "fused"}, where=checkpoint.description)
    weights = dequantizer(layout, entries)
    shapes = {n: (checkpoint.shape_of(n), checkpoint.dtype_of(n)) for w in weights.weights() for n in (w.stored, *w.scales)}
    kept = attach_dequantizing(skeleton, weights, shapes)
    return ScaledLoad({n: checkpoint.dtype_of(n) for n in kept}, frozenset(layout.extra - set(kept)), layout.describe())


def has_scales(folder: str) -> bool:
    """Whether the safetensors checkpoint in ``folder`` holds fp8 weights with scales (headers only)."""
    from ..errors import InvalidInputError
    from ..sources.safetensors import open_safetensors_folder

    try:
        with open_safetensors_folder(folder) as source:
            return find_quant_layout(source.entries(), config=quant_config(folder),
                                     metadata=source.metadata()) is not None
    except InvalidInputError:
        return True  # inconsistent: shardkit's loader says which tensors
