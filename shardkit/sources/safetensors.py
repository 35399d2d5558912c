"""Safetensors sources: one file, or a sharded folder with its index.

Tensor bytes are read through the same readers as ``shardkit.open`` (:mod:`shardkit.reading`): each
request as parallel range reads, and requests in file order read ahead (:class:`~shardkit.reading.
sequential.RangeReads`), so ``split --dtype``, ``convert`` and ``verify --source`` keep many reads in
flight on network and FUSE mounts instead of one synchronous ``pread`` per chunk.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator

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
from ..formats.ranges import RangeFile
from ..reading.readers import REMOTE_CHUNK_BYTES, RangeReader, Reader, open_reader
from ..reading.residency import choose_backend
from ..reading.sequential import AHEAD_BYTES, CachedReads, FileReads, RangeReads
from ..workers import ReadPool
from .base import Source


class SafetensorsSource(Source):
    """Tensors from one or more validated safetensors files, read with the parallel readers.

    Each file's reader is chosen as ``shardkit.open(read="auto")`` chooses (``pread`` on a local
    disk or a fast mount, ``direct`` with many reads in flight where a request is a round trip;
    never ``mmap``: a source hands bytes over, not views of the file) and reads through the
    descriptor held since the header was read.
    """

    def __init__(self, headers: list[Header], *, description: str, naming: Naming) -> None:
        self.headers = headers
        self.description = description
        self.naming = naming
        self.paths = tuple(h.path for h in headers)
        self._reads: dict[str, FileReads] = {}
        self._ranges: dict[str, RangeFile] = {}  # files whose bytes come from elsewhere (read_through)
        self._read_ahead = True
        self._pool: ReadPool | None = None
        self._lock = threading.Lock()
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

    def read(self, entry: TensorEntry, begin: int, end: int) -> bytes | memoryview:
        return self._file_reads(entry).read(entry.offset + begin, end - begin, where=_where(entry))

    def read_through(self, open_file: Callable[[str], RangeFile], *, read_ahead: bool = True) -> None:
        """Read every file's tensor bytes through ``open_file(path)`` (a remote object behind a local
        header-only copy) from now on; kernel copies from the local files are off.

        ``read_ahead``: False where the :class:`RangeFile` reads ahead itself and wants one request at
        a time, in file order (each of at most ``REMOTE_CHUNK_BYTES``).
        """
        for path in self.paths:
            if path not in self._ranges:
                self._ranges[path] = open_file(path)
        self._read_ahead = read_ahead
        self.kernel_copy = False

    def chunks(self, entry: TensorEntry, chunk_bytes: int) -> Iterator[memoryview]:
        """Views of the pieces the tensor's bytes were read into, at most ``chunk_bytes`` each (no copy)."""
        reads = self._file_reads(entry)
        if not self._read_ahead:
            chunk_bytes = min(chunk_bytes, REMOTE_CHUNK_BYTES)
        for begin in range(0, entry.nbytes, chunk_bytes):
            yield from reads.views(entry.offset + begin, min(chunk_bytes, entry.nbytes - begin), where=_where(entry))

    def _file_reads(self, entry: TensorEntry) -> FileReads:
        """The reads of ``entry``'s file, opened on first use."""
        assert entry.file is not None
        with self._lock:
            reads = self._reads.get(entry.file)
            if reads is None:
                reads = self._reads[entry.file] = self._open_reads(entry.file)
            return reads

    def _open_reads(self, path: str) -> FileReads:
        """``path``'s reads, backend as ``shardkit.open(read="auto")`` picks it: a :class:`RangeFile`'s
        range reads; a warm local file (which ``auto`` maps) one ``pread`` per request; anything else
        (cold, network/FUSE) the parallel readers with read-ahead."""
        remote = self._ranges.get(path)
        if remote is not None:  # one call per request where the file wants them in order
            reader: Reader = RangeReader(remote, chunk_bytes=None if self._read_ahead else 1 << 62)
            return self._parallel(reader, remote.size_bytes)
        fd = self._fd(path)
        choice = choose_backend(path, "auto", fd=fd)
        if choice.backend == "mmap" and choice.tuning is None:  # warm
            return CachedReads(fd, size_bytes=os.fstat(fd).st_size)
        # A cold passthrough mount is mapped for tensors handed to callers (no copy); a job copies every
        # byte anyway, so it reads in parallel with O_DIRECT, sized for that mount.
        backend = "direct" if choice.backend == "mmap" else choice.backend
        reader = open_reader(path, backend, fd=fd, remote=choice.remote is not None, tuning=choice.tuning, quiet=True)
        return self._parallel(reader, os.fstat(fd).st_size)

    def _parallel(self, reader: Reader, size_bytes: int) -> RangeReads:
        if self._pool is None:
            self._pool = ReadPool(reader.threads)
        return RangeReads(reader, self._pool, size_bytes=size_bytes, ahead_bytes=AHEAD_BYTES if self._read_ahead else 0)

    def close(self) -> None:
        """Cancel the read-ahead, join the reader threads (bounded), then close the files."""
        with self.__dict__.setdefault("_lock", threading.Lock()):
            pool, self._pool = self.__dict__.get("_pool"), None
            readers, self._reads = list(self.__dict__.get("_reads", {}).values()), {}
        if pool is not None and not pool.close():
            return  # a read still blocked must not land in a reused descriptor: the files stay open
        for reads in readers:
            reads.close()
        for remote in self.__dict__.get("_ranges", {}).values():
            remote.close()  # idempotent: those with a reader were closed with it
        super().close()


def _where(entry: TensorEntry) -> str:
    return f"{entry.file}: tensor {entry.name!r}"


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
