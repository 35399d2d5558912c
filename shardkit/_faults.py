"""Deterministic fault points for crash and I/O-error tests. Inert unless an env var is set.

Writers call :func:`point` at every place where a crash or an I/O error matters: each write
call, each finished file, each step of a commit. The environment (read once, at import) decides
what happens there:

``SHARDKIT_FAULT_TRACE=path``            append ``<n> <label> <bytes>`` for every point hit
``SHARDKIT_FAULT_KILL_AT=n``              SIGKILL this process at the n-th point (1-based)
``SHARDKIT_FAULT_KILL_AT_LABEL=prefix``   SIGKILL at the first point whose label starts with it
                                          (the same step whatever the write calls before it were)
``SHARDKIT_FAULT_KILL_AFTER_BYTES=n``     SIGKILL at the first point after n bytes were written
``SHARDKIT_FAULT_ERRNO_AT=n:ENOSPC``      raise ``OSError(ENOSPC)`` at the n-th point instead
``SHARDKIT_FAULT_WAIT_AT=label-prefix``   at the first matching point, create
                                          ``$SHARDKIT_FAULT_WAIT_FILE.ready.<pid>`` and block until
                                          ``$SHARDKIT_FAULT_WAIT_FILE`` exists

With none set, :func:`point` is one global lookup and a return: nothing to pay in production.
"""

from __future__ import annotations

import errno
import os
import signal
import time


def _int_env(name: str) -> int:
    value = os.environ.get(name, "").strip()
    return int(value) if value.isdigit() else 0


_TRACE = os.environ.get("SHARDKIT_FAULT_TRACE") or None
_KILL_AT = _int_env("SHARDKIT_FAULT_KILL_AT")
_KILL_AT_LABEL = os.environ.get("SHARDKIT_FAULT_KILL_AT_LABEL") or None
_KILL_AFTER_BYTES = _int_env("SHARDKIT_FAULT_KILL_AFTER_BYTES")
_ERRNO_AT, _, _ERRNO_NAME = os.environ.get("SHARDKIT_FAULT_ERRNO_AT", "").partition(":")
_ERRNO_AT_N = int(_ERRNO_AT) if _ERRNO_AT.isdigit() else 0
_WAIT_AT = os.environ.get("SHARDKIT_FAULT_WAIT_AT") or None
_WAIT_FILE = os.environ.get("SHARDKIT_FAULT_WAIT_FILE") or None
WAIT_LIMIT_S = 600.0  # a process paused at a point waits at most this long for its go-ahead, then is killed
ACTIVE = bool(_TRACE or _KILL_AT or _KILL_AT_LABEL or _KILL_AFTER_BYTES or _ERRNO_AT_N or (_WAIT_AT and _WAIT_FILE))

_points = 0
_bytes = 0


def point(label: str, nbytes: int = 0) -> None:
    """Mark a fault point; ``nbytes`` is how many output bytes were written just before it."""
    if not ACTIVE:
        return
    _hit(label, nbytes)


def _hit(label: str, nbytes: int) -> None:
    global _points, _bytes
    _points += 1
    _bytes += nbytes
    if _TRACE:
        with open(_TRACE, "a", encoding="utf-8") as f:
            f.write(f"{_points} {label} {_bytes}\n")
    if _KILL_AT and _points == _KILL_AT or _KILL_AFTER_BYTES and _bytes >= _KILL_AFTER_BYTES \
            or _KILL_AT_LABEL and label.startswith(_KILL_AT_LABEL):
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)  # never run past the point, even if delivery lags
    if _ERRNO_AT_N and _points == _ERRNO_AT_N:
        code = getattr(errno, _ERRNO_NAME or "EIO", errno.EIO)
        raise OSError(code, f"{os.strerror(code)} (injected at {label})")
    if _WAIT_AT and _WAIT_FILE and label.startswith(_WAIT_AT):
        open(f"{_WAIT_FILE}.ready.{os.getpid()}", "a").close()
        deadline = time.monotonic() + WAIT_LIMIT_S
        while not os.path.exists(_WAIT_FILE):
            if time.monotonic() > deadline:  # the test that paused it is gone: never outlive it by more
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.01)
