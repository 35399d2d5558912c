"""Safetensors sources: one file, or a sharded folder with its index."""

from __future__ import annotations

import os

from ..errors import CheckpointIndexError, SourceNotFoundError
from ..formats.header import Header, TensorEntry, read_header
from ..formats.index import (
    CheckpointIndex,
    Naming,
    find_checkpoint,
    load_index,
    naming_from_filename,
    shard_file,
)
from .base import Source, pread_exactly


class SafetensorsSource(Source):
    """Tensors from one or more validated safetensors files, read with ``pread``."""

    def __init__(self, headers: list[Header], *, description: str, naming: Naming) -> None:
        self.headers = headers
        self.description = description
        self.naming = naming
        self.paths = tuple(h.path for h in headers)
        try:  # held from the start: reads see these files even if a writer replaces them later
            for header in headers:
                self._fd(header.path)
        except OSError:
            self.close()
            raise

    def entries(self) -> list[TensorEntry]:
        return [e for h in self.headers for e in h.entries]

    def metadata(self) -> dict[str, str]:
        merged: dict[str, str] = {}
        for header in self.headers:
            merged.update(header.metadata)
        return merged

    def read(self, entry: TensorEntry, begin: int, end: int) -> bytes:
        assert entry.file is not None
        return pread_exactly(self._fd(entry.file), end - begin, entry.offset + begin, file=entry.file,
                             name=entry.name)


def open_safetensors_file(path: str) -> SafetensorsSource:
    header = read_header(path)
    return SafetensorsSource([header], description=f"safetensors file {path}", naming=naming_from_filename(path))


def open_safetensors_index(path: str) -> SafetensorsSource:
    """Open every shard an index names and check the index against their headers."""
    index = load_index(path)
    # Shard order (not the alphabetical weight_map's order), so resharding a folder is idempotent.
    headers = [_read_shard(index, shard) for shard in sorted(index.shard_names())]
    check_index_against_headers(index, headers)
    return SafetensorsSource(
        headers, description=f"sharded checkpoint {path} ({len(headers)} shards)", naming=naming_from_filename(path)
    )


def _read_shard(index: CheckpointIndex, shard: str) -> Header:
    return read_header(shard_file(index.folder, shard, where=index.path))


def check_index_against_headers(index: CheckpointIndex, headers: list[Header]) -> None:
    """Every index tensor lives in the shard it names; every shard tensor is in the index."""
    seen: dict[str, str] = {}
    for header in headers:
        shard = os.path.basename(header.path)
        for entry in header.entries:
            if entry.name in seen:
                raise CheckpointIndexError(
                    f"{index.path}: tensor {entry.name!r} appears in both {seen[entry.name]} and {shard}"
                )
            seen[entry.name] = shard
            if entry.name not in index.weight_map:
                raise CheckpointIndexError(
                    f"{index.path}: tensor {entry.name!r} in shard {shard} is missing from the index"
                )
    for tensor, shard in index.weight_map.items():
        if seen.get(tensor) != shard:
            raise CheckpointIndexError(f"{index.path}: tensor {tensor!r} is not in its shard {shard}")


def open_safetensors_folder(path: str, *, variant: str | None = None) -> SafetensorsSource:
    layout = find_checkpoint(path, variant=variant)
    if layout.kind == "index":
        return open_safetensors_index(layout.path)
    return open_safetensors_file(layout.path)


def has_safetensors(path: str) -> bool:
    try:
        find_checkpoint(path)
    except SourceNotFoundError:
        return False
    except CheckpointIndexError:
        return True
    return True
