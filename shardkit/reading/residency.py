"""Which read backend suits a file: page-cache residency (``mincore``), filesystem kind (``statfs``)
and what one request costs there (timed).

``mmap`` is the fastest way to read a file whose pages are already cached on a local disk (no
copy at all), and the slowest on network and FUSE filesystems and cold caches, where every page
fault is a small synchronous round trip. Large parallel ``pread`` calls keep those busy instead.
``choose_backend`` picks between them for ``read="auto"``. A cold file on a network or FUSE
filesystem is judged by what its mount does, not by its kind: one request is timed once per mount
per process (:func:`mount_latency_s`). Where each request is a round trip (a network mount), it is
read with O_DIRECT, many requests in flight (the ``round-trip`` tuning: no page cache in between,
each byte copied once). Where requests come back fast (a passthrough FUSE such as bindfs over a
local disk, a container volume: the ``passthrough`` tuning) it is memory-mapped as safetensors does,
with parallel read-ahead (:mod:`~shardkit.reading.map_ahead`): the map's CPU, more requests in flight.

choose_backend("model.safetensors", "auto")
BackendChoice(backend='mmap', reason='fuse filesystem answering like a local disk (0.08 ms per request): mapped,
              read ahead in parallel, cold: ...', remote=None, tuning='passthrough')
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import mmap
import os
import threading
import time
from typing import Literal

from ..errors import InvalidInputError

READ_BACKENDS = ("auto", "mmap", "pread", "direct")
ReadMode = Literal["auto", "mmap", "pread", "direct"]  # what read= takes (checked at run time too)

# statfs f_type magics of filesystems where a page fault is a network or user-space round trip.
REMOTE_MAGICS = {
    0x6969: "nfs", 0xFF534D42: "cifs", 0xFE534D42: "smb2", 0x517B: "smb", 0x65735546: "fuse",
    0x0BD00BD0: "lustre", 0x47504653: "gpfs", 0x01021997: "9p", 0x6B414653: "afs", 0x5346414F: "afs",
    0x00C36400: "ceph", 0x013111A8: "ibrix", 0x19830326: "fhgfs/beegfs", 0xAAD7AAEA: "panfs",
    0x7461636F: "ocfs2", 0x564C: "ncp", 0x73757245: "coda",
}
# At least this share of sampled pages cached: mmap. A local disk serves the few missing pages'
# faults cheaply (and a busy page cache rarely holds all of a big file); on network/FUSE every
# fault is a round trip, so nearly all must be cached.
WARM_FRACTION_LOCAL = 0.5
WARM_FRACTION_REMOTE = 0.9
_SAMPLE_PAGES = 4096       # pages probed per file, spread evenly (mincore is cheap, but 1 byte/page)
_WINDOWS = 64              # ... in this many runs of contiguous pages, one mincore call each
_RESIDENT_BIT = bytes(b & 1 for b in range(256))  # mincore's byte per page -> 1 if resident, else 0
# The fastest of a few one-page O_DIRECT requests (once per mount per process) picks how a cold
# network/FUSE file is read. Slower than this, the mount costs a round trip per request: O_DIRECT, many
# requests in flight (``round-trip``: 16 x 4 MiB). Faster, it answers like a local disk (``passthrough``):
# a memory map with parallel read-ahead. Measured on bindfs over this project's local disk (1 request
# 0.05-0.3 ms; every FUSE request 128 KiB whatever the call), 1.72 GB in 4 files, cold, median of 5
# (docs/benchmarks.md): safetensors' map 3.02 s (CPU 0.90), O_DIRECT 8 x 8 MiB 3.70 s (CPU 1.52), map +
# read-ahead 1.94 s (CPU 0.94). O_DIRECT's extra CPU (fresh memory zeroed, more threads) lost to the
# map whenever the disk was fast; the read-ahead keeps the map's CPU.
ROUND_TRIP_S = 1e-3
LATENCY_PROBES = 3
_MOUNTS_REMEMBERED = 256   # mounts whose probe result a process keeps (mount_identity -> seconds or None)
_mount_latency: dict[tuple[int, tuple[str, ...]], float | None] = {}
_mount_probing: dict[tuple[int, tuple[str, ...]], threading.Lock] = {}  # held while that mount is timed
_mount_lock = threading.Lock()
_STATFS_BYTES = 256        # struct statfs is 120 bytes on 64-bit Linux; f_type is its first word


@dataclasses.dataclass(frozen=True)
class BackendChoice:
    """The backend picked for one file and why (for ``shardkit_load_report`` and ``--debug``)."""

    backend: str
    reason: str
    # The network/FUSE filesystem's name where requests are round trips: readers keep more requests
    # in flight. None for a local disk, and for a mount whose requests come back like a local disk's.
    remote: str | None = None
    # How the reader sizes its requests (``readers.TUNINGS``): "local", "passthrough" or "round-trip";
    # None: from ``remote`` ("round-trip" where set, else "local"). A "passthrough" map reads ahead.
    tuning: str | None = None


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    """The C library, loaded once. ``dlopen(NULL)``: the process's own symbols, libc's among them.
    Never ``ctypes.util.find_library``, which forks ``ldconfig`` on every call: a fork from a reader
    thread while other threads wait on FUSE requests hung a process in the kernel here."""
    return ctypes.CDLL(None, use_errno=True)


def filesystem_magic(path: str) -> int | None:
    """The ``statfs`` ``f_type`` of the filesystem holding ``path`` (None where statfs fails).

    ``os.statvfs`` does not expose ``f_type``, so this calls libc's ``statfs`` through ctypes.

    hex(filesystem_magic("/proc"))
    '0x9fa0'
    """
    buf = ctypes.create_string_buffer(_STATFS_BYTES)
    try:
        if _libc().statfs(os.fsencode(path), buf) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def remote_filesystem(path: str) -> str | None:
    """The name of the network/FUSE filesystem holding ``path``, or None for a local one."""
    magic = filesystem_magic(path)
    return REMOTE_MAGICS.get(magic) if magic is not None else None


def cached_fraction(path: str, *, sample_pages: int = _SAMPLE_PAGES, fd: int | None = None) -> float | None:
    """The share of ``path``'s sampled pages that sit in the page cache (``mincore``); None if unknown.

    Maps the file (no page is touched: ``mincore`` only asks the kernel) and probes up to
    ``sample_pages`` pages spread evenly over it. ``fd``: an open descriptor of ``path`` to use.

    cached_fraction("model.safetensors")
    1.0
    """
    page = mmap.PAGESIZE
    own = fd is None
    try:
        if fd is None:
            fd = os.open(path, os.O_RDONLY)
        size = os.fstat(fd).st_size
        if size == 0:
            return 1.0
        mapped = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)  # writable private: ctypes can take its address
    except (OSError, ValueError):
        if own and fd is not None:
            os.close(fd)
        return None
    anchor = ctypes.c_char.from_buffer(mapped)
    try:
        return _probe(ctypes.addressof(anchor), size, page, sample_pages)
    finally:
        del anchor  # the buffer export must go before the map closes
        mapped.close()
        if own:
            os.close(fd)


def evict(path: str) -> float | None:
    """Drop ``path``'s pages from the page cache (fsync, then ``POSIX_FADV_DONTNEED``) for a cold read.

    Benchmarks and tests use it to measure and exercise the cold path.

    Returns:
        The share of sampled pages still cached afterwards (None where ``mincore`` cannot tell).

    evict("model.safetensors")
    0.0
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return cached_fraction(path)


def _probe(address: int, size: int, page: int, sample_pages: int) -> float | None:
    """The cached share of up to ``sample_pages`` pages in :data:`_WINDOWS` evenly spread runs, one
    ``mincore`` call per run (one page per call cost ~30 ms a file in ctypes calls; this ~1 ms)."""
    pages = (size + page - 1) // page
    if pages <= sample_pages:
        runs = [(0, pages)]
    else:
        per = max(1, sample_pages // _WINDOWS)
        count = max(2, sample_pages // per)
        runs = [((pages - per) * i // (count - 1), per) for i in range(count)]
    libc = _libc()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    vec = (ctypes.c_ubyte * max(n for _, n in runs))()
    cached = probed = 0
    for first, n in runs:
        if libc.mincore(ctypes.c_void_p(address + first * page), n * page, vec) != 0:
            return None
        cached += ctypes.string_at(vec, n).translate(_RESIDENT_BIT).count(1)  # only bit 0 is defined
        probed += n
    return cached / probed


def request_latency_s(path: str, *, fd: int | None = None, probes: int = LATENCY_PROBES) -> float | None:
    """What one read request costs on ``path``'s filesystem: the fastest of ``probes`` one-page
    ``O_DIRECT`` reads spread over the file (direct: never served by the page cache). None where
    ``O_DIRECT`` is refused or the file is empty.

    ``fd``: an open descriptor of ``path``; the probe reopens that very file (``/proc/self/fd``).

    request_latency_s("/mnt/nfs/model.safetensors")
    0.0021
    """
    again = f"/proc/self/fd/{fd}" if fd is not None and os.path.exists(f"/proc/self/fd/{fd}") else path
    page = mmap.PAGESIZE
    try:
        direct = os.open(again, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        return None
    buf = mmap.mmap(-1, page)  # page-aligned, as O_DIRECT needs
    try:
        pages = os.fstat(direct).st_size // page
        if not getattr(os, "O_DIRECT", 0) or pages == 0:
            return None
        best: float | None = None
        for i in range(probes):
            offset = (pages * (2 * i + 1) // (2 * probes)) * page  # the middle of each of ``probes`` slices
            start = time.perf_counter()
            os.preadv(direct, [buf], offset)
            took = time.perf_counter() - start
            best = took if best is None else min(best, took)
        return best
    except OSError:
        return None
    finally:
        buf.close()
        os.close(direct)


def mount_identity(st_dev: int) -> tuple[int, tuple[str, ...]]:
    """Which mount a device number is now: ``st_dev`` and the ``/proc/self/mountinfo`` lines that carry
    it (mount point, source, type, options). A FUSE device number, and a mount ID, are reused by the
    next mount once one is unmounted; a mount elsewhere, of another source or type, differs here."""
    wanted = f"{os.major(st_dev)}:{os.minor(st_dev)}"
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = tuple(line.split(" ", 3)[3].strip() for line in f if line.split(" ", 3)[2:3] == [wanted])
    except (OSError, IndexError):
        lines = ()
    return st_dev, lines


def mount_latency_s(path: str, *, fd: int | None = None) -> float | None:
    """:func:`request_latency_s` of ``path``'s mount, timed once per mount per process
    (:func:`mount_identity`): the first file opened there is probed, later ones reuse the answer (at
    most ``_MOUNTS_REMEMBERED`` mounts are remembered)."""
    try:
        device = mount_identity(os.fstat(fd).st_dev if fd is not None else os.stat(path).st_dev)
    except OSError:
        return request_latency_s(path, fd=fd)
    with _mount_lock:
        if device in _mount_latency:
            return _mount_latency[device]
        probing = _mount_probing.setdefault(device, threading.Lock())
    with probing:  # shards opened together: one of them times the mount, the others wait for its answer
        with _mount_lock:
            if device in _mount_latency:
                return _mount_latency[device]
        latency = request_latency_s(path, fd=fd)
        with _mount_lock:
            if len(_mount_latency) >= _MOUNTS_REMEMBERED:
                _mount_latency.clear()
            _mount_probing.pop(device, None)
            return _mount_latency.setdefault(device, latency)


def forget_mount_latencies() -> None:
    """Time every mount again on its next cold file (tests; a mount remounted with other settings)."""
    with _mount_lock:
        _mount_latency.clear()


def cold_backend(remote: str | None, latency_s: float | None) -> BackendChoice:
    """The backend and tuning for a cold file, and why (the reason's file-cache part is the caller's).

    >>> cold_backend(None, None)
    BackendChoice(backend='pread', reason='local file', remote=None, tuning='local')
    >>> cold_backend("fuse", 0.0002)
    BackendChoice(backend='mmap', reason='fuse filesystem answering like a local disk (0.20 ms per request): mapped, read ahead in parallel', remote=None, tuning='passthrough')
    >>> cold_backend("fuse", 0.0021)
    BackendChoice(backend='direct', reason='fuse filesystem, 2.10 ms per request', remote='fuse', tuning='round-trip')
    >>> cold_backend("nfs", None)
    BackendChoice(backend='direct', reason='nfs filesystem', remote='nfs', tuning='round-trip')
    """
    if remote is None:
        return BackendChoice("pread", "local file", None, "local")
    if latency_s is None:
        return BackendChoice("direct", f"{remote} filesystem", remote, "round-trip")
    if latency_s < ROUND_TRIP_S:  # safetensors' map and CPU, with parallel read-ahead (map_ahead.py)
        return BackendChoice("mmap", f"{remote} filesystem answering like a local disk "
                             f"({latency_s * 1e3:.2f} ms per request): mapped, read ahead in parallel", None, "passthrough")
    return BackendChoice("direct", f"{remote} filesystem, {latency_s * 1e3:.2f} ms per request", remote, "round-trip")


def check_backend(read: str) -> str:
    """Refuse an unknown ``read=`` value with the valid ones."""
    if read not in READ_BACKENDS:
        raise InvalidInputError(f"read={read!r} is not a read backend; use one of {', '.join(READ_BACKENDS)}")
    return read


def choose_backend(path: str, read: str, *, fd: int | None = None) -> BackendChoice:
    """The backend for ``path``: ``read`` itself unless it is ``"auto"``.

    ``auto`` picks ``mmap`` for warm files (at least 50% of sampled pages cached on a local disk,
    90% on network/FUSE filesystems, checked with
    ``mincore`` after opening: FUSE mounts without ``kernel_cache`` drop a file's cache at each
    open, so they read as cold) and for cold ones ``pread`` on a local disk. A cold file on a
    network or FUSE filesystem (statfs magic) gets ``direct`` (O_DIRECT makes each request as
    large as the read and skips the page cache's copy; ``pread`` where O_DIRECT is refused), tuned by
    a few timed one-page requests, once per mount (:func:`mount_latency_s`, :func:`cold_backend`):
    where a request is a round trip, many requests in flight; where requests come back like a local
    disk's, few large ones.

    Args:
        path: the file.
        read: ``"auto"``, ``"mmap"``, ``"pread"`` or ``"direct"``.
        fd: an open descriptor of ``path`` (saves opening it again).

    Returns:
        The backend and the reason, e.g. ``BackendChoice("direct", "fuse filesystem, cold: ...", "fuse")``.

    >>> choose_backend("model.safetensors", "mmap")
    BackendChoice(backend='mmap', reason='read=mmap', remote=None, tuning=None)
    """
    check_backend(read)
    if read != "auto":  # still tuned for the filesystem: more, smaller reads in flight on a remote one
        return BackendChoice(read, f"read={read}", remote_filesystem(path))
    remote = remote_filesystem(path)
    where = f"{remote} filesystem" if remote else "local file"
    fraction = cached_fraction(path, fd=fd)
    if fraction is not None and fraction >= (WARM_FRACTION_REMOTE if remote else WARM_FRACTION_LOCAL):
        return BackendChoice("mmap", f"{where}, warm: {fraction:.0%} of sampled pages cached", remote)
    # Remote: O_DIRECT requests are as large as the read (FUSE: up to 1 MiB, not the page cache's
    # 128 KiB), so each round trip brings more (measured: 2237 requests instead of 13461 for 1.7 GB).
    choice = cold_backend(remote, mount_latency_s(path, fd=fd) if remote else None)
    cache = "page-cache residency unknown" if fraction is None else f"cold: {fraction:.0%} of sampled pages cached"
    return dataclasses.replace(choice, reason=f"{choice.reason}, {cache}")
