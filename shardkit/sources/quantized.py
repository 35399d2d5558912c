"""A view of a checkpoint quantized to fp8 with scales, in a layout that loaders read, computed as it is written.

:class:`QuantizedSource` wraps any source. Each 2-D float ``.weight`` that
:func:`~shardkit.formats.quant.should_skip_quantize` does not keep becomes an e4m3fn weight plus its
scale, computed band by band of rows (memory never depends on the tensor's size):

- ``fp8-block``: 128×128 blocks, ``X.weight_scale_inv`` (transformers FineGrainedFP8); a weight whose
  dimensions are not multiples of 128 is kept, since transformers' loader derives the block from the
  scale grid and would misread it;
- ``fp8-channel`` / ``fp8-tensor``: ``X.weight_scale`` of shape ``(out, 1)`` / ``(1,)``
  (compressed-tensors ``float-quantized``).

Everything else passes through (with its file offsets). ``edit_config`` adds the recipe's
``quantization_config`` (the kept modules in ``modules_to_not_convert`` / ``ignore``), and
:meth:`QuantizedSource.report` gives the quantization error of every tensor written.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidInputError
from ..formats.header import TensorEntry
from ..formats.quant import DEFAULT_BLOCK, QUANTIZE_SCHEMES, ScaledWeight, matrix_shape, should_skip_quantize
from ..units import tensor_nbytes
from .base import Source
from .dequantized import ViewSource, read_rows

__all__ = ["QuantizedSource"]


def _finegrained_config(ignored: list[str], granularity: str) -> dict[str, Any]:
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(DEFAULT_BLOCK),
            "modules_to_not_convert": ignored}


def _compressed_config(ignored: list[str], granularity: str) -> dict[str, Any]:
    weights = {"num_bits": 8, "type": "float", "strategy": granularity, "symmetric": True, "dynamic": False,
               "group_size": None, "block_structure": None, "observer": "minmax"}
    group = {"targets": ["Linear"], "weights": weights, "input_activations": None, "output_activations": None,
             "format": "float-quantized"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": ignored, "kv_cache_scheme": None}


@dataclass(frozen=True)
class _Recipe:
    granularity: str
    scale_suffix: str
    config: Callable[[list[str], str], dict[str, Any]]
    scale_like_weight: bool  # scales in the weight's bf16/fp16 (what compressed-tensors loads them as), else float32


RECIPES = {
    "fp8-block": _Recipe("block", ".weight_scale_inv", _finegrained_config, False),
    "fp8-channel": _Recipe("channel", ".weight_scale", _compressed_config, True),
    "fp8-tensor": _Recipe("tensor", ".weight_scale", _compressed_config, True),
}
assert tuple(RECIPES) == QUANTIZE_SCHEMES


class QuantizedSource(ViewSource):
    """``inner`` with its weights quantized by ``scheme`` (``"fp8-block"``, ``"fp8-channel"``, ``"fp8-tensor"``)."""

    def __init__(self, inner: Source, scheme: str) -> None:
        if scheme not in RECIPES:
            raise InvalidInputError(f"quantize={scheme!r}: expected one of {', '.join(RECIPES)}")
        super().__init__(inner)
        self.scheme, self.recipe = scheme, RECIPES[scheme]
        self._by_name: dict[str, TensorEntry] = {}
        self._weights: dict[str, ScaledWeight] = {}  # output name (weight or scale) → its weight
        self._entries: list[TensorEntry] = []
        self._scale_dtypes: dict[str, str] = {}
        self.skipped: list[str] = []
        for entry in inner.entries():
            self._add(entry)
        self._scales: dict[str, Any] = {}
        self._absmax: dict[str, Any] = {}
        self._errors: dict[str, dict[str, float]] = {}

    def _add(self, entry: TensorEntry) -> None:
        self._by_name[entry.name] = entry
        if not self._quantizes(entry):
            if entry.name.endswith(".weight") and len(entry.shape) >= 2:
                self.skipped.append(entry.name[: -len(".weight")])
            self._entries.append(entry)
            return
        rows, cols = matrix_shape(entry.shape)
        block = {"block": DEFAULT_BLOCK, "channel": (1, cols), "tensor": (rows, cols)}[self.recipe.granularity]
        scale_name = entry.name[: -len(".weight")] + self.recipe.scale_suffix
        weight = ScaledWeight(entry.name, scale_name, self.recipe.granularity, block)
        scale_shape = {"block": (rows // block[0], cols // block[1]), "channel": (rows, 1), "tensor": (1,)}
        self._weights[entry.name] = self._weights[scale_name] = weight
        self._entries.append(TensorEntry(entry.name, "F8_E4M3", entry.shape, tensor_nbytes("F8_E4M3", entry.shape)))
        shape = scale_shape[self.recipe.granularity]
        scale_dtype = entry.dtype if self.recipe.scale_like_weight and entry.dtype in ("BF16", "F16") else "F32"
        self._entries.append(TensorEntry(scale_name, scale_dtype, shape, tensor_nbytes(scale_dtype, shape)))
        self._scale_dtypes[entry.name] = scale_dtype

    def _quantizes(self, entry: TensorEntry) -> bool:
        if should_skip_quantize(entry):
            return False
        rows, cols = matrix_shape(entry.shape)
        return self.recipe.granularity != "block" or (rows % DEFAULT_BLOCK[0] == 0 and cols % DEFAULT_BLOCK[1] == 0)

    def scale_names(self) -> frozenset[str]:
        """The scale tensors written: never cast by ``dtype``."""
        return frozenset(w.scale for w in self._weights.values())

    def entries(self) -> list[TensorEntry]:
        return list(self._entries)

    def read(self, entry: TensorEntry, begin: int, end: int) -> bytes | memoryview:
        weight = self._weights.get(entry.name)
        if weight is None:
            return self.inner.read(self._by_name[entry.name], begin, end)
        if entry.name == weight.scale:
            return self._scale_bytes(weight)[begin:end]
        return b"".join(bytes(c) for c in self._quantized(weight, record=False))[begin:end]

    def chunks(self, entry: TensorEntry, chunk_bytes: int) -> Iterator[bytes | memoryview]:
        weight = self._weights.get(entry.name)
        if weight is None:
            yield from self.inner.chunks(self._by_name[entry.name], chunk_bytes)
        elif entry.name == weight.scale:
            yield self._scale_bytes(weight)
        else:
            yield from self._quantized(weight, record=True)

    def _scale_bytes(self, weight: ScaledWeight) -> memoryview:
        import torch

        if weight.weight not in self._scales:
            for _ in self._quantized(weight, record=True):
                pass
        scale = self._scales.pop(weight.weight)
        return memoryview(scale.contiguous().view(torch.uint8).numpy()).cast("B")

    def _quantized(self, weight: ScaledWeight, *, record: bool) -> Iterator[memoryview]:
        """The e4m3fn bytes of ``weight``, band by band; with ``record``, keep its scales and error."""
        import torch

        from ..formats.dtypes import to_torch
        from ..formats.fp8 import band_rows, dequantize_band, quantize_band

        stored = self._by_name[weight.weight]
        rows, cols = matrix_shape(stored.shape)
        absmax = self._tensor_absmax(weight) if weight.granularity == "tensor" else None
        scales, err_sq, ref_sq, worst = [], 0.0, 0.0, 0.0
        step = band_rows(weight, cols)
        for row0 in range(0, rows, step):
            w = read_rows(self.inner, stored, row0, min(rows, row0 + step)).to(torch.float32)
            q, scale = quantize_band(w, weight.granularity, block=weight.block, absmax=absmax,
                                     scale_dtype=to_torch(self._scale_dtypes[weight.weight]))
            if record:
                diff = dequantize_band(q, scale, weight, 0, torch.float32) - w
                err_sq, ref_sq = err_sq + float(diff.square().sum()), ref_sq + float(w.square().sum())
                worst = max(worst, float(diff.abs().max()) if diff.numel() else 0.0)
                scales.append(scale)
            yield q.view(torch.uint8).numpy().data.cast("B")
        if record:
            self._scales[weight.weight] = scales[0] if weight.granularity == "tensor" else torch.cat(scales)
            self._errors[weight.weight] = {"relative_error": math.sqrt(err_sq / ref_sq) if ref_sq else 0.0,
                                           "max_abs_error": worst}

    def _tensor_absmax(self, weight: ScaledWeight) -> Any:
        import torch

        from ..formats.fp8 import band_rows

        if weight.weight not in self._absmax:
            stored = self._by_name[weight.weight]
            rows, cols = matrix_shape(stored.shape)
            step, found = band_rows(weight, cols), torch.zeros((), dtype=torch.float32)
            for row0 in range(0, rows, step):
                band = read_rows(self.inner, stored, row0, min(rows, row0 + step)).to(torch.float32)
                found = torch.maximum(found, band.abs().amax())
            self._absmax[weight.weight] = found
        return self._absmax[weight.weight]

    def edit_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """The config.json of the output: the recipe's ``quantization_config`` added (replacing any)."""
        return {**config, "quantization_config": self.recipe.config(sorted(self.skipped), self.recipe.granularity)}

    def report(self) -> dict[str, Any]:
        """What was quantized: the scheme, the kept modules, and each tensor's error (after the write)."""
        quantized = [n for n, w in self._weights.items() if n == w.weight]
        return {"scheme": self.scheme, "quantized": len(quantized), "kept": sorted(self.skipped),
                "errors": {n: self._errors[n] for n in quantized if n in self._errors}}

