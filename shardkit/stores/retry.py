"""Retries with exponential back-off and a bound, for every remote request (the one retry loop).

A request that fails transiently (a reset connection, a cut body, a 5xx or throttling reply) is
tried again after ``base_delay_s``, doubling up to ``max_delay_s``, at most ``attempts`` times
in all and never past ``deadline_s`` from the first try; a closed reader (``stop`` set) ends the
retries at once. Anything not transient is raised on the first failure, keeping its type.

>>> calls = []
>>> def flaky() -> int:
...     calls.append(1)
...     if len(calls) < 3:
...         raise ConnectionResetError("reset")
...     return 42
>>> call_with_retries(flaky, policy=RetryPolicy(base_delay_s=0.0), transient=lambda e: isinstance(e, OSError))
42
>>> len(calls)
3
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ..errors import StoreError

__all__ = ["RetryPolicy", "call_with_retries"]

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry a transient failure."""

    attempts: int = 5
    base_delay_s: float = 0.2
    max_delay_s: float = 5.0
    deadline_s: float = 120.0

    def delay_s(self, failures: int) -> float:
        """The wait after the ``failures``-th failure (1-based)."""
        return float(min(self.max_delay_s, self.base_delay_s * 2 ** (failures - 1)))


def call_with_retries(fn: Callable[[], T], *, policy: RetryPolicy, transient: Callable[[BaseException], bool],
                      stop: threading.Event | None = None) -> T:
    """``fn()``, tried again on a transient failure within ``policy``; the last failure is raised as it was."""
    start = time.monotonic()
    failures = 0
    while True:
        try:
            return fn()
        except Exception as e:
            failures += 1
            wait = policy.delay_s(failures)
            out_of_time = time.monotonic() + wait - start > policy.deadline_s
            stopped = stop is not None and stop.is_set()
            if not transient(e) or failures >= policy.attempts or out_of_time or stopped:
                raise
        if stop is not None:
            if stop.wait(wait):
                raise StoreError("a request was stopped while being retried: its reader was closed")
        else:
            time.sleep(wait)
