"""Publishing output atomically: nothing partial is ever visible, nothing is lost on failure.

Two paths:

* **fresh** (the output does not exist, or is an empty folder): every file is written into a
  hidden staging folder beside the output (``.<name>.shardkit-tmp-<pid>-<hex>``, locked with
  ``flock`` while its writer lives), fsynced, and the staging folder is renamed onto the output
  in one step. Another process that wins the race makes our rename fail cleanly.
* **replace** (``overwrite=True``, including resharding a folder into itself): new files are
  written under hidden temporary names inside the output, under an exclusive ``flock`` on the
  folder. Then a journal naming every rename and deletion is made durable (the commit point),
  the old index files are removed first, data files are renamed into place, index files go
  last, stale files are deleted and the journal is removed. A crash before the commit point
  leaves the old checkpoint untouched plus temporary files; a crash after it leaves the journal,
  and ``shardkit recover`` or the next write into the folder rolls it forward (:func:`recover`),
  after checking that every entry names a file of the folder itself (:mod:`shardkit.atomic.journal`).

At no moment does the folder hold an index naming a missing or partial shard: an index is
either the old one (all old shards still in place, because nothing is renamed before it is
removed) or the new one (renamed after every shard it names).

Right after a crash past the commit point the folder is *pending* (journal present, possibly no
index): not yet the complete new checkpoint. Policy: writers (split, convert, merge into or from
it, ``shardkit recover``) roll it forward under the folder lock; reading commands (``info``,
``verify``, ``plan``, ``fit``, :func:`shardkit.sources.open_source`, the lazy ``shardkit.open``)
never write: they wait while a live writer is mid-commit and otherwise refuse with a one-line
error naming ``shardkit recover FOLDER``. Other tools see no index during that window, never a wrong one.

Readers take a consistent snapshot without a lock: see :mod:`shardkit.atomic.snapshot`.

Temporary files carry the writer's pid (``.shardkit-tmp-<pid>-<hex>-<name>``) and are removed
by the next writer or :func:`recover` once that pid is gone; staging folders are removed once
their ``flock`` is free. Fault points (:mod:`shardkit._faults`) mark every step for crash tests.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
from collections.abc import Iterable, Iterator

from .. import _faults
from ..errors import (
    Option,
    OutputExistsError,
    ShardkitError,
    ShardkitWriteError,
    describe_os_error,
)
from ..formats.suffixes import is_index_file
from ..stores.urls import check_local
from .journal import (
    JOURNAL,
    TMP_MARK,
    JournalPlan,
    cleanup_stale_staging,
    discard_path,
    fsync_dir,
    is_stale_tmp,
    recover,
    recover_locked,
    remove_path,
    roll_forward,
    try_lock,
)

__all__ = ["JOURNAL", "TMP_MARK", "OutputTransaction", "atomic_output_file", "file_transaction", "fsync_dir",
           "output_folder", "publish_file", "recover"]


# ----------------------------------------------------------------------------- writing

def _tmp_name(token: str, filename: str) -> str:
    """``unet/model.safetensors`` → ``unet/.shardkit-tmp-<token>-model.safetensors``."""
    head, tail = os.path.split(filename)
    return os.path.join(head, f"{TMP_MARK}{token}-{tail}")


def _write_error(what: str, e: OSError) -> ShardkitWriteError:
    return ShardkitWriteError(f"{what} failed: {describe_os_error(e)}; nothing was published")


class OutputTransaction:
    """Write files for ``output`` via :meth:`path_for`, then :meth:`commit` them all at once.

    with OutputTransaction("out/", overwrite=False) as tx:
        write_file(tx.path_for("model.safetensors"))
        tx.commit(last="model.safetensors")
    """

    def __init__(self, output: str | os.PathLike[str], *, overwrite: bool = False,
                 stale: Iterable[str] = ()) -> None:
        check_local(output, role="output")  # never ./s3:/models/up for s3://models/up
        self.output = os.path.abspath(os.fspath(output))
        self.overwrite = overwrite
        self.stale = list(stale)  # paths relative to the output folder
        self._token = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._lock_fd: int | None = None
        self._staging: str | None = None
        self._written: list[str] = []
        self._committed = False
        self._past_commit_point = False

    def __enter__(self) -> OutputTransaction:
        if os.path.exists(self.output) and not os.path.isdir(self.output):
            raise OutputExistsError(f"{self.output} exists and is a file; the output must be a folder")
        parent = output_folder(self.output)
        try:
            self._enter(parent)
        except OSError as e:
            self._unlock()
            if isinstance(e, ShardkitError):
                raise
            raise _write_error(f"preparing {self.output}", e) from e
        return self

    def _enter(self, parent: str) -> None:
        if os.path.isdir(self.output):
            if not os.access(self.output, os.W_OK):
                raise ShardkitWriteError(f"{self.output} is not writable (a read-only filesystem or no permission); "
                                         "write to another folder")
            self._lock(self.output)
            recover_locked(self.output)
        if os.path.isdir(self.output) and os.listdir(self.output):
            if not self.overwrite:
                raise OutputExistsError(f"{self.output} exists and is not empty; pass ", Option("overwrite", True),
                                        " to replace its checkpoint")
            return
        if os.path.ismount(self.output):
            return  # a folder cannot be renamed onto a mount point: write inside it, as an in-place write does
        self._unlock()
        cleanup_stale_staging(self.output)
        self._staging = os.path.join(parent, f".{os.path.basename(self.output)}{TMP_MARK}{self._token}")
        os.mkdir(self._staging)
        self._lock(self._staging)

    def _lock(self, path: str) -> None:
        self._lock_fd = try_lock(path)
        if self._lock_fd is None:
            raise OutputExistsError(f"{self.output} is being written by another shardkit process; try again when it is done")

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
        path = self.path_for(filename)
        try:
            with open(path, "xb") as f:
                half = len(data) // 2  # two writes, so crash tests can stop inside the index
                f.write(data[:half])
                f.flush()
                _faults.point("write:small-file", half)
                f.write(data[half:])
                f.flush()
                _faults.point("write:small-file", len(data) - half)
                os.fsync(f.fileno())
        except OSError as e:
            raise _write_error(f"writing {path}", e) from e
        _faults.point("file-done:small-file")

    def commit(self, last: str | None = None) -> None:
        """Publish every written file; index files (``last`` the very last) follow the data."""
        try:
            if self._staging is not None:
                self._commit_staging()
            else:
                self._commit_replace(last)
        except OSError as e:
            if isinstance(e, ShardkitError):
                raise
            if not self._past_commit_point:
                raise _write_error(f"publishing into {self.output}", e) from e
            if self._staging is None and not os.path.exists(os.path.join(self.output, JOURNAL)):
                raise ShardkitWriteError(
                    f"{self.output} was published complete, but syncing its folder failed ({e.strerror or e}); "
                    "it may not survive a power loss: check the disk"
                ) from e
            raise ShardkitWriteError(
                f"publishing into {self.output} was committed but could not finish ({e.strerror or e}); "
                f"run `shardkit recover {self.output}` (or write into it again) to complete it"
            ) from e
        self._committed = True

    def _commit_staging(self) -> None:
        assert self._staging is not None
        for sub in {os.path.dirname(f) for f in self._written} - {""}:
            fsync_dir(os.path.join(self._staging, sub))
        fsync_dir(self._staging)
        _faults.point("commit:before-staging-rename")
        try:
            os.rename(self._staging, self.output)
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR):
                raise _write_error(f"publishing {self.output}", e) from e
            raise OutputExistsError(
                f"{self.output} was created by another process while writing; nothing was published"
            ) from e
        self._staging = None
        self._past_commit_point = True
        _faults.point("commit:after-staging-rename")
        fsync_dir(os.path.dirname(self.output))

    def _journal(self, last: str | None) -> JournalPlan:
        # Only index files go first and last: they are what makes shards visible. model_index.json,
        # configs and other side files are replaced by a plain atomic rename, so a pipeline folder
        # never loses its model_index.json during the commit.
        def is_index(name: str) -> bool:
            return is_index_file(os.path.basename(name))

        files = sorted(dict.fromkeys(self._written), key=lambda f: (f == last, is_index(f)))
        present = [s for s in self.stale if os.path.lexists(os.path.join(self.output, s))]
        replaced_indexes = [f for f in files if is_index(f) and os.path.lexists(os.path.join(self.output, f))]
        return {
            "remove_first": list(dict.fromkeys([s for s in present if is_index(s)] + replaced_indexes)),
            "renames": [[_tmp_name(self._token, f), f] for f in files],
            "delete": [s for s in present if s not in files and not is_index(s)],
        }

    def _commit_replace(self, last: str | None) -> None:
        plan = self._journal(last)
        for sub in {os.path.dirname(f) for f in self._written} - {""}:
            fsync_dir(os.path.join(self.output, sub))
        tmp = os.path.join(self.output, f"{JOURNAL}.{self._token}")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(plan, f)
            f.flush()
            _faults.point("commit:journal-written")
            os.fsync(f.fileno())
        fsync_dir(self.output)
        _faults.point("commit:before-commit-point")
        os.replace(tmp, os.path.join(self.output, JOURNAL))  # the commit point
        self._past_commit_point = True
        fsync_dir(self.output)
        _faults.point("commit:after-commit-point")
        roll_forward(self.output, plan)

    def abort(self) -> None:
        """Remove everything this transaction wrote; the previous output stays as it was."""
        if self._past_commit_point:
            return  # the journal owns the temporary files now; recovery finishes the commit
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None
            return
        for filename in self._written:
            discard_path(os.path.join(self.output, _tmp_name(self._token, filename)))
        discard_path(os.path.join(self.output, f"{JOURNAL}.{self._token}"))

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            if not self._committed:
                self.abort()
        finally:
            self._unlock()
        if isinstance(exc, OSError) and not isinstance(exc, ShardkitError):
            # Any I/O failure inside the transaction (a side file, a folder) gets the same clear line.
            raise _write_error(f"writing into {self.output}", exc) from exc


def output_folder(path: str) -> str:
    """The folder the output ``path`` (a file, or a checkpoint folder) goes into, which must exist: shardkit makes
    no folders above its output. The one check of every local write, and of a plan when it is written and when it runs.

    Raises:
        ShardkitWriteError: it does not exist.
    """
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ShardkitWriteError(f"{folder}: the folder the output goes into does not exist; create it first")
    return folder


def atomic_output_file(path: str, *, overwrite: bool = False) -> str:
    """A temporary path beside ``path`` for a single-file output; see :func:`publish_file`."""
    check_local(path, role="output")
    if os.path.exists(path) and not overwrite:
        raise OutputExistsError(f"{path} exists; pass ", Option("overwrite", True), " to replace it")
    if os.path.isdir(path):
        raise OutputExistsError(f"{path} is a folder; expected a file path")
    folder = output_folder(path)
    base = os.path.basename(path)
    for name in os.listdir(folder):  # temporaries of earlier, killed writes of this same file
        if name.startswith(TMP_MARK) and name.endswith(f"-{base}") and is_stale_tmp(name):
            remove_path(os.path.join(folder, name))
    return os.path.join(folder, f"{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}-{base}")


@contextlib.contextmanager
def file_transaction(path: str, *, overwrite: bool = False) -> Iterator[str]:
    """A temporary path to write a single-file output to; published onto ``path`` when the block succeeds.

    On any failure (or Ctrl-C) the temporary file is removed and ``path`` is left as it was.

    with file_transaction("merged.safetensors") as tmp:
        write_safetensors(tmp, writes, source)
    """
    tmp = atomic_output_file(path, overwrite=overwrite)
    try:
        yield tmp
        publish_file(tmp, path)
    except BaseException:
        discard_path(tmp)
        raise


def publish_file(tmp: str, path: str) -> None:
    """Rename a finished temporary file onto ``path`` durably."""
    _faults.point("commit:before-file-rename")
    try:
        os.replace(tmp, path)
    except OSError as e:
        raise _write_error(f"publishing {path}", e) from e
    _faults.point("commit:after-file-rename")
    fsync_dir(os.path.dirname(os.path.abspath(path)))
