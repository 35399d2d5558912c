"""The replace path's journal, and recovery from a crash at any step of a commit.

:class:`~shardkit.atomic.commit.OutputTransaction` writes ``.shardkit-journal.json`` (the commit point)
naming every removal and rename; :func:`roll_forward` applies it idempotently, so a crash while
applying it is rolled forward again by the next call. :func:`recover` does that under the
folder's ``flock`` and removes the temporary files and staging folders of writers that died.
See :mod:`shardkit.atomic.commit` for the whole protocol.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import stat
from dataclasses import dataclass, field
from typing import TypedDict

from .. import _faults
from ..errors import JournalError as JournalError  # re-exported: defined with every public error
from ..formats.links import (
    OutsideFolderError,
    UntrustedFileError,
    check_name,
    check_write_target,
    open_parent,
    parse_json,
    read_inside,
)
from ..formats.suffixes import SAVED_WEIGHT_SUFFIXES, is_index_file, is_manifest_file

TMP_MARK = ".shardkit-tmp-"
JOURNAL = ".shardkit-journal.json"
PLAN_MARK = ".shardkit-plan-"  # ``.<output>.shardkit-plan-<id>``: the shards a plan's tasks finished, kept for a resume


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


def try_lock(path: str, *, shared: bool = False) -> int | None:
    """An fd holding a flock on ``path``, exclusive (or ``shared``: many plan tasks at once), or None
    when another process holds a lock that excludes it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
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

    def to_dict(self) -> dict[str, object]:
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


def recover_folder(folder: str | os.PathLike[str], *, plans: bool = False) -> Recovery | None:
    """:func:`recover`, saying what it did; None while another process is writing the folder.

    Args:
        folder: a checkpoint folder (or the path a failed write was creating).
        plans: also remove the work folders of plans into it that no task is running (``shardkit
            recover``: an abandoned plan; a write never does, so that a rerun resumes).

    Returns:
        A :class:`Recovery` listing the files rolled forward and the temporaries removed.

    recover_folder("out/").removed_bytes
    612000000
    """
    folder = os.fspath(folder)
    report = Recovery(folder)
    if not os.path.isdir(folder):
        cleanup_stale_staging(folder, report)
        if plans:
            cleanup_plan_folders(folder, report)
        return report
    fd = try_lock(folder)
    if fd is None:
        return None
    try:
        recover_locked(folder, report)
    finally:
        os.close(fd)
    cleanup_stale_staging(folder, report)
    if plans:
        cleanup_plan_folders(folder, report)
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


MAX_JOURNAL_BYTES = 64_000_000
MAX_JOURNAL_ENTRIES = 1_000_000
_TMP_RE = re.compile(rf"^{re.escape(TMP_MARK)}\d+-[0-9a-f]+-(?P<base>.+)$")


class JournalPlan(TypedDict):
    """The journal's JSON: names relative to the output folder, checked by ``_check_journal`` when read."""

    remove_first: list[str]  # indexes removed before any rename (what makes shards visible goes first)
    renames: list[list[str]]  # [temporary, final] pairs
    delete: list[str]  # stale files removed after the renames


def _journal_error(folder: str, why: str) -> JournalError:
    return JournalError(f"{os.path.join(folder, JOURNAL)}: not shardkit's own journal ({why}); recovery stopped and "
                        "changed nothing: inspect the folder and delete the journal to proceed")


def _read_journal(folder: str) -> JournalPlan:
    """The journal of ``folder``, read through a checked descriptor and validated entry by entry."""
    path = os.path.join(folder, JOURNAL)
    try:
        data = read_inside(folder, JOURNAL, where=folder, max_bytes=MAX_JOURNAL_BYTES)
        plan = parse_json(data, path=path, what="shardkit journal")
    except UntrustedFileError as e:
        raise _journal_error(folder, str(e).removeprefix(f"{folder}: ").removeprefix(f"{path}: ")) from e
    return _check_journal(plan, folder)


def _check_journal(plan: object, folder: str) -> JournalPlan:
    """Entries may only name files a transaction creates: ``.shardkit-tmp-*`` files renamed onto the
    output's own names beside them, and the checkpoint files, indexes and manifests it replaces.
    Returns the plan made of the names checked."""
    if not isinstance(plan, dict) or set(plan) != {"remove_first", "renames", "delete"}:
        raise _journal_error(folder, "it must be an object with exactly remove_first, renames and delete")
    if not all(isinstance(plan[k], list) for k in plan) or sum(len(plan[k]) for k in plan) > MAX_JOURNAL_ENTRIES:
        raise _journal_error(folder, "its entries must be lists of at most a million names")
    renames: list[list[str]] = []
    for pair in plan["renames"]:
        if not (isinstance(pair, list) and len(pair) == 2):
            raise _journal_error(folder, f"renames entry {pair!r} is not a [temporary, final] pair")
        tmp, final = (_own_name(n, folder, "renames") for n in pair)
        renames.append([tmp, final])
        m = _TMP_RE.match(os.path.basename(tmp))
        if m is None or m["base"] != os.path.basename(final) or os.path.dirname(tmp) != os.path.dirname(final):
            raise _journal_error(folder, f"renames entry {pair!r} does not rename a {TMP_MARK}* file onto its own name")
        if _TMP_RE.match(os.path.basename(final)):
            raise _journal_error(folder, f"renames entry {pair!r} renames onto a temporary name")
    replaced: dict[str, list[str]] = {"remove_first": [], "delete": []}
    for key, names in replaced.items():
        for name in plan[key]:
            own = _own_name(name, folder, key)
            if not _replaceable(own):
                raise _journal_error(folder, f"{key} entry {name!r} is not a checkpoint file, index or manifest")
            names.append(own)
    return JournalPlan(remove_first=replaced["remove_first"], renames=renames, delete=replaced["delete"])


def _own_name(name: object, folder: str, key: str) -> str:
    try:
        parts = check_name(name, where=key)
    except OutsideFolderError as e:
        raise _journal_error(folder, str(e)) from e
    if len(parts) > 2 or parts[-1] == JOURNAL or parts[-1].startswith(JOURNAL + "."):
        raise _journal_error(folder, f"{key} entry {name!r} is not a file of the folder or of one component folder")
    return str(name)


def _replaceable(name: str) -> bool:
    base = os.path.basename(name)
    return base.endswith(SAVED_WEIGHT_SUFFIXES) or is_index_file(base) or is_manifest_file(base)


def cleanup_plan_folders(output: str, report: Recovery | None = None) -> None:
    """Remove the work folders of plans into ``output`` that no task is running (``recover`` only:
    a writer keeps them, since a rerun resumes from the shards they hold)."""
    cleanup_stale_staging(output, report, mark=PLAN_MARK)


def cleanup_stale_staging(output: str, report: Recovery | None = None, *, mark: str = TMP_MARK) -> None:
    """Remove staging folders beside ``output`` whose writer died (their flock is free)."""
    parent, base = os.path.split(os.path.abspath(output))
    prefix = f".{base}{mark}"
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
    """Remove a file, a symlink (never what it leads to) or a folder; a trailing ``/`` changes nothing."""
    path = path.rstrip(os.sep) or path
    try:
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass


def _checked_step(folder: str, name: str, *, link_ok: bool = True) -> tuple[int, str] | None:
    """``(dir_fd, base)`` for a journal entry; None when its folder is gone. Refuses folders and
    symlinked parents; the entry itself may be a symlink only where ``link_ok`` (unlinked or
    replaced, never followed)."""
    where = os.path.join(folder, JOURNAL)
    try:
        check_write_target(folder, name, where=where, link_ok=link_ok)
        return open_parent(folder, name, where=where)
    except FileNotFoundError:
        return None
    except OutsideFolderError as e:
        raise _journal_error(folder, str(e).removeprefix(f"{where}: ")) from e


def _check_steps(folder: str, plan: JournalPlan) -> None:
    """Every entry checked against the folder before the first change: one bad entry changes nothing.

    A temporary file must be a regular file (never a link moved into place); the names it replaces
    and the stale files deleted may be links themselves (removed, never followed).
    """
    names = [(tmp, False) for tmp, _ in plan["renames"]] + [(final, True) for _, final in plan["renames"]]
    for name, link_ok in names + [(n, True) for n in plan["remove_first"] + plan["delete"]]:
        step = _checked_step(folder, name, link_ok=link_ok)
        if step is not None:
            os.close(step[0])


def _unlink_step(folder: str, name: str) -> None:
    step = _checked_step(folder, name)
    if step is None:
        return
    dir_fd, base = step
    try:
        os.unlink(base, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    finally:
        os.close(dir_fd)


def _rename_step(folder: str, tmp: str, final: str) -> None:
    step = _checked_step(folder, tmp, link_ok=False)
    if step is None:
        return
    dir_fd, base = step
    try:
        os.stat(base, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        os.close(dir_fd)
        return  # renamed on an earlier pass
    try:
        os.replace(base, os.path.basename(final), src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def roll_forward(folder: str, plan: JournalPlan) -> None:
    """Apply a journal; every step is idempotent, so a crash here is rolled forward again.

    Every entry is checked first (:func:`_check_steps`): a name that is a symlink, a folder or
    passes through a symlinked folder stops recovery before anything changes.
    """
    _check_steps(folder, plan)
    renamed = {final for tmp, final in plan["renames"] if not os.path.lexists(os.path.join(folder, tmp))}
    for old_index in plan["remove_first"]:
        if old_index not in renamed:  # already replaced by its new version on an earlier pass
            _unlink_step(folder, old_index)
        _faults.point("commit:removed-old-index")
    for tmp, final in plan["renames"]:
        _rename_step(folder, tmp, final)
        _faults.point("commit:renamed")
    for stale in plan["delete"]:
        _unlink_step(folder, stale)
        _faults.point("commit:deleted-stale")
    for sub in {os.path.dirname(final) for _, final in plan["renames"]} - {""}:
        fsync_dir(os.path.join(folder, sub))
    fsync_dir(folder)
    _faults.point("commit:before-journal-removal")
    os.unlink(os.path.join(folder, JOURNAL))
    fsync_dir(folder)
    _faults.point("commit:done")
