"""The replace path's journal, and recovery from a crash at any step of a commit.

:class:`~shardkit.atomic.commit.OutputTransaction` writes ``.shardkit-journal.json`` (the commit point)
naming every removal and rename; :func:`roll_forward` applies it idempotently, so a crash while
applying it is rolled forward again by the next call. :func:`recover` does that under the
folder's ``flock`` and removes the temporary files and staging folders of writers that died.
See :mod:`shardkit.atomic.commit` for the whole protocol.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from typing import Any

from .. import _faults
from ..errors import CheckpointIndexError

TMP_MARK = ".shardkit-tmp-"
JOURNAL = ".shardkit-journal.json"


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def try_lock(path: str) -> int | None:
    """An fd holding an exclusive flock on ``path``, or None when another process holds it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


# ----------------------------------------------------------------------------- recovery

@dataclass
class Recovery:
    """What :func:`recover_folder` did: the journal it finished and the temporaries it removed."""

    folder: str
    rolled_forward: list[str] = field(default_factory=list)  # files an interrupted commit published
    removed: list[str] = field(default_factory=list)  # temporary files and staging folders of dead writers
    removed_bytes: int = 0

    @property
    def changed(self) -> bool:
        return bool(self.rolled_forward or self.removed)

    def to_dict(self) -> dict[str, Any]:
        return {"folder": self.folder, "rolled_forward": self.rolled_forward, "removed": self.removed,
                "removed_bytes": self.removed_bytes}

    def _remove(self, path: str) -> None:
        size_bytes = _tree_bytes(path)
        remove_path(path)
        self.removed.append(path)
        self.removed_bytes += size_bytes


def recover(folder: str | os.PathLike[str]) -> bool:
    """Finish an interrupted commit in ``folder`` and remove temporary files of dead writers.

    Returns False (and touches nothing) while another process is writing the folder.

    recover("out/")
    True
    """
    return recover_folder(folder) is not None


def recover_folder(folder: str | os.PathLike[str]) -> Recovery | None:
    """:func:`recover`, saying what it did; None while another process is writing the folder.

    Args:
        folder: a checkpoint folder (or the path a failed write was creating).

    Returns:
        A :class:`Recovery` listing the files rolled forward and the temporaries removed.

    recover_folder("out/").removed_bytes
    612000000
    """
    folder = os.fspath(folder)
    report = Recovery(folder)
    if not os.path.isdir(folder):
        cleanup_stale_staging(folder, report)
        return report
    fd = try_lock(folder)
    if fd is None:
        return None
    try:
        recover_locked(folder, report)
    finally:
        os.close(fd)
    cleanup_stale_staging(folder, report)
    return report


def recover_locked(folder: str, report: Recovery | None = None) -> Recovery:
    report = report if report is not None else Recovery(folder)
    if os.path.exists(os.path.join(folder, JOURNAL)):
        plan = _read_journal(folder)
        roll_forward(folder, plan)
        report.rolled_forward.extend(final for _, final in plan["renames"])
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in filenames + dirnames:
            if name.startswith(JOURNAL + ".") or (name.startswith(TMP_MARK) and is_stale_tmp(name)):
                report._remove(os.path.join(dirpath, name))
        if dirpath != folder:
            dirnames[:] = []  # temporary files live at most one folder down (pipeline components)
    return report


def _tree_bytes(path: str) -> int:
    """Bytes in a file or folder (apparent sizes), for saying how much a cleanup freed."""
    try:
        if not os.path.isdir(path) or os.path.islink(path):
            return os.lstat(path).st_size
    except OSError:
        return 0
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def is_stale_tmp(name: str) -> bool:
    """A ``.shardkit-tmp-<pid>-...`` file whose writer is gone (the folder lock is ours)."""
    pid = name[len(TMP_MARK):].split("-")[0]
    return not (pid.isdigit() and _pid_alive(int(pid)))


def _read_journal(folder: str) -> dict[str, list[Any]]:
    path = os.path.join(folder, JOURNAL)
    try:
        with open(path, encoding="utf-8") as f:
            plan = json.load(f)
        _check_journal(plan)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointIndexError(
            f"{path}: unreadable shardkit journal ({e}); it was written durably before use, so this "
            "file was altered by hand: inspect the folder and delete the journal to proceed"
        ) from e
    return plan


def _check_journal(plan: Any) -> None:
    for key in ("remove_first", "renames", "delete"):
        for item in plan[key]:
            names = item if key == "renames" else [item]
            if not all(isinstance(n, str) and n and not os.path.isabs(n) and ".." not in n.split("/") for n in names):
                raise ValueError(f"bad entry {item!r} in {key}")


def cleanup_stale_staging(output: str, report: Recovery | None = None) -> None:
    """Remove staging folders beside ``output`` whose writer died (their flock is free)."""
    parent, base = os.path.split(os.path.abspath(output))
    prefix = f".{base}{TMP_MARK}"
    try:
        names = [n for n in os.listdir(parent) if n.startswith(prefix)]
    except OSError:
        return
    for name in names:
        path = os.path.join(parent, name)
        try:
            fd = try_lock(path)
        except OSError:
            continue
        if fd is not None:
            try:
                size_bytes = _tree_bytes(path) if report is not None else 0
                shutil.rmtree(path, ignore_errors=True)
                if report is not None:
                    report.removed.append(path)
                    report.removed_bytes += size_bytes
            finally:
                os.close(fd)


def discard_path(path: str) -> None:
    """Remove what a failed write left; a cleanup error must never hide the error that caused it.

    On a read-only or vanished filesystem the unlink fails too (EROFS, not ENOENT); the file was
    never created there, and the first error is the one the user needs to see.
    """
    try:
        remove_path(path)
    except OSError as e:
        logging.getLogger("shardkit").debug("could not remove %s after a failed write: %s", path, e)


def remove_path(path: str) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass


def roll_forward(folder: str, plan: dict[str, list[Any]]) -> None:
    """Apply a journal; every step is idempotent, so a crash here is rolled forward again."""
    renamed = {final for tmp, final in plan["renames"] if not os.path.lexists(os.path.join(folder, tmp))}
    for old_index in plan["remove_first"]:
        if old_index not in renamed:  # already replaced by its new version on an earlier pass
            remove_path(os.path.join(folder, old_index))
        _faults.point("commit:removed-old-index")
    for tmp, final in plan["renames"]:
        if os.path.lexists(os.path.join(folder, tmp)):
            os.replace(os.path.join(folder, tmp), os.path.join(folder, final))
        _faults.point("commit:renamed")
    for stale in plan["delete"]:
        remove_path(os.path.join(folder, stale))
        _faults.point("commit:deleted-stale")
    for sub in {os.path.dirname(final) for _, final in plan["renames"]} - {""}:
        fsync_dir(os.path.join(folder, sub))
    fsync_dir(folder)
    _faults.point("commit:before-journal-removal")
    os.unlink(os.path.join(folder, JOURNAL))
    fsync_dir(folder)
    _faults.point("commit:done")

