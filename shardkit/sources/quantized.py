"""A view of a plain checkpoint quantized in a layout that loaders read, computed as it is written.

:class:`QuantizedSource` wraps any source and one quantized layout of the registry
(:func:`~shardkit.layouts.registry.quant_strategy`): every weight the layout's strategy quantizes becomes
the tensors it writes (the quantized weight, then its scales), computed band by band (memory never depends
on the tensor's size); everything else passes through with its file offsets. The layouts written:

- ``fp8-block``: 128×128 blocks, ``X.weight_scale_inv`` (transformers FineGrainedFP8); a weight whose
  dimensions are not multiples of 128 is kept, since transformers' loader derives the block from the
  scale grid and would misread it;
- ``fp8-channel`` / ``fp8-tensor``: ``X.weight_scale`` of shape ``(out, 1)`` / ``(1,)``
  (compressed-tensors ``float-quantized``);
- ``nvfp4``: compressed-tensors ``nvfp4-pack-quantized`` (``X.weight_packed``, ``X.weight_scale``,
  ``X.weight_global_scale``), bit-equal to compressed-tensors' own compressor;
- ``mxfp4``: gpt-oss-style MoE experts as ``X_blocks`` and ``X_scales``.

``edit_config`` adds the layout's ``quantization_config`` (the kept modules in ``modules_to_not_convert`` /
``ignore``), and :meth:`QuantizedSource.report` gives the quantization error of every weight written.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..errors import InvalidInputError, Option
from ..formats.header import TensorEntry
from ..formats.json_types import JsonObject
from ..layouts.quant import BandBytes, QuantTarget, quantized_table
from ..layouts.registry import quant_strategy
from .base import Source
from .dequantized import SourceReader, ViewSource
from .memory import host_bytes

if TYPE_CHECKING:
    import torch

__all__ = ["QuantizedSource"]


class QuantizedSource(ViewSource):
    """``inner`` with its weights quantized by ``scheme`` (``"fp8-block"``, ``"fp8-channel"``, ``"fp8-tensor"``,
    ``"nvfp4"``, ``"mxfp4"``).

    Raises:
        InvalidInputError: an unknown scheme, or one that found nothing to quantize where that is an error.
    """

    def __init__(self, inner: Source, scheme: str) -> None:
        self.strategy = quant_strategy(scheme)
        super().__init__(inner)
        self.scheme = scheme
        self._by_name = {e.name: e for e in inner.entries()}
        self._reader = SourceReader(inner, self._by_name)
        table = quantized_table(self.strategy, inner.entries())
        self._entries, self.skipped = list(table.entries), list(table.kept)
        self._targets = {written.name: t for t in table.targets for written in t.written}  # every name written → its target
        if self.strategy.applies_to is not None and not table.targets:
            raise InvalidInputError(f"{inner.description}: ", Option("quantize", scheme),
                                    " found nothing to quantize: it applies "
                                    f"to {self.strategy.applies_to}")
        self._side: dict[str, BandBytes] = {}  # scales computed with their weight, until read
        self._prepared: dict[str, torch.Tensor | None] = {}
        self._errors: dict[str, dict[str, float]] = {}

    def scale_names(self) -> frozenset[str]:
        """The tensors written for quantized weights: never cast by ``dtype``."""
        return frozenset(self._targets)

    def entries(self) -> list[TensorEntry]:
        return list(self._entries)

    def read(self, entry: TensorEntry, begin: int, end: int) -> bytes | memoryview:
        if entry.name not in self._targets:
            return self.inner.read(self._by_name[entry.name], begin, end)
        return b"".join(bytes(c) for c in self.chunks(entry, max(1, end)))[begin:end]

    def chunks(self, entry: TensorEntry, chunk_bytes: int) -> Iterator[bytes | memoryview]:
        target = self._targets.get(entry.name)
        if target is None:
            yield from self.inner.chunks(self._by_name[entry.name], chunk_bytes)
        elif entry.name == target.written[0].name:
            yield from self._quantized(target)
        else:
            if entry.name not in self._side:
                for _ in self._quantized(target):
                    pass
            yield self._side.pop(entry.name)

    def _quantized(self, target: QuantTarget) -> Iterator[memoryview]:
        """The quantized bytes of ``target``, band by band; its scales are kept for their own tensors, its error
        recorded."""
        import torch

        name = target.source.name
        if name not in self._prepared:
            self._prepared[name] = self.strategy.prepare(self._reader, target)
        prepared = self._prepared[name]
        scales, err_sq, ref_sq, worst = [], 0.0, 0.0, 0.0
        for band in self.strategy.source_bands(self._reader, target):
            q, scale = self.strategy.quantize_band(band, target, prepared)
            plain = band.to(torch.float32)
            diff = self.strategy.dequantize_band(q, scale, target, prepared) - plain
            err_sq, ref_sq = err_sq + float(diff.square().sum()), ref_sq + float(plain.square().sum())
            worst = max(worst, float(diff.abs().max()) if diff.numel() else 0.0)
            scales.append(scale)
            yield host_bytes(q)
        side = self.strategy.side_bytes(target, scales, prepared)
        self._side.update({written.name: data for written, data in zip(target.written[1:], side, strict=True)})
        self._errors[name] = {"relative_error": math.sqrt(err_sq / ref_sq) if ref_sq else 0.0, "max_abs_error": worst}

    def edit_config(self, config: JsonObject) -> JsonObject:
        """The config.json of the output: the layout's ``quantization_config`` added (replacing any)."""
        return {**config, "quantization_config": self.strategy.quantization_config(self.skipped)}

    def report(self) -> dict[str, object]:
        """What was quantized: the scheme, how many weights, the kept modules, each weight's error (after the write)."""
        quantized = list(dict.fromkeys(t.source.name for t in self._targets.values()))
        return {"scheme": self.scheme, "quantized": len(quantized), "kept": sorted(self.skipped),
                "errors": {n: self._errors[n] for n in quantized if n in self._errors}}
