"""Which quantized layout a checkpoint uses: the one question every reader asks first.

:func:`find_quant_layout` tries the fp4 layouts (:mod:`shardkit.layouts.fp4`) and then the fp8 ones
(:func:`shardkit.layouts.fp8.find_layout`): an NVFP4 checkpoint also holds ``weight_scale`` tensors,
and read as fp8 its packed bytes would be multiplied as if they were values. :func:`quant_config` is
the recipe next to the weights: ``config.json``, with ModelOpt's ``hf_quant_config.json`` folded in.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import InvalidInputError
from ..formats.header import TensorEntry
from ..formats.layout import read_config
from ..formats.links import parse_json, read_inside
from .fp4 import Fp4Layout, find_fp4_layout
from .fp8 import QuantLayout, find_layout

__all__ = ["HF_QUANT_CONFIG", "AnyLayout", "find_quant_layout", "quant_config"]

AnyLayout = QuantLayout | Fp4Layout
HF_QUANT_CONFIG = "hf_quant_config.json"
MAX_QUANT_CONFIG_BYTES = 16 * 2**20


def find_quant_layout(entries: Sequence[TensorEntry], *, config: Mapping[str, Any] | None = None,
                      metadata: Mapping[str, str] | None = None, where: str = "checkpoint",
                      allow_lossy: bool = False) -> AnyLayout | None:
    """The checkpoint's quantized layout (fp4 or fp8 with scales), or None when it holds none.

    Args:
        entries: the checkpoint's tensors.
        config: its config (:func:`quant_config`).
        metadata: its safetensors header metadata.
        where: the checkpoint, for messages.
        allow_lossy: return an inconsistent fp4 layout (its broken weights left out, passed through as
            stored) instead of refusing it; an inconsistent fp8 one is then read as plain tensors.

    Raises:
        InvalidInputError: a missing or misshapen scale, or fp4 weights without their quantization
            config; one line naming the tensor.
    """
    fp4 = find_fp4_layout(entries, config=config, where=where)
    if fp4 is not None:
        refusal = fp4.refusal(where)
        if refusal is not None and not allow_lossy:
            raise InvalidInputError(refusal)
        return fp4
    try:
        return find_layout(entries, config=config, metadata=metadata, where=where)
    except InvalidInputError:
        if allow_lossy:
            return None
        raise


def quant_config(folder: str) -> dict[str, Any] | None:
    """``folder/config.json``; without a ``quantization_config`` in it, ModelOpt's ``hf_quant_config.json``
    (``{"quantization": {...}}``) as one with ``quant_method: modelopt``. None when there is neither."""
    config = read_config(folder)
    if config is not None and config.get("quantization_config"):
        return config
    path = os.path.join(folder, HF_QUANT_CONFIG)
    try:  # a checked descriptor: a FIFO, /dev/zero or a link leaving the folder is refused unread
        raw = read_inside(folder, HF_QUANT_CONFIG, where=folder, max_bytes=MAX_QUANT_CONFIG_BYTES)
    except FileNotFoundError:
        return config
    except OSError as e:
        raise InvalidInputError(f"{path}: not readable ({e.strerror or e}); fix or remove it") from e
    doc = parse_json(raw, path=path)
    quant = doc.get("quantization") if isinstance(doc, dict) else None
    if not isinstance(quant, dict):
        return config
    return {**(config or {}), "quantization_config": {"quant_method": "modelopt", **quant}}
