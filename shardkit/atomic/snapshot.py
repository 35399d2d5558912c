"""Reading a checkpoint folder that another process may be rewriting: one version, never a mix.

The read side of :mod:`shardkit.atomic.commit`. Readers take no lock: :func:`read_consistently` notes
the folder's state (every visible file's name, inode, size and mtime, plus the journal), runs the
opener — which keeps a descriptor on every file it will read, so later reads see those inodes even
if a writer replaces them — and checks that the state did not change; otherwise it retries. A
checkpoint opened this way is a snapshot of exactly one version, even while another process
rewrites the folder in place (``tests/test_concurrency.py`` proves it with a reader racing a writer
that swaps two checkpoints with identical names, shapes and headers but different values).

A folder left *pending* by a crash past the commit point is never rolled forward by a reader:
readers wait while a live writer is mid-commit (it holds the folder's lock) and report a crashed
writer's journal in one line naming ``shardkit recover``; :func:`settle` (``recover`` and every
write into the folder) rolls it forward, after checking every entry (:mod:`shardkit.atomic.journal`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

from ..errors import CheckpointIndexError, ShardkitError
from ..formats.suffixes import CHECKPOINT_SUFFIXES, DCP_METADATA
from .journal import JOURNAL, TMP_MARK, recover, try_lock

T = TypeVar("T")


# Names a checkpoint reader depends on; other files (a browser's growing download, logs) may
# change all the time without making a read inconsistent.
WATCHED_SUFFIXES = (*CHECKPOINT_SUFFIXES, ".json", DCP_METADATA)


def folder_state(folder: str, *, only: str | None = None) -> tuple[tuple[str, int, int, int], ...]:
    """What a reader of ``folder`` would see: each checkpoint file's name, inode, mtime and size.

    Temporary files are left out (they change nothing a reader sees); the journal is kept in.
    ``only`` restricts the state to one file name (plus the journal).
    """
    entries = []
    with os.scandir(folder) as it:
        for entry in it:
            name = entry.name
            if name.startswith(TMP_MARK) or name.startswith(JOURNAL + ".") or (
                    name != JOURNAL and (not name.endswith(WATCHED_SUFFIXES) if only is None else name != only)):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # removed while listing: a writer is active, never a stable state
                entries.append((entry.name, -1, -1, -1))
                continue
            entries.append((entry.name, st.st_ino, st.st_mtime_ns, st.st_size))
    return tuple(sorted(entries))


def _pending_journal_folder(folder: str) -> str | None:
    """The folder (this one or its parent, for pipeline components) with a pending journal."""
    for candidate in (folder, os.path.dirname(os.path.abspath(folder))):
        if os.path.exists(os.path.join(candidate, JOURNAL)):
            return candidate
    return None


def pending_journal(folder: str) -> bool:
    """True when ``folder`` (or its parent) holds a crashed writer's journal; False when none, or
    while a live writer is mid-commit (it holds the folder's lock). Reads only: never rolls forward."""
    pending = _pending_journal_folder(folder)
    if pending is None:
        return False
    try:
        fd = try_lock(pending)
    except OSError:
        fd = None
    if fd is None:
        return False
    os.close(fd)
    return os.path.lexists(os.path.join(pending, JOURNAL))


def _settle(folder: str) -> bool:
    """Wait for a live writer's commit; a crashed writer's journal is reported, never rolled forward.

    Readers (``info``, ``verify``, ``plan``, ``fit``, :func:`shardkit.open_source`) never write: a
    pending journal is for ``shardkit recover`` or the next write into the folder to settle.
    """
    pending = _pending_journal_folder(folder)
    if pending is None:
        return True
    if pending_journal(folder):
        raise CheckpointIndexError(
            f"{pending}: an interrupted shardkit write left {JOURNAL} here; reading commands never finish it: "
            f"run `shardkit recover {pending}` (or write into the folder again) first"
        )
    return False


def settle(folder: str | os.PathLike[str], *, timeout_s: float = 60.0) -> None:
    """Finish a crashed writer's committed write in ``folder`` (or wait for a live one to finish).

    The write side: it rolls the journal forward (``shardkit recover``); readers use
    :func:`wait_settled`. Raises a one-line :class:`CheckpointIndexError` when the folder cannot
    be written.

    settle("ckpt/")
    """
    folder = os.fspath(folder)
    deadline = time.monotonic() + timeout_s
    while os.path.isdir(folder) and not _recover(folder):
        if time.monotonic() > deadline:
            raise CheckpointIndexError(f"{folder} is being written by another shardkit process; try again")
        time.sleep(0.05)


def wait_settled(folder: str | os.PathLike[str], *, timeout_s: float = 60.0) -> None:
    """Wait while a live writer commits into ``folder``; a crashed writer's journal is a one-line error.

    wait_settled("ckpt/")
    """
    folder = os.fspath(folder)
    deadline = time.monotonic() + timeout_s
    while os.path.isdir(folder) and not _settle(folder):
        if time.monotonic() > deadline:
            raise CheckpointIndexError(f"{folder} is being written by another shardkit process; try again")
        time.sleep(0.05)


def _recover(folder: str) -> bool:
    """Roll a crashed writer's journal forward; False while a live writer is committing."""
    pending = _pending_journal_folder(folder)
    if pending is None:
        return True
    try:
        return recover(pending) and _pending_journal_folder(folder) is None
    except OSError as e:
        raise CheckpointIndexError(
            f"{pending}: an interrupted shardkit write left a journal that could not be finished here "
            f"({e.strerror or e}); run `shardkit recover {pending}` with write access"
        ) from e


def read_consistently(folder: str | os.PathLike[str], open_fn: Callable[[], T], *,
                      only: str | None = None, timeout_s: float = 60.0) -> T:
    """Run ``open_fn`` (which opens a checkpoint in ``folder``) until no writer changed it meanwhile.

    ``open_fn`` must keep a descriptor on every file it will read later, so a consistent open is
    a consistent snapshot. Results of discarded attempts are closed when they have ``close()``.
    ``only`` names the one file that matters (a single-file checkpoint), see :func:`folder_state`.

    source = read_consistently("ckpt/", lambda: open_safetensors_folder("ckpt/"))
    """
    folder = os.fspath(folder)
    deadline = time.monotonic() + timeout_s
    delay = 0.002
    while True:
        before = folder_state(folder, only=only) if _settle(folder) else None
        if before is not None and not any(name == JOURNAL or ino == -1 for name, ino, *_ in before):
            try:
                result = open_fn()
            except (ShardkitError, OSError):
                if folder_state(folder, only=only) == before:
                    raise
            else:
                if folder_state(folder, only=only) == before:
                    return result
                _close(result)
        if time.monotonic() > deadline:
            raise CheckpointIndexError(
                f"{folder}: kept changing while being opened (another process is rewriting it); try again"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def _close(obj: object) -> None:
    close = getattr(obj, "close", None)
    if callable(close):
        close()
