"""Sharded pickles: ``pytorch_model-0000x-of-0000y.bin`` files named by ``pytorch_model.bin.index.json``.

Each shard is loaded with ``weights_only=True`` (and ``mmap=True`` for zip files), one at a
time: listing the entries opens every shard in turn and lets it go; reading opens the shard that
holds the tensor and drops the one before. Tensors whose bytes lie contiguously in a zip shard
carry their file offset, so the writer copies them kernel-side and never touches the mapping.
"""

from __future__ import annotations

import os

from ..errors import CheckpointIndexError, SourceNotFoundError
from ..formats.header import TensorEntry
from ..formats.index import (
    MAX_INDEX_BYTES,
    CheckpointIndex,
    folder_names,
    load_index,
    naming_from_filename,
    parse_index,
)
from ..formats.links import read_inside
from ..formats.names import resolve_index_name
from .base import Source
from .memory import MemorySource

INDEX_SUFFIX = ".bin.index.json"


def is_pickle_index(path: str) -> bool:
    """A ``*.bin.index.json`` (optionally with a variant: ``*.bin.index.fp16.json``) file."""
    name = os.path.basename(path)
    return os.path.isfile(path) and name.endswith(".json") and ".bin.index" in name


def find_pickle_index(folder: str) -> str | None:
    """The one ``*.bin.index*.json`` in ``folder`` (None when there is none)."""
    if not os.path.isdir(folder):
        return None
    name = resolve_index_name(folder_names(folder), where=folder, ext="bin")  # the one set of name rules
    return os.path.join(folder, name) if name else None


def find_single_pickle(folder: str) -> str | None:
    """A folder's lone ``pytorch_model.bin`` / ``diffusion_pytorch_model.bin`` (None when absent)."""
    if not os.path.isdir(folder):
        return None
    for name in ("pytorch_model.bin", "diffusion_pytorch_model.bin", "model.bin"):
        if os.path.isfile(os.path.join(folder, name)):
            return os.path.join(folder, name)
    return None


class PickleIndexSource(Source):
    """Tensors of a sharded pickle checkpoint; at most one shard is loaded at any moment."""

    def __init__(self, index: CheckpointIndex, *, key: str | None = None) -> None:
        self.index = index
        self.key = key
        self.description = f"sharded pickle checkpoint {index.path} ({len(index.shard_names())} shards)"
        self.naming = naming_from_filename(index.path)
        self.paths = tuple(index.shard_paths())
        self._shard_of: dict[str, str] = {}
        self._entries: list[TensorEntry] = []
        self._aliases: dict[str, str] = {}
        self._current: tuple[str, MemorySource] | None = None
        for shard in self._shard_order():
            self._add_shard(shard)
        missing = [t for t in index.weight_map if t not in self._shard_of and t not in self._aliases]
        if missing:
            raise CheckpointIndexError(
                f"{index.path}: tensor {missing[0]!r} is not in its shard {index.weight_map[missing[0]]}"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            )

    def _shard_order(self) -> list[str]:
        # Shard files in number order: the order their tensors were written in.
        return sorted(self.index.shard_names())

    def _add_shard(self, shard: str) -> None:
        source = self._open(shard)
        try:
            for entry in source.entries():
                self._claim(entry.name, shard)
                self._entries.append(entry)
            for alias, kept in source.aliases().items():
                self._claim(alias, shard)
                self._aliases[alias] = kept
        finally:
            source.close()

    def _claim(self, name: str, shard: str) -> None:
        if name in self._shard_of:
            raise CheckpointIndexError(
                f"{self.index.path}: tensor {name!r} appears in both {self._shard_of[name]} and {shard}"
            )
        if self.index.weight_map.get(name) != shard:
            where = self.index.weight_map.get(name)
            raise CheckpointIndexError(
                f"{self.index.path}: tensor {name!r} in shard {shard} is "
                + ("missing from the index" if where is None else f"indexed under {where}")
            )
        self._shard_of[name] = shard

    def entries(self) -> list[TensorEntry]:
        return list(self._entries)

    def aliases(self) -> dict[str, str]:
        return dict(self._aliases)

    def read(self, entry: TensorEntry, begin: int, end: int) -> bytes | memoryview:
        shard = self._shard_of[entry.name]
        if self._current is None or self._current[0] != shard:
            self.close()  # let the previous shard's mapping go before opening the next
            self._current = (shard, self._open(shard))
        source = self._current[1]
        return source.read(entry, begin, end)

    def _open(self, shard: str) -> MemorySource:
        """The shard named by the index, opened under the folder boundary (a link only inside it or into a cache)."""
        try:
            return _open_shard(os.path.join(self.index.folder, shard), key=self.key, inside=self.index.folder)
        except SourceNotFoundError:
            raise CheckpointIndexError(f"{self.index.path}: names shard {shard!r}, which does not exist in "
                                       f"{self.index.folder}") from None

    def held_fd(self, path: str) -> int | None:
        return self._current[1].held_fd(path) if self._current is not None else None

    def close(self) -> None:
        if self._current is not None:
            self._current[1].close()
            self._current = None


def _open_shard(path: str, *, key: str | None, inside: str) -> MemorySource:
    from .pickle import open_pickle

    return open_pickle(path, key=key, inside=inside)


def open_pickle_index(path: str, *, key: str | None = None, inside: str | None = None) -> PickleIndexSource:
    """Open a ``pytorch_model.bin.index.json`` and check it against the shards it names.

    ``inside``: the folder the index was found in (not named by the user): it is read under the
    folder boundary (:func:`~shardkit.formats.links.read_inside`), like the shards it names.

    with open_pickle_index("ckpt/pytorch_model.bin.index.json") as src:
        len(src.entries())
    """
    if inside is None:
        return PickleIndexSource(load_index(path, ext=".bin"), key=key)
    raw = read_inside(inside, os.path.basename(path), where=inside, max_bytes=MAX_INDEX_BYTES)
    return PickleIndexSource(parse_index(raw, path=path, ext=".bin"), key=key)
