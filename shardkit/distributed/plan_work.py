"""A local plan's work folder, shared by its safetensors and its GGUF tasks (:mod:`.plan_run`, :mod:`.plan_gguf`).

``.OUTPUT.shardkit-plan-ID/`` beside the output: each task's file, its done record (``done/NNNNN.json``),
and once published the ``published`` marker. Tasks hold it share-locked (``recover`` leaves it alone), write
small records atomically, and a published plan's folder is renamed before it is removed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from ..atomic.commit import output_folder
from ..atomic.journal import PLAN_MARK, TMP_MARK, fsync_dir, is_stale_tmp, remove_path, try_lock
from ..errors import InvalidInputError, Option, ShardkitWriteError, describe_os_error
from ..formats.links import read_inside, write_fd
from ..formats.manifest import FileDigest, ManifestError, parse_manifest, read_digests
from .plan_file import ConversionPlan, ShardTask

__all__ = ["PUBLISHED", "checked_records", "done_name", "local_done_tasks", "remove_stale_tmp", "remove_work", "work_folder", "work_lock",
           "write_small"]

PUBLISHED = "published"  # written into the work folder once the output is published: only cleanup is left


def work_folder(plan: ConversionPlan) -> str:
    """Where the plan's tasks put their shards: beside the output, named by the plan's digest."""
    parent, base = os.path.split(os.path.abspath(plan.spec.output))
    return os.path.join(parent, f".{base}{PLAN_MARK}{plan.plan_id}")


def done_name(task: ShardTask) -> str:
    return f"done/{task.index:05d}.json"


@contextlib.contextmanager
def work_lock(plan: ConversionPlan) -> Iterator[str]:
    """The work folder (made if missing), share-locked for the block: recover leaves it alone meanwhile.

    Raises:
        ShardkitWriteError: the folder the output goes into is gone (never made: one process refuses it too), or the
            work folder cannot be made.
    """
    work = work_folder(plan)
    output_folder(plan.spec.output)
    try:
        for folder in (work, os.path.join(work, "done")):  # never a folder above: the output's own stays refused
            with contextlib.suppress(FileExistsError):
                os.mkdir(folder)
        fd = try_lock(work, shared=True)
    except OSError as e:
        raise ShardkitWriteError(f"{work}: cannot make the plan's work folder: {describe_os_error(e)}") from e
    if fd is None:
        raise ShardkitWriteError(f"{work} is being removed by `shardkit recover`; run the task again when it is done")
    try:
        yield work
    finally:
        os.close(fd)


def remove_stale_tmp(work: str, name: str) -> None:
    """Temporary files of this shard left by a killed task (its pid gone)."""
    for entry in os.listdir(work):
        if entry.startswith(TMP_MARK) and entry.endswith(f"-{name}") and is_stale_tmp(entry):
            remove_path(os.path.join(work, entry))


def write_small(work: str, name: str, data: bytes) -> None:
    path = os.path.join(work, name)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            write_fd(fd, data, path=tmp)  # bookkeeping, not output: no fault points
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path))
    except OSError as e:
        remove_path(tmp)
        raise ShardkitWriteError(f"recording {path} failed: {describe_os_error(e)}") from e


def remove_work(work: str) -> None:
    """The work folder of a published plan, gone (renamed first: a kill mid-removal never leaves a half one)."""
    gone = f"{work}-published"
    remove_path(gone)  # an earlier run's, killed mid-removal
    os.replace(work, gone)
    remove_path(gone)


def local_done_tasks(plan: ConversionPlan) -> set[int]:
    """Every task recorded done in the local work folder (one listing)."""
    work = work_folder(plan)
    found = set(os.listdir(os.path.join(work, "done"))) if os.path.isdir(work) else set()
    return {t.index for t in plan.tasks if os.path.basename(done_name(t)) in found}


def checked_records(plan: ConversionPlan, work: str) -> dict[str, FileDigest]:
    """Every task's done record, by output name, each file checked against it and the plan (size, header
    crc32; the plan's own crc32 too where it knows one, as a GGUF plan does).

    Raises:
        InvalidInputError: a task not done, or its file or record unreadable or not what it recorded.
    """
    missing = [t.index for t in plan.tasks if not os.path.exists(os.path.join(work, done_name(t)))]
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        raise InvalidInputError(f"{plan.spec.output}: {len(missing)} task(s) not done ({shown}); run them "
                                "(shardkit.run_plan(plan, task=N), or every one with no task) before ",
                                Option("finalize", True))
    records: dict[str, FileDigest] = {}
    for t in plan.tasks:
        name = done_name(t)
        try:
            record = parse_manifest(read_inside(work, name, where=work), path=os.path.join(work, name)).files[t.output]
            size_bytes = os.path.getsize(os.path.join(work, t.output))
            _, crcs, _ = read_digests(os.path.join(work, t.output), [("", 0, record.data_start or 0)], sha256=False)
        except (OSError, ManifestError, KeyError) as e:
            raise InvalidInputError(f"{work}: task {t.index}'s file or record is unreadable ({e}); delete {name} "
                                    "and run the task again") from e
        if not size_bytes == record.size_bytes == t.size_bytes or crcs[0] != record.header_crc32 or \
                t.header_crc32 not in (None, crcs[0]):
            raise InvalidInputError(f"{work}/{t.output}: not the file task {t.index} recorded (size {size_bytes}, "
                                    f"plan {t.size_bytes}); delete {name} and run the task again")
        records[t.output] = record
    return records
