"""A source over diffusers model folders that presents their tensors under the original single-file names.

A renamed tensor is an entry that points at its bytes in the diffusers file (new name, maybe a
new shape, same file and offset), so the writer copies it kernel-side. A fused tensor (q/k/v,
Flux's ``linear1``, a swapped adaLN, OpenCLIP's transposed projection) has no file: it is
assembled in memory from its diffusers slabs when the writer first reads it, and dropped when
the writer moves on, so at most one fused tensor is held at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import InvalidInputError
from ..formats.header import TensorEntry
from ..formats.index import Naming
from ..sources import Source, open_source
from ..sources.memory import host_bytes
from ..units import tensor_nbytes
from .single_file_trace import Original

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
        if self._cached is None or self._cached[0] != entry.name:
            self._cached = None  # the previous fused tensor goes before the next is built
            self._cached = (entry.name, host_bytes(_assemble(original, inner, by_name)))
        return self._cached[1][begin:end]

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
