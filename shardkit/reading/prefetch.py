"""Keep reads in flight: one bounded pool of reader threads per checkpoint, and a read-ahead window.

On a network or FUSE filesystem every read request costs a round trip, so speed is requests in
flight × request size ÷ latency. :class:`ReadPool` runs range reads (a few MiB each) on a fixed
number of threads, so one tensor's ranges, and the next tensors' (read ahead by
:class:`ReadAhead` while the caller uses the current one), are all in flight at once. Each read
lands straight in its destination tensor; the task holds the destination, so memory a worker
writes into stays alive until it is done. ``close`` cancels what has not started and joins every
thread with a bound.

>>> pool = ReadPool(threads=2)
>>> futures = [pool.submit(lambda: 6 * 7) for _ in range(4)]
>>> wait_all(futures); [f.result() for f in futures]
[42, 42, 42, 42]
>>> pool.close()
True

With a reader: ``wait_all(submit_reads(pool, reader, [job], keep=tensor, chunk_bytes=4 << 20))``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

from ..workers import ReadPool
from .readers import Reader, ReadJob, split_jobs

if TYPE_CHECKING:
    import torch

log = logging.getLogger("shardkit")

READ_AHEAD_BYTES = 256 << 20      # default read-ahead budget of a lazy checkpoint's mapping


def wait_all(futures: list[Future[None]]) -> None:
    """Wait for every future; on the first failure cancel the rest, wait for those running, raise it."""
    done, pending = wait(futures, return_when="FIRST_EXCEPTION")
    error = next((e for f in futures if f.done() and not f.cancelled() and (e := f.exception()) is not None), None)
    if error is None:
        return
    for future in pending:
        future.cancel()
    wait(pending)
    raise error


def submit_reads(pool: ReadPool, reader: Reader, jobs: list[ReadJob], *, keep: object, chunk_bytes: int) -> list[Future[None]]:
    """Each job cut into ``chunk_bytes`` ranges, all submitted at once; ``keep`` (the destination) lives
    as long as any of them runs."""

    return [pool.submit(partial(_read_chunk, reader, chunk, keep)) for chunk in split_jobs(jobs, chunk_bytes=chunk_bytes)]


def _read_chunk(reader: Reader, chunk: ReadJob, keep: object) -> None:
    """The task holds ``keep`` (the destination) until it returns: the memory written stays alive."""
    reader.read_one(chunk)


@dataclass
class Pending:
    """A tensor read ahead: its destination and the reads filling it."""

    tensor: torch.Tensor
    futures: list[Future[None]]
    nbytes: int


@dataclass
class ReadAhead:
    """The read-ahead window of a lazy mapping: tensors read ahead in iteration order, within a budget.

    A read of the tensor that follows the last one read (in the mapping's iteration order), or of
    one already read ahead, is sequential: the window then extends past it while the budget
    (bytes of tensors read ahead and not yet taken) allows. A tensor read ahead is kept until it
    is taken or the checkpoint closes, so no byte is read twice.
    """

    order: list[str]
    budget_bytes: int
    pending: dict[str, Pending] = field(default_factory=dict)
    pending_bytes: int = 0
    last: int = -1           # position of the last tensor read
    scheduled: int = 0       # positions below this were considered for read-ahead
    taken: set[str] = field(default_factory=set)  # read already: never read ahead again
    lock: threading.Lock = field(default_factory=threading.Lock)
    _position: dict[str, int] | None = None

    def position(self, name: str) -> int:
        if self._position is None:
            self._position = {n: i for i, n in enumerate(self.order)}
        return self._position[name]

    def take(self, name: str) -> tuple[Pending | None, bool]:
        """The tensor read ahead for ``name`` (if any) and whether this read is sequential."""
        with self.lock:
            pos = self.position(name)
            hit = self.pending.pop(name, None)
            if hit is not None:
                self.pending_bytes -= hit.nbytes
            sequential = hit is not None or pos == self.last + 1
            self.taken.add(name)
            self.last = pos
            if sequential:
                self.scheduled = max(self.scheduled, pos + 1)
            return hit, sequential

    def extend(self, size_of: Callable[[str], int | None], start: Callable[[str, int], Pending]) -> int:
        """Read ahead past the last sequential read while the budget allows; returns how many started.

        ``size_of(name)``: the bytes to read ahead for ``name``, or None to pass over it
        (memory-mapped, empty, unreadable: the caller meets that when it asks). ``start`` submits
        the reads; both run under the window's lock, so a name is never read ahead twice.
        """
        started = 0
        with self.lock:
            while self.scheduled < len(self.order):
                name = self.order[self.scheduled]
                nbytes = None if name in self.pending or name in self.taken else size_of(name)
                if nbytes is not None and self.pending_bytes + nbytes > self.budget_bytes:
                    break
                self.scheduled += 1
                if nbytes is not None:
                    self.pending[name] = start(name, nbytes)
                    self.pending_bytes += nbytes
                    started += 1
        return started

    def clear(self) -> list[Pending]:
        """Everything read ahead, forgotten (on close)."""
        with self.lock:
            dropped = list(self.pending.values())
            self.pending.clear()
            self.pending_bytes = 0
            return dropped
