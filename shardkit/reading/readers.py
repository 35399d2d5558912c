"""Bulk readers: large parallel ``pread`` (or ``O_DIRECT``) calls straight into tensors' memory.

Every destination tensor is allocated once by the caller; ``pread`` reads land in its buffer
directly (no intermediate copy). ``direct`` reads through one fixed-size, page-aligned bounce
buffer per reader thread (O_DIRECT needs aligned offsets, lengths and addresses) and copies out,
so memory stays the tensors plus ``threads × bounce`` bytes. Reads are split into chunks spread
over a few threads: network and FUSE filesystems serve several outstanding requests at once, and
on a local disk large chunks stay sequential enough for readahead.

A file that is not a local descriptor (an ``hf://`` or ``s3://`` object) is a
:class:`~shardkit.formats.ranges.RangeFile`: :class:`RangeReader` fills the same jobs through its
``read_into``, with the remote tuning (many ranges in flight).

with open_reader("model.safetensors", "pread") as reader:
    reader.read_all([ReadJob(tensor, offset=8 + header_bytes, nbytes=tensor.nbytes)])
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import HeaderError
from ..formats.ranges import RangeFile

if TYPE_CHECKING:
    import torch

log = logging.getLogger("shardkit")

CHUNK_BYTES = 32 << 20        # one pread call on a local disk: long sequential reads
# Network/FUSE: every request is a round trip, so speed = requests in flight x request size / latency.
# Measured through a FUSE mount adding 2 ms per 128 KiB request (tests/latency_mount.py): 16 threads x
# 4 MiB ranges keep the mount's server busy, where 4 x 32 MiB (tuned on bindfs, no latency) left it idle.
REMOTE_CHUNK_BYTES = 4 << 20
REMOTE_THREADS = 16
# A store object (s3://): one ranged GET per chunk. Measured with scripts/bench_s3_open.py (768 MB, loopback
# SeaweedFS, 2 cores): 16 x 16 MiB read it as fast as raw boto3 (1.21 s vs 1.26 s); 16 x 4 MiB took 1.50 s.
RANGE_CHUNK_BYTES = 16 << 20
BOUNCE_BYTES = 16 << 20       # one O_DIRECT bounce buffer per thread
_MAX_CALL_BYTES = 1 << 30     # Linux returns at most ~2 GiB per read call
_ALIGN = 4096


# Direct reads of a mount whose requests come back like a local disk's (bindfs, a container volume):
# FUSE cuts every call into 128 KiB requests anyway, so a few threads of large calls keep it busy at the
# least CPU (bindfs, 1.8 GB cold in 4 files: 8 x 8 MiB 0.87 CPU-s, 16 x 4 MiB 0.94-1.22, 4 x 16 MiB 0.92-1.53).
PASSTHROUGH_CHUNK_BYTES = 8 << 20
PASSTHROUGH_THREADS = 8


@dataclass(frozen=True)
class ReadTuning:
    """Request size and reader threads for one kind of mount (``threads`` None: :func:`reader_threads`)."""

    chunk_bytes: int
    threads: int | None


TUNINGS = {  # residency.BackendChoice.tuning -> how its reader cuts and spreads requests
    "local": ReadTuning(CHUNK_BYTES, None),
    "passthrough": ReadTuning(PASSTHROUGH_CHUNK_BYTES, PASSTHROUGH_THREADS),
    "round-trip": ReadTuning(REMOTE_CHUNK_BYTES, REMOTE_THREADS),
}


def reader_threads() -> int:
    """Reader threads: enough outstanding requests for network filesystems, few enough for 2 cores."""
    return max(2, min(8, 2 * (os.cpu_count() or 1)))


@dataclass(frozen=True)
class ReadJob:
    """``nbytes`` of the file at ``offset`` into host memory at ``address`` (a tensor's data pointer)."""

    address: int
    offset: int
    nbytes: int
    where: str        # "FILE: tensor 'NAME'", for messages
    # The memory from the page boundary at or before ``offset`` to the one after its end, at the same
    # distance from ``address``, is the caller's to overwrite (a page-padded block): ``direct`` then reads
    # straight into it when ``address`` and ``offset`` are congruent modulo the page size.
    padded: bool = False


def job_for(tensor: torch.Tensor, *, offset: int, nbytes: int, where: str) -> ReadJob:
    """A job reading ``nbytes`` into a contiguous CPU ``tensor`` (its storage must hold them)."""
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError(f"{where}: read destination must be a contiguous CPU tensor")
    return ReadJob(tensor.data_ptr(), offset, nbytes, where)


def split_jobs(jobs: list[ReadJob], *, chunk_bytes: int) -> Iterator[ReadJob]:
    """Each job cut into chunks of at most ``chunk_bytes`` (so one big tensor uses every thread), cut
    at file offsets that are multiples of ``chunk_bytes``: with ``direct``, whose reads cover whole
    pages, neighbouring chunks of one job never read the same page twice."""
    for job in jobs:
        start, end = job.offset, job.offset + job.nbytes
        while start < end:
            stop = min(end, (start // chunk_bytes + 1) * chunk_bytes)
            yield ReadJob(job.address + start - job.offset, start, stop - start, job.where, job.padded)
            start = stop


def memory_at(address: int, nbytes: int) -> memoryview:
    """A writable byte view of ``nbytes`` of memory at ``address`` (the caller keeps that memory alive)."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B") if nbytes else memoryview(bytearray())


def _address_of(memory: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(memory))


def pread_exact(fd: int, address: int, offset: int, nbytes: int, *, where: str) -> None:
    """``pread`` exactly ``nbytes`` at ``offset`` into memory at ``address``; short reads are retried."""
    view = memory_at(address, nbytes)
    done = 0
    while done < nbytes:
        got = os.preadv(fd, [view[done:done + _MAX_CALL_BYTES]], offset + done)
        if got <= 0:
            raise HeaderError(f"{where}: file ended at byte {offset + done}, before the "
                              f"{offset + nbytes} its header promises (truncated or changed on disk?)")
        done += got


class Reader:
    """Reads jobs from one file with a thread pool; ``close`` releases the pool and the descriptor."""

    backend = "pread"

    def __init__(self, path: str, *, threads: int | None = None, fd: int | None = None,
                 chunk_bytes: int | None = None) -> None:
        self.path = path
        self.chunk_bytes = chunk_bytes or CHUNK_BYTES
        self._owns_fd = fd is None  # a caller's descriptor stays the caller's to close
        self._fd = os.open(path, os.O_RDONLY) if fd is None else fd
        self.threads = threads or reader_threads()

    def read_all(self, jobs: list[ReadJob]) -> None:
        """Run every job (chunked, in parallel); the first failure is raised after all stop."""
        chunks = list(split_jobs(jobs, chunk_bytes=self.chunk_bytes))
        if len(chunks) <= 1:
            for chunk in chunks:
                self.read_one(chunk)
            return
        with ThreadPoolExecutor(min(self.threads, len(chunks)), thread_name_prefix="shardkit-read") as pool:
            futures = [pool.submit(self.read_one, chunk) for chunk in chunks]
            errors = [f.exception() for f in futures]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def read_one(self, job: ReadJob) -> None:
        """One chunk, on the calling thread."""
        pread_exact(self._fd, job.address, job.offset, job.nbytes, where=job.where)

    def read_spans(self, memory: memoryview, spans: list[tuple[int, int, int]], *, where: str) -> None:
        """Many small reads into one buffer, on the calling thread: ``(file offset, nbytes, buffer
        offset)`` each (the rows of a tensor-parallel slice). One ``pread`` per span, no per-span objects."""
        fd = self._fd
        for offset, nbytes, at in spans:
            if os.preadv(fd, [memory[at:at + nbytes]], offset) != nbytes:  # a short read: finish or fail
                pread_exact(fd, _address_of(memory) + at, offset, nbytes, where=where)

    def close(self) -> None:
        """Close the file (when this reader opened it)."""
        if self._fd >= 0 and self._owns_fd:
            os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DirectReader(Reader):
    """O_DIRECT reads through fixed, page-aligned bounce buffers (one per thread), copied out."""

    backend = "direct"

    def __init__(self, path: str, *, threads: int | None = None, fd: int | None = None,
                 chunk_bytes: int | None = None, bounce_bytes: int = BOUNCE_BYTES) -> None:
        super().__init__(path, threads=threads, fd=fd, chunk_bytes=chunk_bytes)
        self._direct_fd = -1
        self._bounce_bytes = bounce_bytes
        self._local = threading.local()
        self._buffers: list[mmap.mmap] = []
        self._lock = threading.Lock()
        try:
            # Through the open descriptor where there is one: the very file whose header was read.
            again = f"/proc/self/fd/{fd}" if fd is not None and os.path.exists(f"/proc/self/fd/{fd}") else path
            self._direct_fd = os.open(again, os.O_RDONLY | os.O_DIRECT)
            # Some filesystems accept the flag at open and refuse the first read: probe one page.
            os.preadv(self._direct_fd, [memoryview(self._bounce())[:_ALIGN]], 0)
        except OSError:
            self.close()
            raise

    def _bounce(self) -> mmap.mmap:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = mmap.mmap(-1, self._bounce_bytes + _ALIGN)  # anonymous maps are page-aligned
            with self._lock:
                self._buffers.append(buf)
        return buf

    def read_one(self, job: ReadJob) -> None:
        """Aligned O_DIRECT reads covering the job: straight into a page-padded job's memory where its
        address is congruent with its offset and chunks end on pages (no bounce buffer, no copy: a 1.7 GB
        ``to_state_dict`` through a 2 ms FUSE mount 4.49 -> 2.75 s, median of 5), else through the bounce buffer."""
        if job.padded and (job.address - job.offset) % _ALIGN == 0 and self.chunk_bytes % _ALIGN == 0:
            self._read_in_place(job)
        else:
            self._read_bounced(job)

    def read_spans(self, memory: memoryview, spans: list[tuple[int, int, int]], *, where: str) -> None:
        """Each span through the bounce buffer (O_DIRECT needs whole pages; these are small)."""
        base = _address_of(memory)
        for offset, nbytes, at in spans:
            self.read_one(ReadJob(base + at, offset, nbytes, where))

    def _read_in_place(self, job: ReadJob) -> None:
        end = job.offset + job.nbytes
        pos = job.offset - job.offset % _ALIGN
        while pos < end:
            span = min(_MAX_CALL_BYTES, _page_multiple(end - pos))
            view = memoryview((ctypes.c_char * span).from_address(job.address + pos - job.offset)).cast("B")
            got = os.preadv(self._direct_fd, [view], pos)
            if got <= 0:
                raise HeaderError(f"{job.where}: file ended at byte {pos}, before the {end} its header "
                                  "promises (truncated or changed on disk?)")
            pos += got
            if pos < end and pos % _ALIGN:  # a short read ending mid-page: the rest through the bounce buffer
                self._read_bounced(ReadJob(job.address + pos - job.offset, pos, end - pos, job.where))
                return

    def _read_bounced(self, job: ReadJob) -> None:
        buf = self._bounce()
        anchor = ctypes.c_char.from_buffer(buf)
        try:
            base = ctypes.addressof(anchor)
            end = job.offset + job.nbytes
            pos = job.offset
            while pos < end:
                start = pos - pos % _ALIGN
                span = min(self._bounce_bytes, (end - start + _ALIGN - 1) // _ALIGN * _ALIGN)
                got = os.preadv(self._direct_fd, [memoryview(buf)[:span]], start)
                usable = min(got - (pos - start), end - pos)
                if usable <= 0:
                    raise HeaderError(f"{job.where}: file ended at byte {start + max(got, 0)}, before the {end} "
                                      "its header promises (truncated or changed on disk?)")
                ctypes.memmove(job.address + (pos - job.offset), base + (pos - start), usable)
                pos += usable
        finally:
            del anchor

    def close(self) -> None:
        """Close both descriptors and unmap the bounce buffers."""
        super().close()
        if self._direct_fd >= 0:
            os.close(self._direct_fd)
            self._direct_fd = -1
        with self._lock:
            for buf in self._buffers:
                buf.close()
            self._buffers.clear()


class RangeReader(Reader):
    """Reads jobs from a :class:`~shardkit.formats.ranges.RangeFile` (a remote object): each chunk is one
    ``read_into`` of a range (``RANGE_CHUNK_BYTES`` by default), ``REMOTE_THREADS`` of them in flight by
    default; ``close`` closes the file."""

    backend = "range"

    def __init__(self, file: RangeFile, *, threads: int | None = None, chunk_bytes: int | None = None) -> None:
        self.path = file.name
        self.file = file
        self.chunk_bytes = chunk_bytes or RANGE_CHUNK_BYTES
        self.threads = threads or REMOTE_THREADS
        self._owns_fd = False
        self._fd = -1

    def read_one(self, job: ReadJob) -> None:
        """One chunk, on the calling thread: the file fills the job's memory (and checks the count)."""
        self.file.read_into(job.offset, memory_at(job.address, job.nbytes))

    def read_spans(self, memory: memoryview, spans: list[tuple[int, int, int]], *, where: str) -> None:
        """One ranged read per span."""
        for offset, nbytes, at in spans:
            self.file.read_into(offset, memory[at:at + nbytes])

    def close(self) -> None:
        """Close the file (idempotent)."""
        self.file.close()


def _page_multiple(nbytes: int) -> int:
    return max(_ALIGN, (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN)


def open_reader(path: str | RangeFile, backend: str, *, threads: int | None = None, fd: int | None = None,
                remote: bool = False, tuning: str | None = None, quiet: bool = False) -> Reader:
    """A reader for ``path``: ``"pread"``, or ``"direct"`` where the filesystem takes O_DIRECT; a
    :class:`~shardkit.formats.ranges.RangeFile` (not a local file) gets a :class:`RangeReader` whatever
    ``backend`` says.

    Where O_DIRECT is refused (tmpfs, some FUSE mounts) it logs one warning line and reads
    with ``pread`` instead. ``remote`` (a network/FUSE filesystem) uses the remote tuning
    (``REMOTE_THREADS`` x ``REMOTE_CHUNK_BYTES``, one bounce buffer of a chunk per thread);
    ``tuning`` names one of ``TUNINGS`` instead (``"passthrough"``: a mount answering like a local disk).
    ``quiet``: the fallback to ``pread`` is logged at debug level (``read="auto"`` chose direct).

    open_reader("model.safetensors", "direct").backend
    'direct'
    """
    if not isinstance(path, str):
        return RangeReader(path, threads=threads)
    tuned = TUNINGS[tuning or ("round-trip" if remote else "local")]
    chunk = tuned.chunk_bytes
    threads = threads or tuned.threads
    if backend == "direct":
        try:
            return DirectReader(path, threads=threads, fd=fd, chunk_bytes=chunk, bounce_bytes=_page_multiple(min(BOUNCE_BYTES, chunk)))
        except OSError as e:
            log.log(logging.DEBUG if quiet else logging.WARNING, "%s: O_DIRECT is not supported here (%s); "
                    "reading with pread instead", path, e.strerror or e)
    return Reader(path, threads=threads, fd=fd, chunk_bytes=chunk)
