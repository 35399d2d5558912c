"""A source over diffusers model folders that presents their tensors under the original single-file names.

A renamed tensor is an entry that points at its bytes in the diffusers file (new name, maybe a
new shape, same file and offset), so the writer copies it kernel-side. A fused tensor has no
file. When its parts are byte runs of the diffusers tensors (q/k/v and Flux's ``linear1``
stacked along rows, an adaLN whose halves are swapped) it is read run by run, in the writer's
chunks: no copy of it is ever held. Otherwise (OpenCLIP's transposed ``text_projection``) it is
assembled in memory when the writer first reads it and dropped when the writer moves on, so at
most one such tensor is held at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from ..errors import InvalidInputError
from ..formats.header import TensorEntry
from ..formats.index import Naming
from ..layouts.single_file_trace import Original, contiguous_strides
from ..units import tensor_nbytes
from . import open_source
from .base import Source
from .memory import host_bytes

__all__ = ["OriginalLayoutSource"]

Tracer = Callable[[Any, Mapping[str, tuple[int, ...]]], Mapping[str, Original]]


class OriginalLayoutSource(Source):
    """The tensors of one or more diffusers model sources, named and fused as in the original layout."""

    def __init__(self, parts: Sequence[tuple[Source, Mapping[str, Original]]], *, metadata: Mapping[str, str],
                 description: str) -> None:
        self.description = description
        self.naming = Naming("model")
        self._parts = list(parts)
        self._metadata = dict(metadata)
        self.paths = tuple(p for inner, _ in self._parts for p in inner.paths)
        self.kernel_copy = all(inner.kernel_copy for inner, _ in self._parts)
        self._entries: list[TensorEntry] = []
        self._from: dict[str, tuple[Source, dict[str, TensorEntry], Original]] = {}
        for inner, originals in self._parts:
            by_name = {e.name: e for e in inner.entries()}
            for original in originals.values():
                if original.name in self._from:
                    raise InvalidInputError(f"{description}: two components write {original.name}")
                self._entries.append(_entry_for(original, by_name))
                self._from[original.name] = (inner, by_name, original)
        self._cached: tuple[str, memoryview] | None = None

    @classmethod
    def open(cls, parts: Sequence[Any], *, variant: str | None, trace: Tracer, metadata: Mapping[str, str],
             description: str) -> OriginalLayoutSource:
        """Open every part's folder, trace its layout, and wrap them; the folders are closed on failure."""
        opened: list[tuple[Source, Mapping[str, Original]]] = []
        try:
            for part in parts:
                inner = open_source(part.folder, variant=variant)
                opened.append((inner, {}))
                shapes = {e.name: tuple(e.shape) for e in inner.entries()}
                opened[-1] = (inner, trace(part, shapes))
            return cls(opened, metadata=metadata, description=description)
        except BaseException:
            for inner, _ in opened:
                inner.close()
            raise

    def entries(self) -> list[TensorEntry]:
        return list(self._entries)

    def metadata(self) -> dict[str, str]:
        return dict(self._metadata)

    def read(self, entry: TensorEntry, begin: int, end: int) -> bytes | memoryview:
        inner, by_name, original = self._from[entry.name]
        name = original.renamed_from
        if name is not None:
            return inner.read(by_name[name], begin, end)
        runs = _byte_runs(original, by_name)
        if runs is not None:
            return _read_runs(inner, runs, begin, end)
        if self._cached is None or self._cached[0] != entry.name:
            self._cached = None  # the previous fused tensor goes before the next is built
            self._cached = (entry.name, host_bytes(_assemble(original, inner, by_name)))
        return self._cached[1][begin:end]

    def chunks(self, entry: TensorEntry, chunk_bytes: int) -> Iterator[bytes | memoryview]:
        """A fused tensor of byte runs comes run by run (no joined copy); anything else as :meth:`read` gives it."""
        inner, by_name, original = self._from[entry.name]
        runs = None if original.renamed_from is not None else _byte_runs(original, by_name)
        if runs is None:
            yield from super().chunks(entry, chunk_bytes)
            return
        for _, nbytes, part, src in runs:
            for begin in range(0, nbytes, chunk_bytes):
                yield inner.read(part, src + begin, src + min(begin + chunk_bytes, nbytes))

    def held_fd(self, path: str) -> int | None:
        for inner, _ in self._parts:
            fd = inner.held_fd(path)
            if fd is not None:
                return fd
        return None

    def close(self) -> None:
        self._cached = None
        for inner, _ in self._parts:
            inner.close()
        super().close()


def _entry_for(original: Original, by_name: Mapping[str, TensorEntry]) -> TensorEntry:
    """The output entry of ``original``: the diffusers tensor's bytes when it is a rename, else to assemble."""
    missing = [p.target for p in original.pieces if p.target not in by_name]
    if missing:
        raise InvalidInputError(f"{original.name}: diffusers' conversion fills it from {missing[0]}, which the folder "
                                "does not hold")
    name = original.renamed_from
    if name is not None:
        e = by_name[name]
        return TensorEntry(original.name, e.dtype, original.shape, e.nbytes, e.file, e.offset)
    dtypes = {by_name[p.target].dtype for p in original.pieces}
    if len(dtypes) != 1:
        raise InvalidInputError(f"{original.name} fuses tensors of different dtypes ({', '.join(sorted(dtypes))}); "
                                "save the model in one dtype first")
    dtype = dtypes.pop()
    return TensorEntry(original.name, dtype, original.shape, tensor_nbytes(dtype, original.shape))


Run = tuple[int, int, TensorEntry, int]  # (offset in the fused tensor, bytes, diffusers entry, offset in it)


def _byte_runs(original: Original, by_name: Mapping[str, TensorEntry]) -> list[Run] | None:
    """The fused tensor as byte runs of its diffusers tensors, or None when a slab is not one run of either."""
    runs = []
    for p in original.pieces:
        entry = by_name[p.target]
        numel = math.prod(entry.shape)
        if not numel or p.strides != contiguous_strides(p.shape) or math.prod(entry.shape[: p.dim]) != 1:
            return None
        itemsize = entry.nbytes // numel
        row_bytes = math.prod(entry.shape[p.dim + 1:]) * itemsize
        runs.append((p.offset * itemsize, p.length * row_bytes, entry, p.start * row_bytes))
    return sorted(runs, key=lambda run: run[0])


def _read_runs(inner: Source, runs: list[Run], begin: int, end: int) -> bytes:
    """Bytes ``begin:end`` of a fused tensor, read from the runs that overlap them."""
    parts = []
    for at, nbytes, entry, src in runs:
        lo, hi = max(begin, at), min(end, at + nbytes)
        if lo < hi:
            parts.append(inner.read(entry, src + lo - at, src + hi - at))
    data = b"".join(parts)
    if len(data) != end - begin:
        raise InvalidInputError(f"{inner.description}: a fused tensor's runs gave {len(data)} of {end - begin} bytes")
    return data


def _assemble(original: Original, inner: Source, by_name: Mapping[str, TensorEntry]) -> Any:
    """Build a fused tensor from its diffusers slabs (each slab's bytes read once)."""
    import torch

    from ..formats.dtypes import to_torch

    dtype = to_torch(by_name[original.pieces[0].target].dtype)
    out = torch.empty(original.shape, dtype=dtype)
    for target in dict.fromkeys(p.target for p in original.pieces):
        entry = by_name[target]
        data = bytearray(inner.read(entry, 0, entry.nbytes))
        if len(data) != entry.nbytes:
            raise InvalidInputError(f"{inner.description}: {target} gave {len(data)} of its {entry.nbytes} bytes")
        tensor = torch.frombuffer(data, dtype=dtype).reshape(entry.shape) if entry.nbytes else \
            torch.empty(entry.shape, dtype=dtype)
        for p in original.pieces:
            if p.target == target:
                out.as_strided(p.shape, p.strides, p.offset).copy_(tensor.narrow(p.dim, p.start, p.length)
                                                                  if tensor.dim() else tensor)
    assert math.prod(out.shape) == math.prod(original.shape)
    return out
