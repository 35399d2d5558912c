"""Parallel read-ahead for a memory-mapped shard on a mount that answers like a local disk.

A memory map (safetensors' way, and ``read="mmap"``) faults its pages in from one thread, helped by
the kernel's read-ahead: little CPU, but the disk waits between faults. Parallel ``O_DIRECT`` reads
keep more requests in flight but cost about twice the CPU (fresh memory zeroed, then filled, by more
threads); on two cores and a fast disk, that CPU is what sets the time. On a passthrough FUSE mount
(bindfs, a container volume over a local disk) :class:`MapReadAhead` keeps the map and its CPU, and
asks the kernel to read ahead from a few threads: ``posix_fadvise(WILLNEED)`` on chunks in file order,
never more than ``window_bytes`` beyond the last byte a caller asked for, so a caller that reads one
tensor of a large shard does not read the whole shard. Advice only: the bytes still come through the
map, and a refused advice stops the read-ahead, never the read.

>>> import tempfile
>>> with tempfile.TemporaryFile() as f:
...     _ = f.write(bytes(3 << 20))
...     f.flush()
...     ahead = MapReadAhead(f.fileno(), 3 << 20, chunk_bytes=1 << 20, window_bytes=1 << 20)
...     ahead.advance(0)
...     asked = ahead.asked_bytes
...     ahead.advance(3 << 20)
...     asked, ahead.asked_bytes, ahead.close()
(1048576, 3145728, True)
"""

from __future__ import annotations

import functools
import logging
import os
import threading

from ..workers import ReadPool

log = logging.getLogger("shardkit")

MAP_AHEAD_THREADS = 2              # per shard; measured on bindfs, 2 cores: 1, 2 and 4 within 10%, 2 best
MAP_AHEAD_CHUNK_BYTES = 8 << 20    # one WILLNEED call
MAP_AHEAD_WINDOW_BYTES = 256 << 20  # asked for beyond the furthest byte a caller has asked for


class MapReadAhead:
    """Reads ahead of the callers of one mapped file, through its own duplicate descriptor.

    ``advance(end)`` says a caller has asked for the bytes before ``end``; chunks up to ``end`` +
    ``window_bytes`` are then advised, in order, on ``threads`` worker threads. ``close`` cancels what
    is queued and joins the threads (bounded) before closing the duplicate.
    """

    def __init__(self, fd: int, size_bytes: int, *, threads: int = MAP_AHEAD_THREADS,
                 chunk_bytes: int = MAP_AHEAD_CHUNK_BYTES, window_bytes: int = MAP_AHEAD_WINDOW_BYTES) -> None:
        self.size_bytes = size_bytes
        self.chunk_bytes = chunk_bytes
        self.window_bytes = window_bytes
        self.asked_bytes = 0  # advised so far, from the start of the file
        self._fd = os.dup(fd)  # the same open file (its read-ahead state); the shard may close its own first
        self._pool = ReadPool(threads, name="shardkit-map-ahead")
        self._lock = threading.Lock()
        self._refused = False
        try:  # the file is read in order: the kernel's own read-ahead window doubles
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except OSError as e:
            self._refuse(e)

    def advance(self, end_bytes: int) -> None:
        """A caller asked for the bytes before ``end_bytes``: advise the chunks up to the window beyond."""
        with self._lock:
            target = min(self.size_bytes, end_bytes + self.window_bytes)
            while self.asked_bytes < target and not self._refused and not self._pool.stopping.is_set():
                offset, nbytes = self.asked_bytes, min(self.chunk_bytes, self.size_bytes - self.asked_bytes)
                self._pool.submit(functools.partial(self._advise, offset, nbytes))
                self.asked_bytes += nbytes

    def _advise(self, offset: int, nbytes: int) -> None:
        if self._refused or self._pool.stopping.is_set():
            return
        try:
            os.posix_fadvise(self._fd, offset, nbytes, os.POSIX_FADV_WILLNEED)
        except OSError as e:  # advice only: the map still reads every byte
            self._refuse(e)

    def _refuse(self, error: OSError) -> None:
        if not self._refused:
            self._refused = True
            log.debug("read-ahead advice refused (%s): the map reads on its own", error)

    def close(self) -> bool:
        """Cancel what is queued, join the threads (bounded), close the duplicate; True when all ended."""
        ended = self._pool.close()
        if ended and self._fd >= 0:  # a thread still in an advice keeps the duplicate: it must not land in a reused descriptor
            os.close(self._fd)
            self._fd = -1
        return ended
