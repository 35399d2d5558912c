"""A view of an fp8-with-scales checkpoint as the plain checkpoint it stands for: weight × scale.

:class:`DequantizedSource` wraps any source whose :class:`~shardkit.layouts.fp8.QuantLayout` is
known: every scaled weight becomes one tensor of the output dtype (computed band by band of rows, a
whole number of scale blocks at a time, so memory never depends on the tensor's size), the scales,
input scales and markers disappear, and every other tensor passes through with its file offsets (still
copied kernel-side). ``edit_config`` drops ``quantization_config`` from the checkpoint's config.json.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from ..errors import InvalidInputError
from ..formats.header import TensorEntry
from ..formats.json_types import JsonObject
from ..layouts.fp8 import COMFY_METADATA_KEY, QuantLayout, ScaledWeight, matrix_shape
from ..units import DTYPE_BITS, tensor_nbytes
from .base import Source

if TYPE_CHECKING:
    import torch

__all__ = ["DequantizedSource", "ViewSource", "bytes_in_range", "read_rows", "read_whole"]


def bytes_in_range(pieces: Iterable[tuple[int, bytes | memoryview]], begin: int, end: int) -> bytes:
    """Bytes ``[begin, end)`` of a tensor made as consecutive ``(byte offset, bytes)`` pieces, the first
    starting at or before ``begin`` (bands of dequantized rows); pieces past ``end`` are not drawn."""
    out: list[bytes] = []
    for start, data in pieces:
        stop = start + len(data)
        if stop > begin:
            out.append(bytes(memoryview(data)[max(0, begin - start):max(0, min(end, stop) - start)]))
        if stop >= end:
            break
    return b"".join(out)


def read_whole(source: Source, entry: TensorEntry) -> torch.Tensor:
    """``entry``'s whole tensor in its stored dtype (for small tensors: scales)."""
    from ..layouts.fp8_math import tensor_from_bytes

    raw = source.read(entry, 0, entry.nbytes)
    if len(raw) != entry.nbytes:
        raise InvalidInputError(f"{source.description}: short read of {entry.name} ({len(raw)} of {entry.nbytes} "
                                "bytes; file truncated?)")
    return tensor_from_bytes(raw, entry.dtype, entry.shape)


def read_rows(source: Source, entry: TensorEntry, row0: int, row1: int) -> torch.Tensor:
    """Rows ``row0:row1`` of ``entry`` seen as a matrix (:func:`~shardkit.layouts.fp8.matrix_shape`)."""
    from ..layouts.fp8_math import tensor_from_bytes

    cols = matrix_shape(entry.shape)[1]
    row_bytes = cols * DTYPE_BITS[entry.dtype] // 8
    raw = source.read(entry, row0 * row_bytes, row1 * row_bytes)
    if len(raw) != (row1 - row0) * row_bytes:
        raise InvalidInputError(f"{source.description}: short read of {entry.name} rows {row0}:{row1} "
                                f"({len(raw)} of {(row1 - row0) * row_bytes} bytes; file truncated?)")
    return tensor_from_bytes(raw, entry.dtype, (row1 - row0, cols))


class ViewSource(Source):
    """A source computed from ``inner``: it names the same files, keeps its metadata and aliases, closes it."""

    def __init__(self, inner: Source) -> None:
        self.inner = inner
        self.description, self.naming, self.paths = inner.description, inner.naming, inner.paths
        self.kernel_copy, self.shard_rule = inner.kernel_copy, inner.shard_rule

    def metadata(self) -> dict[str, str]:
        return self.inner.metadata()

    def aliases(self) -> dict[str, str]:
        return self.inner.aliases()

    def held_fd(self, path: str) -> int | None:
        return self.inner.held_fd(path)

    def close(self) -> None:
        self.inner.close()


class DequantizedSource(ViewSource):
    """``inner`` with every scaled weight dequantized to ``out_dtype`` (a safetensors code) and its scales gone."""

    def __init__(self, inner: Source, layout: QuantLayout, out_dtype: str) -> None:
        super().__init__(inner)
        self.layout, self.out_dtype = layout, out_dtype
        self._by_name = {e.name: e for e in inner.entries()}
        self._scaled = {w.weight: w for w in layout.weights}
        self._entries = [self._output_entry(e) for e in inner.entries() if e.name not in layout.extra]
        self._check_fused()

    def _output_entry(self, entry: TensorEntry) -> TensorEntry:
        if entry.name not in self._scaled:
            return entry
        return TensorEntry(entry.name, self.out_dtype, entry.shape, tensor_nbytes(self.out_dtype, entry.shape))

    def _check_fused(self) -> None:
        """Several per-tensor scales on one (fused) weight are usable only when they agree."""
        from ..layouts.fp8_math import refuse_disagreeing, scale_to_float32

        refuse_disagreeing({w.scale: scale_to_float32(read_whole(self.inner, self._by_name[w.scale]), name=w.scale)
                            for w in self.layout.weights if w.granularity == "fused"}, where=self.description)

    def entries(self) -> list[TensorEntry]:
        return list(self._entries)

    def metadata(self) -> dict[str, str]:
        return {k: v for k, v in self.inner.metadata().items() if k != COMFY_METADATA_KEY}

    def read(self, entry: TensorEntry, begin: int, end: int) -> bytes | memoryview:
        weight = self._scaled.get(entry.name)
        if weight is None:
            return self.inner.read(self._by_name[entry.name], begin, end)
        row_bytes = entry.nbytes // max(1, matrix_shape(entry.shape)[0])
        first = begin // row_bytes if row_bytes else 0
        bands = ((row0 * row_bytes, data) for row0, data in self._bands(weight, first_row=first))
        return bytes_in_range(bands, begin, end)

    def chunks(self, entry: TensorEntry, chunk_bytes: int) -> Iterator[bytes | memoryview]:
        weight = self._scaled.get(entry.name)
        if weight is None:
            yield from self.inner.chunks(self._by_name[entry.name], chunk_bytes)
            return
        for _, data in self._bands(weight):
            yield data

    def _bands(self, weight: ScaledWeight, *, first_row: int = 0) -> Iterator[tuple[int, memoryview]]:
        """(first row, bytes of the dequantized rows) for bands from ``first_row`` (rounded down to a block) on."""
        import torch

        from ..formats.dtypes import to_torch
        from ..layouts.fp8_math import band_rows, dequantize_band, scale_to_float32

        stored = self._by_name[weight.weight]
        rows, cols = matrix_shape(stored.shape)
        scale = scale_to_float32(read_whole(self.inner, self._by_name[weight.scale]), name=weight.scale)
        step, out_dtype = band_rows(weight, cols), to_torch(self.out_dtype)
        start = first_row // step * step
        for row0 in range(start, rows, step):
            row1 = min(rows, row0 + step)
            band = dequantize_band(read_rows(self.inner, stored, row0, row1), scale, weight, row0, out_dtype)
            yield row0, band.contiguous().view(torch.uint8).numpy().data.cast("B")

    def edit_config(self, config: JsonObject) -> JsonObject:
        """The config.json of the output: without ``quantization_config`` (the weights are plain now)."""
        return {k: v for k, v in config.items() if k != "quantization_config"}

    def report(self) -> dict[str, object]:
        """What was dequantized: the layout read, how many weights, how many scale/marker tensors dropped."""
        return {"dequantized": self.layout.describe(), "dtype": self.out_dtype, "weights": len(self.layout.weights),
                "dropped": len(self.layout.extra)}

