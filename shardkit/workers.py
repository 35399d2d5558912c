"""Bounded worker threads that every stage closes the same way: shardkit's reads of local, FUSE and
network files (:mod:`shardkit.loading`) and of ``hf://`` range requests (:mod:`shardkit.stores.streamed`).

>>> pool = ReadPool(threads=2)
>>> [pool.submit(lambda: 6 * 7).result() for _ in range(3)]
[42, 42, 42]
>>> pool.close(), pool.stopping.is_set()
(True, True)
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["CLOSE_TIMEOUT_S", "ReadPool"]

log = logging.getLogger("shardkit")

CLOSE_TIMEOUT_S = 30.0  # close(): how long to wait for work already running
EXIT_TIMEOUT_S = 10.0   # at interpreter exit: how long to wait for reads still running in pools never closed
_OPEN_POOLS: weakref.WeakSet[ReadPool] = weakref.WeakSet()  # pools with threads, not closed yet


class ReadPool:
    """``threads`` worker threads (started on first use) running submitted callables in order.

    ``close`` cancels what has not started, sets ``stopping`` (work that loops or retries checks
    it) and joins every thread with a bound. The threads are daemons: one still blocked in a
    read past the bound cannot hold up the interpreter's exit. A pool nobody closed is closed
    at interpreter exit (an ``atexit`` hook, before daemon threads are frozen): what is queued
    is cancelled and reads already running finish (bounded by ``EXIT_TIMEOUT_S``), so no worker
    wakes up while the interpreter is being torn down.
    """

    def __init__(self, threads: int, *, name: str = "shardkit-read") -> None:
        self.threads = threads
        self._name = name
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False
        self._busy = 0  # workers running a task (not waiting for one)
        self._stops_sent = 0  # end-of-work markers queued by close(): one per worker
        self.stopping = threading.Event()  # set by close(): work that retries should give up

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn()`` on a worker; its future is cancelled if the pool closes before it starts."""
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("read pool is closed")
            if len(self._workers) < self.threads:
                worker = threading.Thread(target=self._work, name=f"{self._name}-{len(self._workers)}", daemon=True)
                worker.start()
                self._workers.append(worker)
                _OPEN_POOLS.add(self)
            self._queue.put((future, fn))
        return future

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn = item
            if self._closed:
                future.cancel()
            if not future.set_running_or_notify_cancel():  # cancelled: wakes whoever waits on it
                continue
            with self._lock:
                self._busy += 1
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to whoever waits on the future
                future.set_exception(e)
            finally:
                with self._lock:
                    self._busy -= 1

    def close(self, *, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Cancel what has not started, wait (bounded) for running reads; True when every thread ended.

        ``timeout_s=0`` (a pool dropped with its owner) waits for nothing: idle threads end as soon
        as they are scheduled, running ones after their task. A later ``close`` (the exit hook)
        still joins them.
        """
        self.stopping.set()
        with self._lock:
            self._closed = True
            workers = list(self._workers)  # kept: a later close() joins them again
        drained_stops = 0
        while True:  # drain: nothing queued will start
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:  # an end marker of an earlier close(): put back below
                drained_stops += 1
                continue
            item[0].cancel()
            item[0].set_running_or_notify_cancel()
        with self._lock:
            stops, self._stops_sent = len(workers) - self._stops_sent, len(workers)
        for _ in range(stops + drained_stops):
            self._queue.put(None)
        deadline = time.monotonic() + timeout_s
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        alive = [w.name for w in workers if w.is_alive()]
        if not alive:
            _OPEN_POOLS.discard(self)
        elif timeout_s > 0 and self._busy:
            log.warning("%d read threads still blocked in a read after %.0f s (%s); leaving them", self._busy,
                        timeout_s, ", ".join(alive[:3]))
        return not alive


def _close_open_pools() -> None:
    """At interpreter exit: close every pool nobody closed (cancel what is queued, let running reads
    finish, join), so no worker thread wakes while the interpreter is torn down."""
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    for pool in list(_OPEN_POOLS):
        pool.close(timeout_s=max(0.0, deadline - time.monotonic()))


atexit.register(_close_open_pools)
