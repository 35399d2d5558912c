"""``torch.distributed.checkpoint`` (DCP) folders, as FSDP training and ``dcp.save`` write them.

A DCP folder holds a pickled ``.metadata`` (every tensor's dtype, size and chunks, and where each
chunk lies: ``__<rank>_<n>.distcp`` file, byte offset, length) and the data files. Each chunk is
a small ``torch.save`` zip embedded in a data file; its tensor bytes are one stored (never
compressed) zip record. We read the embedded zip's directory and pickle with allowlists, never
running pickled code, and locate every chunk's bytes:

* a tensor in one chunk (every tensor of a single-process save) becomes an entry with a file
  offset, so the writer copies it kernel-side;
* a tensor cut into chunks by several ranks is reassembled slab by slab along its first
  dimension, so memory stays bounded by the writer's chunk size, not the tensor's.

Nested state dicts (``{"model": ..., "optimizer": ...}``) are selected with ``key`` (``model``,
``a/b``); without one, a top-level ``model``/``state_dict``/``module`` entry is chosen when
present, as ``accelerate merge-weights`` does.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import (
    InvalidInputError,
    Option,
    ShardkitWarning,
    SourceNotFoundError,
)
from ..formats.header import TensorEntry
from ..formats.index import Naming
from ..formats.links import check_name, open_inside
from ..formats.suffixes import DCP_DATA_SUFFIX as DATA_SUFFIX
from .base import Source, pread_exactly
from .dcp_metadata import MAX_METADATA_BYTES, METADATA_FILE, check_tiling, load_metadata
from .dcp_records import Chunk, locate_chunk, record_bytes

__all__ = ["DATA_SUFFIX", "MAX_METADATA_BYTES", "METADATA_FILE", "DCPSource", "is_dcp_folder", "load_metadata",
           "locate_chunk", "open_dcp"]

STATE_DICT_KEYS = ("model", "state_dict", "module", "model_state_dict")


def is_dcp_folder(path: str) -> bool:
    """A folder with a ``.metadata`` file or ``*.distcp`` data files."""
    if not os.path.isdir(path):
        return False
    return os.path.isfile(os.path.join(path, METADATA_FILE)) or any(n.endswith(DATA_SUFFIX) for n in os.listdir(path))


# ----------------------------------------------------------------------------- the source

@dataclass
class _Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    chunks: list[Chunk]


class DCPSource(Source):
    """Tensors of a DCP folder; see the module docstring."""

    def __init__(self, folder: str, tensors: list[_Tensor], *, description: str) -> None:
        self.folder = folder
        self.description = description
        self.naming = Naming()
        self._tensors = {t.name: t for t in tensors}
        self.paths = tuple(sorted({c.file for t in tensors for c in t.chunks}))
        self._entries: list[TensorEntry] = []  # set by open_dcp once every chunk is located
        self._loaded: tuple[tuple[str, int], memoryview] | None = None

    def entries(self) -> list[TensorEntry]:
        return list(self._entries)

    def read(self, entry: TensorEntry, begin: int, end: int) -> bytes | memoryview:
        tensor = self._tensors[entry.name]
        if len(tensor.chunks) == 1:
            return self._chunk_bytes(tensor.chunks[0], entry.dtype, begin, end, name=entry.name)
        return self._assemble(tensor, begin, end)

    def _chunk_bytes(self, chunk: Chunk, dtype: str, begin: int, end: int, *, name: str) -> bytes | memoryview:
        if chunk.data_offset is not None:
            return pread_exactly(self._fd(chunk.file), end - begin, chunk.data_offset + begin, file=chunk.file,
                                 name=name)
        return self._load_chunk(chunk, dtype)[begin:end]

    def _load_chunk(self, chunk: Chunk, dtype: str) -> memoryview:
        """Fallback for chunks whose bytes are not one run: ``torch.load(weights_only=True)`` on the record."""
        key = (chunk.file, chunk.blob_offset)
        if self._loaded is None or self._loaded[0] != key:
            self._loaded = None
            blob = pread_exactly(self._fd(chunk.file), chunk.blob_length, chunk.blob_offset, file=chunk.file,
                                 name=f"chunk at byte {chunk.blob_offset}")
            self._loaded = (key, record_bytes(chunk, blob, nbytes=math.prod(chunk.sizes) * _itemsize(dtype)))
        return self._loaded[1]

    def _assemble(self, tensor: _Tensor, begin: int, end: int) -> bytes:
        """Bytes ``[begin, end)`` of a tensor cut into chunks, built one slab of rows at a time."""
        import numpy as np

        itemsize = _itemsize(tensor.dtype)
        shape = _byte_shape(tensor.shape, itemsize)
        row_bytes = math.prod(shape[1:])
        r0, r1 = begin // row_bytes, -(-end // row_bytes)
        slab = np.zeros((r1 - r0, *shape[1:]), dtype=np.uint8)
        for chunk in tensor.chunks:
            offsets = _byte_offsets(chunk.offsets, itemsize)
            sizes = _byte_shape(chunk.sizes, itemsize)
            a, b = max(r0, offsets[0]), min(r1, offsets[0] + sizes[0])
            if a >= b or 0 in sizes:
                continue
            chunk_row = math.prod(sizes[1:])
            raw = self._chunk_bytes(chunk, tensor.dtype, (a - offsets[0]) * chunk_row, (b - offsets[0]) * chunk_row,
                                   name=tensor.name)
            piece = np.frombuffer(raw, dtype=np.uint8).reshape((b - a, *sizes[1:]))
            target = (slice(a - r0, b - r0),) + tuple(slice(o, o + s) for o, s in zip(offsets[1:], sizes[1:], strict=True))
            slab[target] = piece
        flat = slab.reshape(-1)
        return flat[begin - r0 * row_bytes: end - r0 * row_bytes].tobytes()

    def close(self) -> None:
        self._loaded = None
        super().close()


def _itemsize(dtype: str) -> int:
    from ..units import DTYPE_BITS

    return DTYPE_BITS[dtype] // 8


def _byte_shape(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """A shape measured in bytes along the last dimension; a scalar is one row of one item."""
    if not shape:
        return (itemsize,)
    return (*shape[:-1], shape[-1] * itemsize)


def _byte_offsets(offsets: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    if not offsets:
        return (0,)
    return (*offsets[:-1], offsets[-1] * itemsize)


def _entry(t: _Tensor) -> TensorEntry:
    from ..units import tensor_nbytes

    nbytes = tensor_nbytes(t.dtype, t.shape)
    only = t.chunks[0] if len(t.chunks) == 1 else None
    if only is not None and only.data_offset is not None:
        return TensorEntry(t.name, t.dtype, t.shape, nbytes, only.file, only.data_offset)
    return TensorEntry(t.name, t.dtype, t.shape, nbytes)


# ----------------------------------------------------------------------------- opening

def open_dcp(folder: str, *, key: str | None = None) -> DCPSource:
    """Open a DCP folder (see the module docstring).

    Every file is opened through the folder boundary (:mod:`shardkit.formats.links`): ``.metadata``
    names its data files by plain relative names inside the folder, each chunk list must tile its
    tensor exactly, and the descriptors opened here are the ones every later read goes through.

    with open_dcp("fsdp-checkpoint/") as src:
        [e.name for e in src.entries()][:2]
    """
    metadata = load_metadata(folder)
    paths = getattr(metadata, "planner_data", None) or {}
    selected = _select(metadata.state_dict_metadata, paths, key=key, where=folder)
    storage = {(k.fqn, tuple(k.offset) if k.offset is not None else None): v for k, v in metadata.storage_data.items()}
    tensors = [_build_tensor(folder, fqn, name, metadata.state_dict_metadata[fqn], storage) for fqn, name in selected]
    for tensor in tensors:
        _check_chunks(tensor, where=f"{os.path.join(folder, METADATA_FILE)}: tensor {tensor.name!r}")
    chosen = f" (key {key!r})" if key else ""
    source = DCPSource(folder, tensors, description=f"DCP checkpoint {folder}{chosen}")
    try:
        _open_data_files(folder, tensors, source._held_fds())
        _locate_all(tensors, source._held_fds())
    except BaseException:
        source.close()
        raise
    source._entries = [_entry(t) for t in tensors]
    return source


def _select(items: Mapping[str, object], paths: Mapping[str, Sequence[object]], *, key: str | None, where: str) -> list[tuple[str, str]]:
    """(fqn, output name) pairs of the chosen sub-dict, in metadata order; non-tensors refused."""
    def path_of(fqn: str) -> tuple[str, ...]:
        return tuple(str(p) for p in paths.get(fqn, (fqn,)))

    parts = tuple(key.split("/")) if key else _auto_key(items, path_of, where)
    chosen = [(fqn, ".".join(path_of(fqn)[len(parts):])) for fqn in items
              if path_of(fqn)[: len(parts)] == parts and len(path_of(fqn)) > len(parts)]
    if not chosen:
        tops = sorted({path_of(f)[0] for f in items})
        raise InvalidInputError(f"{where}: key {key!r} not found; top-level keys are: {', '.join(tops[:20])}")
    bad = [fqn for fqn, _ in chosen if not hasattr(items[fqn], "chunks")]
    if bad:
        raise InvalidInputError(
            f"{where}: {len(bad)} value(s) are not tensors: {', '.join(repr(b) for b in bad[:5])}"
            f"{' ...' if len(bad) > 5 else ''}; select the model's state dict with ", Option("key")
        )
    return chosen


def _auto_key(items: Mapping[str, object], path_of: Callable[[str], tuple[str, ...]], where: str) -> tuple[str, ...]:
    tops = {path_of(f)[0] for f in items if len(path_of(f)) > 1}
    for candidate in STATE_DICT_KEYS:
        if candidate in tops:
            others = sorted({path_of(f)[0] for f in items} - {candidate})
            if others:
                warnings.warn(ShardkitWarning(f"{where}: converting the {candidate!r} state dict; also present: "
                                              f"{', '.join(others[:10])} (choose with ", Option("key"), ")"),
                              stacklevel=4)
            return (candidate,)
    return ()


def _build_tensor(folder: str, fqn: str, name: str, meta: Any, storage: dict[tuple[str, tuple[int, ...] | None], Any]
                  ) -> _Tensor:
    from ..formats.dtypes import from_torch

    chunks = []
    for chunk in meta.chunks:
        info = storage.get((fqn, tuple(chunk.offsets)))
        if info is None:
            raise InvalidInputError(f"{folder}: .metadata lists a chunk of {fqn!r} at {list(chunk.offsets)} with no storage record")
        if getattr(info, "transform_descriptors", None):
            raise InvalidInputError(
                f"{folder}: tensor {fqn!r} is stored with transforms {list(info.transform_descriptors)} "
                "(e.g. compression); only plain DCP checkpoints are supported"
            )
        where = f"{os.path.join(folder, METADATA_FILE)}: chunk of {fqn!r} at {list(chunk.offsets)}"
        path = os.path.join(folder, *check_name(info.relative_path, where=where))  # a name inside the folder
        if not all(isinstance(v, int) and 0 <= v < 2**63 for v in (info.offset, info.length)):
            raise InvalidInputError(f"{where}: byte offset {info.offset!r} and length {info.length!r} must be "
                                    "non-negative integers; the checkpoint is damaged or was edited: re-save it")
        chunks.append(Chunk(tuple(chunk.offsets), tuple(chunk.sizes), path, info.offset, info.length))
    return _Tensor(name, from_torch(meta.properties.dtype), tuple(meta.size), chunks)


def _check_chunks(t: _Tensor, *, where: str) -> None:
    """The chunks tile the tensor exactly (:func:`check_tiling`), each from bytes of its own."""
    check_tiling(t.shape, [(c.offsets, c.sizes) for c in t.chunks], where=where)
    blobs = [(c.file, c.blob_offset) for c in t.chunks if math.prod(c.sizes)]
    if len(set(blobs)) != len(blobs):
        raise InvalidInputError(f"{where}: two of its chunks name the same stored bytes; each chunk of a DCP "
                                "checkpoint is saved once: the checkpoint is damaged or was edited; re-save it")


def _open_data_files(folder: str, tensors: list[_Tensor], fds: dict[str, int]) -> None:
    """One checked descriptor per data file (:func:`~shardkit.formats.links.open_inside`), into ``fds``.

    A link leading outside the folder, a FIFO or a device is refused before any byte is read.
    """
    for t in tensors:
        for chunk in t.chunks:
            if chunk.file in fds:
                continue
            name = os.path.relpath(chunk.file, folder).replace(os.sep, "/")
            try:
                fds[chunk.file] = open_inside(folder, name, where=os.path.join(folder, METADATA_FILE))
            except FileNotFoundError:
                raise SourceNotFoundError(f"{folder}: .metadata names data file {name}, which does not exist "
                                          f"(tensor {t.name!r})") from None


def _locate_all(tensors: list[_Tensor], fds: dict[str, int]) -> None:
    """Check every chunk lies inside its data file, then find each chunk's bytes."""
    sizes = {path: os.fstat(fd).st_size for path, fd in fds.items()}
    for t in tensors:
        for chunk in t.chunks:
            if chunk.blob_offset + chunk.blob_length > sizes[chunk.file]:
                raise InvalidInputError(f"{chunk.file}: shorter than .metadata says (truncated?); tensor {t.name!r}")
            chunk.data_offset = locate_chunk(chunk, fds[chunk.file], dtype=t.dtype, itemsize=_itemsize(t.dtype))
