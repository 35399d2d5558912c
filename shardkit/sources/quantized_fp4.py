"""A view of a plain checkpoint quantized to fp4, in the layout its loaders read, computed as it is written.

:class:`Fp4QuantizedSource` is :class:`~shardkit.sources.quantized.QuantizedSource`'s counterpart for fp4:

- ``nvfp4``: each 2-D float ``.weight`` that :func:`~shardkit.layouts.fp8.should_skip_quantize` does
  not keep (and whose input dimension is a multiple of 16) becomes compressed-tensors
  ``nvfp4-pack-quantized``: ``X.weight_packed``, ``X.weight_scale`` (e4m3 per 16) and
  ``X.weight_global_scale`` (``[1]``), computed as compressed-tensors' observers and compressor do
  (bit-equal); ``quantization_config`` is the NVFP4A16 preset vLLM and transformers read.
- ``mxfp4``: gpt-oss-style MoE experts (``….experts.gate_up_proj`` / ``down_proj``, dense (E, in, out))
  become ``X_blocks`` (E, out, in/32, 16) and ``X_scales`` (E, out, in/32), as the released gpt-oss
  checkpoints hold them, with ``quantization_config`` ``{"quant_method": "mxfp4"}``.

Band by band of rows (one expert at a time for MXFP4): memory never depends on the tensor's size. The
global scale of an NVFP4 weight needs its absmax first: one extra read of that weight.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..errors import InvalidInputError
from ..formats.header import TensorEntry
from ..formats.json_types import JsonObject
from ..layouts.fp4_quantize import FP4_SCHEMES, Fp4Target, fp4_config, fp4_target
from .base import Source
from .dequantized import ViewSource, read_rows
from .memory import host_bytes

if TYPE_CHECKING:
    import torch

__all__ = ["FP4_SCHEMES", "Fp4QuantizedSource"]

BAND_BYTES = 16 * 2**20

class Fp4QuantizedSource(ViewSource):
    """``inner`` with its weights quantized by ``scheme`` (``"nvfp4"`` or ``"mxfp4"``)."""

    def __init__(self, inner: Source, scheme: str) -> None:
        if scheme not in FP4_SCHEMES:
            raise InvalidInputError(f"quantize={scheme!r}: expected one of {', '.join(FP4_SCHEMES)}")
        super().__init__(inner)
        self.scheme = scheme
        self._by_name = {e.name: e for e in inner.entries()}
        self._targets: dict[str, Fp4Target] = {}  # every name written for a quantized weight → its target
        self._entries: list[TensorEntry] = []
        self.skipped: list[str] = []
        for entry in inner.entries():
            self._add(entry)
        if not any(t.packed == n for n, t in self._targets.items()):
            wanted = ("gpt-oss-style MoE experts (….experts.gate_up_proj / down_proj, 3-D, input dimension a multiple "
                      "of 32)" if scheme == "mxfp4" else "2-D linear weights (input dimension a multiple of 16)")
            raise InvalidInputError(f"{inner.description}: quantize={scheme!r} found nothing to quantize: it applies "
                                    f"to {wanted}")
        self._scales: dict[str, bytes] = {}
        self._global: dict[str, torch.Tensor] = {}
        self._errors: dict[str, dict[str, float]] = {}

    def _add(self, entry: TensorEntry) -> None:
        target = fp4_target(entry, self.scheme)
        if target is None:
            if entry.name.endswith(".weight") and len(entry.shape) >= 2:
                self.skipped.append(entry.name[: -len(".weight")])
            self._entries.append(entry)
            return
        self._entries += target.written
        for written in target.written:
            self._targets[written.name] = target

    def scale_names(self) -> frozenset[str]:
        """The tensors written for quantized weights: never cast by ``dtype``."""
        return frozenset(self._targets)

    def entries(self) -> list[TensorEntry]:
        return list(self._entries)

    def read(self, entry: TensorEntry, begin: int, end: int) -> bytes | memoryview:
        return b"".join(bytes(c) for c in self.chunks(entry, max(1, end)))[begin:end]

    def chunks(self, entry: TensorEntry, chunk_bytes: int) -> Iterator[bytes | memoryview]:
        target = self._targets.get(entry.name)
        if target is None:
            yield from self.inner.chunks(self._by_name[entry.name], chunk_bytes)
        elif entry.name == target.packed:
            yield from self._quantized(target)
        elif entry.name == target.scale:
            if target.packed not in self._scales:
                for _ in self._quantized(target):
                    pass
            yield self._scales.pop(target.packed)
        else:
            yield host_bytes(self._global_scale(target))

    def _quantized(self, target: Fp4Target) -> Iterator[memoryview]:
        """The packed bytes of ``target``, band by band; its scales are kept for their own tensor, its error recorded."""
        import torch

        from ..layouts.fp4_math import dequantize_mxfp4, dequantize_nvfp4, quantize_mxfp4, quantize_nvfp4

        scales, err_sq, ref_sq, worst = [], 0.0, 0.0, 0.0
        for band in self._bands(target):
            if self.scheme == "nvfp4":
                global_scale = self._global_scale(target)
                packed, scale = quantize_nvfp4(band, global_scale)
                back = dequantize_nvfp4(packed, scale, global_scale, modelopt=False, out_dtype=torch.float32)
            else:
                packed, scale = quantize_mxfp4(band)
                back = dequantize_mxfp4(packed, scale, torch.float32)
            diff = back - band.to(torch.float32)
            err_sq, ref_sq = err_sq + float(diff.square().sum()), ref_sq + float(band.to(torch.float32).square().sum())
            worst = max(worst, float(diff.abs().max()) if diff.numel() else 0.0)
            scales.append(host_bytes(scale))
            yield host_bytes(packed)
        self._scales[target.packed] = b"".join(bytes(s) for s in scales)
        self._errors[target.source.name] = {"relative_error": math.sqrt(err_sq / ref_sq) if ref_sq else 0.0,
                                            "max_abs_error": worst}

    def _bands(self, target: Fp4Target) -> Iterator[torch.Tensor]:
        """NVFP4: bands of rows, as stored; MXFP4: one expert at a time, as (out, in) rows."""
        if self.scheme == "mxfp4":
            experts, cols, rows = target.source.shape
            for expert in range(experts):
                dense = read_rows(self.inner, target.source, expert, expert + 1).reshape(cols, rows)
                yield dense.transpose(0, 1).contiguous()
            return
        rows, cols = target.source.shape
        step = max(1, BAND_BYTES // (cols * 4))
        for row0 in range(0, rows, step):
            yield read_rows(self.inner, target.source, row0, min(rows, row0 + step))

    def _global_scale(self, target: Fp4Target) -> torch.Tensor:
        """compressed-tensors' global scale of ``target`` (from its absmax, in its stored dtype)."""
        import torch

        from ..layouts.fp4_math import nvfp4_global_scale

        if target.packed not in self._global:
            absmax = None
            for band in self._bands(target):
                top = torch.max(band.amin().clamp(max=0).abs(), band.amax().clamp(min=0))
                absmax = top if absmax is None else torch.max(absmax, top)
            assert absmax is not None  # a quantized weight has rows
            self._global[target.packed] = nvfp4_global_scale(absmax)
        return self._global[target.packed]

    def edit_config(self, config: JsonObject) -> JsonObject:
        """The config.json of the output: the scheme's ``quantization_config`` added (replacing any)."""
        return {**config, "quantization_config": fp4_config(self.scheme, self.skipped)}

    def report(self) -> dict[str, object]:
        """What was quantized: the scheme, how many weights, the kept modules, each weight's error (after the write)."""
        quantized = sorted({t.source.name for t in self._targets.values()})
        return {"scheme": self.scheme, "quantized": len(quantized), "kept": sorted(self.skipped),
                "errors": {n: self._errors[n] for n in quantized if n in self._errors}}


