"""A view of an fp4 checkpoint (NVFP4, MXFP4) as the plain checkpoint it stands for, computed band by band.

:class:`Fp4DequantizedSource` is :class:`~shardkit.sources.dequantized.DequantizedSource`'s counterpart for
the layouts of :mod:`shardkit.layouts.fp4`: each packed weight becomes one dense tensor of the output
dtype (under its dense name: gpt-oss experts ``X_blocks`` → ``X``, transposed), its scales and input
scales disappear, and every other tensor passes through with its file offsets. Memory is one band of
rows (NVFP4) or of one expert's input columns (MXFP4), never the tensor; the arithmetic is
:mod:`shardkit.layouts.fp4_math`, bit-equal to each layout's reference. Scales holding NaN or infinity
are refused before anything is written.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..errors import InvalidInputError
from ..formats.header import TensorEntry
from ..formats.json_types import JsonObject
from ..layouts.fp4 import MODELOPT_NVFP4, MXFP4, Fp4Layout, PackedWeight
from ..layouts.registry import HF_QUANT_CONFIG
from ..units import DTYPE_BITS, tensor_nbytes
from .base import Source
from .dequantized import ViewSource, bytes_in_range, read_rows, read_whole

if TYPE_CHECKING:
    import torch

__all__ = ["Fp4DequantizedSource"]

BAND_BYTES = 16 * 2**20  # float32 bytes of one band's temporaries


class Fp4DequantizedSource(ViewSource):
    """``inner`` with every packed fp4 weight of ``layout`` dequantized to ``out_dtype`` (a safetensors code).

    Raises:
        InvalidInputError: a scale holding NaN or infinity (unless ``allow_lossy``: that weight is then
            passed through packed, as stored).
    """

    def __init__(self, inner: Source, layout: Fp4Layout, out_dtype: str, *, allow_lossy: bool = False) -> None:
        from ..layouts.fp4_math import scale_problems

        super().__init__(inner)
        self.layout, self.out_dtype = layout, out_dtype
        self._by_name = {e.name: e for e in inner.entries()}
        problems = scale_problems(layout, lambda name: read_whole(inner, self._by_name[name]))
        if problems and not allow_lossy:
            raise InvalidInputError(f"{inner.description}: {layout.scheme}: {'; '.join(p for _, p in problems[:3])}; "
                                    "dequantized, these weights would be NaN or infinite (re-export the checkpoint, or "
                                    "pass allow_lossy=True to copy them as they are)")
        broken = {packed for packed, _ in problems}
        self._packed = {w.packed: w for w in layout.weights if w.packed not in broken}
        self._dense = {w.output: w for w in self._packed.values()}
        dropped = layout.extra - {s for w in layout.weights if w.packed in broken for s in (w.scale, w.global_scale)}
        self._entries = [self._output_entry(e) for e in inner.entries() if e.name not in dropped]

    def _output_entry(self, entry: TensorEntry) -> TensorEntry:
        weight = self._packed.get(entry.name)
        if weight is None:
            return entry
        return TensorEntry(weight.output, self.out_dtype, weight.shape, tensor_nbytes(self.out_dtype, weight.shape))

    def entries(self) -> list[TensorEntry]:
        return list(self._entries)

    def read(self, entry: TensorEntry, begin: int, end: int) -> bytes | memoryview:
        weight = self._dense.get(entry.name)
        if weight is None:
            return self.inner.read(self._by_name[entry.name], begin, end)
        return bytes_in_range(self._bands(weight, first_byte=begin), begin, end)

    def chunks(self, entry: TensorEntry, chunk_bytes: int) -> Iterator[bytes | memoryview]:
        weight = self._dense.get(entry.name)
        if weight is None:
            yield from self.inner.chunks(self._by_name[entry.name], chunk_bytes)
            return
        for _, data in self._bands(weight):
            yield data

    def _bands(self, weight: PackedWeight, *, first_byte: int = 0) -> Iterator[tuple[int, memoryview]]:
        """(byte offset in the dense tensor, its bytes) for every band from the one holding ``first_byte`` on."""
        import torch

        from ..formats.dtypes import to_torch

        out_dtype = to_torch(self.out_dtype)
        bands = self._mxfp4_bands if self.layout.scheme == MXFP4 else self._nvfp4_bands
        for offset, band in bands(weight, out_dtype, first_byte):
            yield offset, band.contiguous().view(torch.uint8).numpy().data.cast("B")

    def _nvfp4_bands(self, weight: PackedWeight, out_dtype: torch.dtype, first_byte: int) -> Iterator[tuple[int, torch.Tensor]]:
        from ..layouts.fp4_math import dequantize_nvfp4

        rows, cols = weight.shape
        row_bytes = cols * DTYPE_BITS[self.out_dtype] // 8
        step = max(1, BAND_BYTES // (cols * 4))
        packed, scale = self._by_name[weight.packed], self._by_name[weight.scale]
        assert weight.global_scale is not None  # NVFP4 weights have one
        global_scale = read_whole(self.inner, self._by_name[weight.global_scale])
        modelopt = self.layout.scheme == MODELOPT_NVFP4
        for row0 in range(first_byte // max(1, row_bytes) // step * step, rows, step):
            row1 = min(rows, row0 + step)
            band = dequantize_nvfp4(read_rows(self.inner, packed, row0, row1), read_rows(self.inner, scale, row0, row1),
                                    global_scale, modelopt=modelopt, out_dtype=out_dtype)
            yield row0 * row_bytes, band

    def _mxfp4_bands(self, weight: PackedWeight, out_dtype: torch.dtype, first_byte: int) -> Iterator[tuple[int, torch.Tensor]]:
        """Expert by expert, a run of input columns at a time: dense rows ``(e, c0:c1)`` are the transposed
        dequantized columns ``c0:c1`` of the stored ``(out, in)`` matrix of expert ``e``."""
        from ..layouts.fp4_math import dequantize_mxfp4

        experts, cols, rows = weight.shape  # dense (E, in, out)
        groups = cols // 32
        row_bytes = rows * DTYPE_BITS[self.out_dtype] // 8
        per_band = max(1, BAND_BYTES // (rows * 32 * 4))  # groups of 32 input columns per band
        blocks_entry, scales_entry = self._by_name[weight.packed], self._by_name[weight.scale]
        first_expert = first_byte // max(1, cols * row_bytes)
        for expert in range(first_expert, experts):
            blocks = read_rows(self.inner, blocks_entry, expert, expert + 1).reshape(rows, groups, 16)
            scales = read_rows(self.inner, scales_entry, expert, expert + 1).reshape(rows, groups)
            for g0 in range(0, groups, per_band):
                g1 = min(groups, g0 + per_band)
                dense = dequantize_mxfp4(blocks[:, g0:g1], scales[:, g0:g1], out_dtype).transpose(0, 1)
                yield (expert * cols + g0 * 32) * row_bytes, dense

    def edit_config(self, config: JsonObject) -> JsonObject:
        """The config.json of the output: without ``quantization_config`` (the weights are plain now)."""
        return {k: v for k, v in config.items() if k != "quantization_config"}

    def dropped_side_files(self) -> frozenset[str]:
        """Side files that describe the quantization and go with it: ModelOpt's ``hf_quant_config.json``."""
        return frozenset({HF_QUANT_CONFIG})

    def report(self) -> dict[str, object]:
        """What was dequantized: the layout read, how many weights, how many scale tensors dropped."""
        return {"dequantized": self.layout.describe(), "dtype": self.out_dtype, "weights": len(self._packed),
                "dropped": len(self.layout.extra)}
