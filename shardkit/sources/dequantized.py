"""A view of a quantized checkpoint (fp8 with scales, NVFP4, MXFP4) as the plain checkpoint it stands for.

:class:`DequantizedSource` wraps any source whose quantized layout is known
(:func:`~shardkit.layouts.registry.find_quant_layout`): every quantized weight becomes one dense tensor of
the output dtype, under its dense name (gpt-oss experts ``X_blocks`` → ``X``, transposed), computed band
by band by the layout's strategy (:func:`~shardkit.layouts.registry.dequantizer`), so memory never depends
on the tensor's size; the scales, input scales and markers disappear, and every other tensor passes through
with its file offsets (still copied kernel-side). ``edit_config`` drops ``quantization_config`` from the
checkpoint's config.json. Scales that cannot be used (fp4 scales holding NaN or infinity, fused fp8 scales
that disagree) are refused before anything is written.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from ..errors import InvalidInputError
from ..formats.header import TensorEntry
from ..formats.json_types import JsonObject
from ..layouts.fp8 import matrix_shape
from ..layouts.quant import DenseWeight, dense_entries
from ..layouts.registry import AnyLayout, dequantizer
from ..units import DTYPE_BITS
from .base import Source

if TYPE_CHECKING:
    import torch

__all__ = ["DequantizedSource", "SourceReader", "ViewSource", "bytes_in_range", "read_rows", "read_whole"]


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


class SourceReader:
    """``source``'s stored tensors by name, for the layouts' strategies (a :class:`~shardkit.layouts.quant.TensorReader`)."""

    def __init__(self, source: Source, by_name: dict[str, TensorEntry]) -> None:
        self.source, self.by_name = source, by_name

    def whole(self, name: str) -> torch.Tensor:
        return read_whole(self.source, self.by_name[name])

    def rows(self, name: str, row0: int, row1: int) -> torch.Tensor:
        return read_rows(self.source, self.by_name[name], row0, row1)


class DequantizedSource(ViewSource):
    """``inner`` with every quantized weight of ``layout`` dequantized to ``out_dtype`` (a safetensors code) and its
    scales gone.

    Raises:
        InvalidInputError: scales that cannot be used (unless ``allow_lossy``, where the layout allows it: those
            weights are then passed through as stored).
    """

    def __init__(self, inner: Source, layout: AnyLayout, out_dtype: str, *, allow_lossy: bool = False) -> None:
        super().__init__(inner)
        self.layout, self.out_dtype = layout, out_dtype
        self._by_name = {e.name: e for e in inner.entries()}
        self._reader = SourceReader(inner, self._by_name)
        self.dequantizer = dequantizer(layout, inner.entries())
        broken = self.dequantizer.broken(self._reader, where=inner.description, allow_lossy=allow_lossy)
        weights = [w for w in self.dequantizer.weights() if w.stored not in broken]
        self._dense = {w.name: w for w in weights}
        dropped = layout.extra - {s for w in self.dequantizer.weights() if w.stored in broken for s in w.scales}
        self._entries = dense_entries(weights, inner.entries(), dropped=dropped, dtype=out_dtype)

    def entries(self) -> list[TensorEntry]:
        return list(self._entries)

    def metadata(self) -> dict[str, str]:
        return {k: v for k, v in self.inner.metadata().items() if k not in self.dequantizer.dropped_metadata}

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

    def _bands(self, weight: DenseWeight, *, first_byte: int = 0) -> Iterator[tuple[int, memoryview]]:
        """(byte offset in the dense tensor, its bytes) for every band from the one holding ``first_byte`` on."""
        import torch

        from ..formats.dtypes import to_torch

        item_bytes = max(1, DTYPE_BITS[self.out_dtype] // 8)
        bands = self.dequantizer.dense_bands(self._reader, weight, to_torch(self.out_dtype), first=first_byte // item_bytes)
        for offset, band in bands:
            yield offset * item_bytes, band.contiguous().view(torch.uint8).numpy().data.cast("B")

    def edit_config(self, config: JsonObject) -> JsonObject:
        """The config.json of the output: without ``quantization_config`` (the weights are plain now)."""
        return {k: v for k, v in config.items() if k != "quantization_config"}

    def dropped_side_files(self) -> frozenset[str]:
        """Side files that describe the quantization and go with it: ModelOpt's ``hf_quant_config.json``."""
        return self.dequantizer.side_files

    def report(self) -> dict[str, object]:
        """What was dequantized: the layout read, how many weights, how many scale and marker tensors dropped."""
        return {"dequantized": self.layout.describe(), "dtype": self.out_dtype, "weights": len(self._dense),
                "dropped": len(self.layout.extra)}
