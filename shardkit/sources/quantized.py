"""A view of a checkpoint quantized to fp8 with scales, in a layout that loaders read, computed as it is written.

:class:`QuantizedSource` wraps any source. Each 2-D float ``.weight`` that
:func:`~shardkit.layouts.fp8.should_skip_quantize` does not keep becomes an e4m3fn weight plus its
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
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..errors import InvalidInputError
from ..formats.header import TensorEntry
from ..formats.json_types import JsonObject
from ..layouts.fp8 import ScaledWeight, matrix_shape
from ..layouts.fp8_quantize import QUANTIZE_RECIPES
from .base import Source
from .dequantized import ViewSource, read_rows
from .memory import host_bytes

if TYPE_CHECKING:
    import torch

__all__ = ["QuantizedSource"]


class QuantizedSource(ViewSource):
    """``inner`` with its weights quantized by ``scheme`` (``"fp8-block"``, ``"fp8-channel"``, ``"fp8-tensor"``)."""

    def __init__(self, inner: Source, scheme: str) -> None:
        if scheme not in QUANTIZE_RECIPES:
            raise InvalidInputError(f"quantize={scheme!r}: expected one of {', '.join(QUANTIZE_RECIPES)}")
        super().__init__(inner)
        self.scheme, self.recipe = scheme, QUANTIZE_RECIPES[scheme]
        self._by_name: dict[str, TensorEntry] = {}
        self._weights: dict[str, ScaledWeight] = {}  # output name (weight or scale) → its weight
        self._entries: list[TensorEntry] = []
        self._scale_dtypes: dict[str, str] = {}
        self.skipped: list[str] = []
        for entry in inner.entries():
            self._add(entry)
        self._scales: dict[str, torch.Tensor] = {}
        self._absmax: dict[str, torch.Tensor] = {}
        self._errors: dict[str, dict[str, float]] = {}

    def _add(self, entry: TensorEntry) -> None:
        self._by_name[entry.name] = entry
        target = self.recipe.target(entry)
        if target is None:
            if entry.name.endswith(".weight") and len(entry.shape) >= 2:
                self.skipped.append(entry.name[: -len(".weight")])
            self._entries.append(entry)
            return
        weight, stored, scale = target
        self._weights[entry.name] = self._weights[weight.scale] = weight
        self._entries += [stored, scale]
        self._scale_dtypes[entry.name] = scale.dtype

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
        if weight.weight not in self._scales:
            for _ in self._quantized(weight, record=True):
                pass
        scale = self._scales.pop(weight.weight)
        return host_bytes(scale)

    def _quantized(self, weight: ScaledWeight, *, record: bool) -> Iterator[memoryview]:
        """The e4m3fn bytes of ``weight``, band by band; with ``record``, keep its scales and error."""
        import torch

        from ..formats.dtypes import to_torch
        from ..layouts.fp8_math import band_rows, dequantize_band, quantize_band

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

    def _tensor_absmax(self, weight: ScaledWeight) -> torch.Tensor:
        import torch

        from ..layouts.fp8_math import band_rows

        if weight.weight not in self._absmax:
            stored = self._by_name[weight.weight]
            rows, cols = matrix_shape(stored.shape)
            step, found = band_rows(weight, cols), torch.zeros((), dtype=torch.float32)
            for row0 in range(0, rows, step):
                band = read_rows(self.inner, stored, row0, min(rows, row0 + step)).to(torch.float32)
                found = torch.maximum(found, band.abs().amax())
            self._absmax[weight.weight] = found
        return self._absmax[weight.weight]

    def edit_config(self, config: JsonObject) -> JsonObject:
        """The config.json of the output: the recipe's ``quantization_config`` added (replacing any)."""
        return {**config, "quantization_config": self.recipe.config(sorted(self.skipped), self.recipe.granularity)}

    def report(self) -> dict[str, object]:
        """What was quantized: the scheme, the kept modules, and each tensor's error (after the write)."""
        quantized = [n for n, w in self._weights.items() if n == w.weight]
        return {"scheme": self.scheme, "quantized": len(quantized), "kept": sorted(self.skipped),
                "errors": {n: self._errors[n] for n in quantized if n in self._errors}}

