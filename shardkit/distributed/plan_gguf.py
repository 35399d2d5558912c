"""A plan whose output is a GGUF (``convert --to gguf --write-plan``): one task per file the writer makes.

The files are those of :func:`~shardkit.sharding.gguf_out.convert_to_gguf`: one ``NAME.gguf``, or with
``max_shard_size`` llama.cpp's gguf-split parts ``NAME-0000K-of-0000N.gguf``. The plan holds each file's
name, exact size and header crc32 (the header is known when planning: metadata, vocabulary, tensor
infos), its source byte ranges and casts. A task writes its file into the plan's work folder beside the
output (temporary name, fsync, rename) and records it done; finalize checks every file (size, header
crc32 against the record and the plan) and publishes each by a link, the first file (a split's index)
last: the same bytes as one process.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import zlib
from collections.abc import Iterator, Sequence

from .. import _faults
from ..atomic.commit import file_transaction, output_folder
from ..atomic.journal import TMP_MARK, fsync_dir, remove_path
from ..errors import InvalidInputError, Option, OutputExistsError, ShardkitWriteError, describe_os_error
from ..formats.gguf import ggml_type, padded, tensor_nbytes_ggml
from ..formats.manifest import FileDigest, dump_manifest
from ..sharding.gguf_bytes import PlannedTensor, write_gguf_file
from ..sharding.gguf_out import GgufJob, open_gguf_job
from ..sharding.gguf_split import GgufFiles
from ..sharding.options import warn
from ..units import ByteCounter, ProgressCallback
from . import plan_work
from .plan_file import ConversionPlan, PlanSpec, Read, ShardTask, source_identity
from .plan_source import OpenedSource, PlanRun, check_sources

__all__ = ["finalize", "make_gguf_plan", "run_tasks"]


@contextlib.contextmanager
def _opened(spec: PlanSpec) -> Iterator[GgufJob]:
    with open_gguf_job(spec.source, spec.output, options=spec.options, quantize=spec.options.quantize) as job:
        yield job


def gguf_tasks(files: GgufFiles) -> tuple[ShardTask, ...]:
    """One :class:`ShardTask` per file: its source ranges (coalesced), casts, exact size and header crc32."""
    tasks = []
    for i, (name, head, part) in enumerate(files):
        size_bytes = len(head) + sum(_tensor_bytes(t) for t in part)
        casts: dict[str, int] = {}
        for t in part:
            kind = f"{t.entry.dtype}->{t.kind}" if t.data is None else f"computed->{t.kind}"
            if t.data is not None or t.entry.dtype != t.kind:
                casts[kind] = casts.get(kind, 0) + 1
        tasks.append(ShardTask(i, name, size_bytes, len(part), _reads(part), tuple(sorted(casts.items())),
                               f"{zlib.crc32(head):08x}"))
    return tuple(tasks)


def _tensor_bytes(t: PlannedTensor) -> int:
    return padded(tensor_nbytes_ggml(ggml_type(t.kind), tuple(reversed(t.entry.shape))))


def _reads(part: Sequence[PlannedTensor]) -> tuple[Read, ...]:
    reads: list[Read] = []
    for entry in (e for t in part if t.data is None for e in (t.parts or (t.entry,))):
        if not entry.file:
            continue
        if reads and reads[-1][0] == entry.file and reads[-1][2] == entry.offset:
            reads[-1] = (entry.file, reads[-1][1], entry.offset + entry.nbytes)
        else:
            reads.append((entry.file, entry.offset, entry.offset + entry.nbytes))
    return tuple(reads)


def _read_files(job: GgufJob) -> list[str]:
    """The files the job reads: every tensor's, the source's own, and the config and tokenizer files beside them."""
    files = {e.file for e in job.src.entries() if e.file} | set(job.src.paths)
    folders = {os.path.dirname(f) for f in files}
    for folder in folders:
        files |= {os.path.join(folder, n) for n in os.listdir(folder)
                  if n.endswith((".json", ".model", ".txt")) and os.path.isfile(os.path.join(folder, n))}
    return sorted(files)


def make_gguf_plan(spec: PlanSpec, *, dry_run: bool = False) -> ConversionPlan:
    """The plan of ``convert(source, output, to='gguf')`` into the local ``output`` (a ``.gguf`` path)."""
    if "://" in spec.source or "://" in spec.output:
        raise InvalidInputError(f"{spec.source} -> {spec.output}: a plan with ", Option("to", "gguf"),
                                " reads a local model and "
                                "writes a local .gguf; convert a store's model without ", Option("write_plan"))
    if spec.lora or spec.key is not None or not spec.keymap.is_identity():
        raise InvalidInputError(Option("key"), ", ", Option("lora"),
                                " and the key options do not apply to a plan with ", Option("to", "gguf"), ": "
                                "merge first, then plan the merged folder's conversion")
    with _opened(spec) as job:
        tasks = gguf_tasks(job.files)
        plan = ConversionPlan(spec, source_identity(_read_files(job)), tasks, None, (), job.plan.total_bytes)
        note = job.model.note
    folder = os.path.dirname(spec.output) if dry_run else output_folder(spec.output)  # as one process: never made
    taken = [t.output for t in tasks if os.path.exists(os.path.join(folder, t.output))]
    if taken and not spec.options.overwrite and not os.path.isdir(plan_work.work_folder(plan)):
        if dry_run:
            warn(f"{os.path.join(folder, taken[0])} exists: the real run needs ", Option("overwrite", True))
        else:
            raise OutputExistsError(f"{os.path.join(folder, taken[0])} exists; pass ", Option("overwrite", True),
                                    " to replace it")
    if note:
        warn(note)  # what the file will lack, as a single process says
    return plan


@contextlib.contextmanager
def _checked_job(plan: ConversionPlan) -> Iterator[GgufJob]:
    """The plan's job, planned again: refused unless the source and the files are the plan's."""
    check_sources(plan, OpenedSource(plan.spec.source))  # before a tensor byte is read
    with _opened(plan.spec) as job:
        if gguf_tasks(job.files) != plan.tasks:
            raise InvalidInputError(f"{plan.spec.source}: planned again, it does not give the plan's files (the "
                                    "source or shardkit changed); nothing was written: write the plan again")
        yield job


def run_tasks(plan: ConversionPlan, indexes: Sequence[int], *, progress: ProgressCallback | None) -> PlanRun:
    """Write the files ``indexes`` not recorded done (the source opened once for all of them)."""
    run = PlanRun(plan.plan_id, plan.spec.output, [], [])
    output_folder(plan.spec.output)  # removed since the plan was written: refused, not made by the work folder
    with plan_work.work_lock(plan) as work:
        done = plan_work.local_done_tasks(plan)
        pending = [i for i in indexes if i not in done]
        run.skipped = [i for i in indexes if i in done]
        if not pending:
            return run
        with _checked_job(plan) as job:
            tick = ByteCounter(sum(plan.tasks[i].size_bytes for i in pending), progress)
            for i in pending:
                _write_task(job, plan.tasks[i], work, tick)
                run.written.append(i)
    return run


def _write_task(job: GgufJob, task: ShardTask, work: str, tick: ByteCounter) -> None:
    """One file into ``work`` (temporary name, fsync, rename), then its done record."""
    plan_work.remove_stale_tmp(work, task.output)
    _, head, part = job.files[task.index]
    tmp = os.path.join(work, f"{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}-{task.output}")
    done = 0

    def step(written: int, _total: int) -> None:
        nonlocal done
        tick(written - done)
        done = written

    try:
        write_gguf_file(tmp, head, part, job.src, progress=step)
        size_bytes = os.path.getsize(tmp)
        if size_bytes != task.size_bytes:
            raise ShardkitWriteError(f"{task.output}: wrote {size_bytes} bytes, the plan says {task.size_bytes}; "
                                     "nothing was published: report this")
        os.rename(tmp, os.path.join(work, task.output))
        fsync_dir(work)
    except OSError as e:
        remove_path(tmp)
        raise ShardkitWriteError(f"{tmp}: writing {task.output} failed: {describe_os_error(e)}") from e
    except BaseException:
        remove_path(tmp)
        raise
    _faults.point("plan:shard-renamed")
    record = FileDigest(task.size_bytes, None, len(head), task.header_crc32, {})
    plan_work.write_small(work, plan_work.done_name(task), dump_manifest({task.output: record}))
    _faults.point("plan:task-done")


def _is_published(work: str, dst: str, name: str) -> bool:
    try:
        return os.path.samefile(os.path.join(work, name), dst)
    except OSError:
        return False


def finalize(plan: ConversionPlan) -> PlanRun:
    """Check every file, publish them (the first last), then remove the work folder."""
    run = PlanRun(plan.plan_id, plan.spec.output, [], [], published=True)
    folder = os.path.dirname(plan.spec.output)
    with plan_work.work_lock(plan) as work:
        if not os.path.exists(os.path.join(work, plan_work.PUBLISHED)):
            plan_work.checked_records(plan, work)
            with contextlib.ExitStack() as stack:  # left in reverse: the first file (a split's index) last
                for t in plan.tasks:
                    dst = os.path.join(folder, t.output)
                    if _is_published(work, dst, t.output):
                        continue  # a finalize killed mid-publish had published it
                    tmp = stack.enter_context(file_transaction(dst, overwrite=plan.spec.options.overwrite))
                    _link_or_copy(os.path.join(work, t.output), tmp)
            _faults.point("plan:published")
            plan_work.write_small(work, plan_work.PUBLISHED, b"")
    plan_work.remove_work(work)
    return run


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)  # a filesystem without hard links (the work folder is beside the output)

