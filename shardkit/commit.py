"""Publishing output atomically: nothing partial is ever visible, nothing is lost on failure.

Two paths:

* **fresh** (the output does not exist, or is an empty folder): every file is written into a
  hidden staging folder beside the output, fsynced, and the staging folder is renamed onto the
  output in one step. Another process that wins the race makes our rename fail cleanly.
* **replace** (``overwrite=True``, including resharding a folder into itself): new files are
  written under hidden temporary names inside the output, under an exclusive lock. Then a
  journal naming every rename and deletion is made durable (the commit point), the old index is
  removed first, files are renamed into place, the new index goes last, stale files are deleted
  and the journal is removed. A crash after the commit point is rolled forward by the next
  shardkit call on that folder (:func:`recover`); a crash before it leaves the old checkpoint
  untouched and only temporary files, which the next run removes.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
from typing import Iterable

from .errors import OutputExistsError, ShardkitError, ShardkitWriteError

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


def recover(folder: str) -> None:
    """Finish an interrupted commit (journal present) or remove stale temporary files."""
    if not os.path.isdir(folder):
        return
    journal = os.path.join(folder, JOURNAL)
    if os.path.exists(journal):
        _roll_forward(folder)
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in filenames + dirnames:
            if name.startswith(TMP_MARK) or name.startswith(JOURNAL):
                _remove(os.path.join(dirpath, name))
        if dirpath != folder:
            dirnames[:] = []  # temporary files live at most one folder down (pipeline components)


def _tmp_name(token: str, filename: str) -> str:
    """``unet/model.safetensors`` → ``unet/.shardkit-tmp-<token>-model.safetensors``."""
    head, tail = os.path.split(filename)
    return os.path.join(head, f"{TMP_MARK}{token}-{tail}")


def _cleanup_stale_staging(output: str) -> None:
    parent, base = os.path.split(os.path.abspath(output))
    prefix = f".{base}{TMP_MARK}"
    for name in os.listdir(parent):
        if name.startswith(prefix):
            pid = name[len(prefix):].split("-")[0]
            if pid.isdigit() and not _pid_alive(int(pid)):
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def _remove(path: str) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass


def _roll_forward(folder: str) -> None:
    path = os.path.join(folder, JOURNAL)
    with open(path, encoding="utf-8") as f:
        plan = json.load(f)
    for old_index in plan["remove_first"]:
        _remove(os.path.join(folder, old_index))
    for tmp, final in plan["renames"]:
        if os.path.exists(os.path.join(folder, tmp)):
            os.replace(os.path.join(folder, tmp), os.path.join(folder, final))
    for stale in plan["delete"]:
        _remove(os.path.join(folder, stale))
    for sub in {os.path.dirname(final) for _, final in plan["renames"]} - {""}:
        fsync_dir(os.path.join(folder, sub))
    fsync_dir(folder)
    os.unlink(path)
    fsync_dir(folder)


class OutputTransaction:
    """Write files for ``output`` via :meth:`path_for`, then :meth:`commit` them all at once.

    >>> with OutputTransaction("out/", overwrite=False) as tx:           # doctest: +SKIP
    ...     write_file(tx.path_for("model.safetensors"))
    ...     tx.commit(["model.safetensors"])
    """

    def __init__(self, output: str | os.PathLike[str], *, overwrite: bool = False,
                 stale: Iterable[str] = ()) -> None:
        self.output = os.path.abspath(os.fspath(output))
        self.overwrite = overwrite
        self.stale = list(stale)  # paths relative to the output folder
        self._token = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._lock_fd: int | None = None
        self._staging: str | None = None
        self._written: list[str] = []
        self._committed = False

    def __enter__(self) -> "OutputTransaction":
        if os.path.exists(self.output) and not os.path.isdir(self.output):
            raise OutputExistsError(f"{self.output} exists and is a file; the output must be a folder")
        parent = os.path.dirname(self.output)
        if not os.path.isdir(parent):
            raise ShardkitWriteError(f"{parent}: parent folder of the output does not exist")
        if os.path.isdir(self.output):
            self._lock()
            recover(self.output)
        if os.path.isdir(self.output) and os.listdir(self.output):
            if not self.overwrite:
                self._unlock()
                raise OutputExistsError(f"{self.output} exists and is not empty; pass --overwrite to replace its checkpoint")
        else:
            self._unlock()
            _cleanup_stale_staging(self.output)
            self._staging = os.path.join(parent, f".{os.path.basename(self.output)}{TMP_MARK}{self._token}")
            os.mkdir(self._staging)
        return self

    def _lock(self) -> None:
        self._lock_fd = os.open(self.output, os.O_RDONLY)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            self._unlock()
            raise OutputExistsError(f"{self.output} is being written by another shardkit process") from e

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def path_for(self, filename: str) -> str:
        """Where to write the file that will be published as ``filename``."""
        if os.path.isabs(filename) or ".." in filename.split("/"):
            raise ValueError(f"output file name {filename!r} must be relative and stay inside the output")
        self._written.append(filename)
        root = self._staging if self._staging is not None else self.output
        path = os.path.join(root, filename if self._staging is not None else _tmp_name(self._token, filename))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return path

    def write_bytes(self, filename: str, data: bytes) -> None:
        """Write a small file (an index, a config) durably under the transaction."""
        with open(self.path_for(filename), "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def commit(self, last: str | None = None) -> None:
        """Publish every written file; ``last`` (the index) becomes visible after the others."""
        if self._staging is not None:
            self._commit_staging()
        else:
            self._commit_replace(last)
        self._committed = True

    def _commit_staging(self) -> None:
        assert self._staging is not None
        fsync_dir(self._staging)
        try:
            os.rename(self._staging, self.output)
        except OSError as e:
            raise OutputExistsError(
                f"{self.output} was created by another process while writing; nothing was published"
            ) from e
        self._staging = None
        fsync_dir(os.path.dirname(self.output))

    def _commit_replace(self, last: str | None) -> None:
        files = [f for f in self._written if f != last] + ([last] if last else [])
        renames = [[_tmp_name(self._token, f), f] for f in files]
        present = [s for s in self.stale if os.path.exists(os.path.join(self.output, s))]
        plan = {
            "remove_first": [s for s in present if s.endswith(".json")],
            "renames": renames,
            "delete": [s for s in present if s not in files and not s.endswith(".json")],
        }
        tmp = os.path.join(self.output, f"{JOURNAL}.{self._token}")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(plan, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(self.output)
        os.replace(tmp, os.path.join(self.output, JOURNAL))  # the commit point
        fsync_dir(self.output)
        _roll_forward(self.output)

    def abort(self) -> None:
        """Remove everything this transaction wrote; the previous output stays as it was."""
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None
        else:
            for filename in self._written:
                _remove(os.path.join(self.output, _tmp_name(self._token, filename)))

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            if not self._committed:
                self.abort()
        finally:
            self._unlock()


def atomic_output_file(path: str, *, overwrite: bool = False) -> str:
    """A temporary path beside ``path`` for a single-file output; see :func:`publish_file`."""
    if os.path.exists(path) and not overwrite:
        raise OutputExistsError(f"{path} exists; pass --overwrite to replace it")
    if os.path.isdir(path):
        raise OutputExistsError(f"{path} is a folder; expected a file path")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ShardkitError(f"{folder}: folder of the output does not exist")
    return os.path.join(folder, f"{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}-{os.path.basename(path)}")


def publish_file(tmp: str, path: str) -> None:
    """Rename a finished temporary file onto ``path`` durably."""
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
