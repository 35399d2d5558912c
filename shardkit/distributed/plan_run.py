"""Running a plan's tasks (:mod:`shardkit.distributed.plan_file`): any worker, any order, any number of times.

A task writes its shard into the plan's work folder, ``.<output>.shardkit-plan-<id>`` beside the
output: under a temporary name, fsynced, renamed onto the shard's name, then recorded as done
(``done/<task>.json``: the shard's manifest record, a one-file manifest). A done task is skipped
by one ``stat``; a shard killed half-written is only a temporary file, removed and redone. Tasks
hold a shared lock on the work folder while they run, so ``shardkit recover`` (which removes an
abandoned plan's work folder) never removes it under them.

Finalize checks every shard against the plan and its record (size, header crc32), then publishes
through the very job a single process runs (:func:`~shardkit.sharding.job.run_jobs`: side
files, edited configs, manifest, index last), the shards hard-linked from the work folder into
the transaction instead of written again; the work folder goes once the output is published. A
finalize killed after its commit is recognised by the shards' inodes and only cleans up. So
the output is byte-identical to a single-process write, whichever engine ran the tasks.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import secrets
from collections.abc import Mapping, Sequence

from .. import _faults
from ..atomic.commit import output_folder
from ..atomic.journal import TMP_MARK, fsync_dir, remove_path
from ..errors import InvalidInputError, Option, OutputExistsError, ShardkitWriteError
from ..formats.layout import is_pipeline_folder
from ..formats.manifest import FileDigest, dump_manifest, read_digests
from ..sharding.digest import ManifestRecorder
from ..sharding.flush import BackgroundSync, copy_side_file
from ..sharding.job import (
    ShardJob,
    ShardWriter,
    copied_names,
    open_settled,
    plan_job,
    refuse_output_inside_source,
    run_jobs,
    shard_metadata,
    side_files,
)
from ..sharding.options import WriteOptions, warn_if_output_taken
from ..sharding.outputs import JobOutput, LocalOutput
from ..sharding.single_file import is_file_output
from ..sharding.writer import write_safetensors
from ..sources.keymap import KeyMap
from ..stores.urls import is_store_url, parse_store_url
from ..units import ByteCounter, ProgressCallback
from . import plan_store
from .plan_file import ConversionPlan, PlanSpec, ShardTask, build_plan
from .plan_source import PlanRun, SourceOpener, adapter_files, job_source, local_source, opened_job
from .plan_work import (
    PUBLISHED,
    checked_records,
    done_name,
    local_done_tasks,
    remove_stale_tmp,
    remove_work,
    work_folder,
    work_lock,
    write_small,
)

__all__ = ["PUBLISHED", "PlanRun", "done_name", "done_tasks", "finalize", "is_done", "make_plan", "remove_stale_tmp",
           "remove_work", "run_tasks", "work_folder", "work_lock", "write_small"]

def is_done(plan: ConversionPlan, index: int) -> bool:
    """Whether task ``index`` finished (one ``stat``, or one ``HEAD`` in a store)."""
    return index in done_tasks(plan) if is_store_url(plan.spec.output) else \
        os.path.exists(os.path.join(work_folder(plan), done_name(plan.tasks[index])))


def done_tasks(plan: ConversionPlan) -> set[int]:
    """Every task recorded done (one listing)."""
    if is_store_url(plan.spec.output):
        return plan_store.done_tasks(plan)
    return local_done_tasks(plan)


def make_plan(command: str, source: str, output: str, *, options: WriteOptions, key: str | None = None,
              keymap: KeyMap | None = None, opener: SourceOpener = local_source, lora: Sequence[str] = (),
              lora_scale: float = 1.0, to: str | None = None) -> ConversionPlan:
    """Plan ``command`` (split or convert) of ``source`` into the folder or ``s3://`` prefix ``output``.

    Only headers are read. The options are the call's own :class:`WriteOptions` (less the
    callbacks and ``dry_run``: a plan is what would run). ``opener`` opens a source that is not a
    local path (an ``s3://`` prefix; see :mod:`.plan_source`). ``lora``: local adapters merged as ``convert``
    merges them (files known by size and mtime like a local source's).
    """
    source, output = _where(source, role="source"), _where(output, role="output")
    if to == "gguf":
        from .plan_gguf import make_gguf_plan

        return make_gguf_plan(PlanSpec(command, source, output, dataclasses.replace(options, dry_run=False, progress=None),
                                       key, keymap or KeyMap(), tuple(lora), float(lora_scale), to=to),
                              dry_run=options.dry_run)
    if to is not None:
        raise InvalidInputError(Option("to", to), ": a plan writes safetensors shards, or ", Option("to", "gguf"))
    if is_file_output(output):
        raise InvalidInputError(f"{source} -> {output}: a plan writes the shards of one model into a folder; "
                                "a single .safetensors output is written in one process")
    if "://" in source or "://" in output:
        if output.rstrip("/") == source.rstrip("/") or output.startswith(source.rstrip("/") + "/"):
            raise InvalidInputError(f"{output}: a plan writes a prefix outside its source {source}; reshard a bucket in "
                                    "place without ", Option("write_plan"))
    else:
        refuse_output_inside_source(source, output)
        if not options.dry_run:
            output_folder(output)  # as one process refuses it: never made, not when a task runs either
    spec = PlanSpec(command, source, output, dataclasses.replace(options, dry_run=False, progress=None), key,
                    keymap or KeyMap(), tuple(os.path.abspath(a) for a in lora), float(lora_scale))
    with opener(source) as opened:
        if is_pipeline_folder(opened.checkpoint):
            raise InvalidInputError(f"{source}: a plan writes the shards of one model; a pipeline folder is written "
                                    "in one process")
        with open_settled(opened.checkpoint, key=key, dry_run=True, output=output) as inner:
            job = plan_job(job_source(inner, spec), options=spec.options)
            copies = side_files(opened.checkpoint, output)
            plan = build_plan(spec, job, side_files=copied_names(copies), side_paths=[path for path, _ in copies],
                              name_of=opened.name_of, identity=opened.identity, local_files=adapter_files(spec))
    if is_store_url(output):
        plan_store.refuse_taken_prefix(plan, dry_run=options.dry_run)
    else:
        _refuse_taken_output(plan, dry_run=options.dry_run)
    return plan


def _where(path: str, *, role: str) -> str:
    """A local path made absolute; an ``s3://`` URL as the store writes it; any other scheme refused."""
    if "://" not in path:
        return os.path.abspath(path)
    if not is_store_url(path):
        raise InvalidInputError(f"{path}: a plan's {role} is a local path or s3://BUCKET/PREFIX; convert an hf:// "
                                "source without ", Option("write_plan"), ", or download it first")
    return str(parse_store_url(path))


def _refuse_taken_output(plan: ConversionPlan, *, dry_run: bool) -> None:
    """A plan whose finalize would refuse its output is refused before any task runs (a dry run warns),
    unless the plan already ran there (a resume after its publish, killed before the cleanup, or done)."""
    output = plan.spec.output
    if plan.spec.options.overwrite or not (os.path.isdir(output) and os.listdir(output)):
        return
    if dry_run:
        warn_if_output_taken(output, overwrite=False)
    elif not os.path.isdir(work_folder(plan)) and not published_here(plan):
        raise OutputExistsError(f"{output} exists and is not empty; pass ", Option("overwrite", True),
                                " to replace its checkpoint")


def run_tasks(plan: ConversionPlan, indexes: Sequence[int], *, progress: ProgressCallback | None = None,
              opener: SourceOpener = local_source) -> PlanRun:
    """Run the tasks ``indexes`` that are not done yet (the source opened once for all of them)."""
    for i in indexes:
        if not 0 <= i < len(plan.tasks):
            raise InvalidInputError(Option("task", i), f": the plan has tasks 0 to {len(plan.tasks) - 1}")
    if plan.spec.to == "gguf":
        from . import plan_gguf

        return plan_gguf.run_tasks(plan, indexes, progress=progress)
    if is_store_url(plan.spec.output):
        return plan_store.run_tasks(plan, indexes, progress=progress, opener=opener)
    run = PlanRun(plan.plan_id, plan.spec.output, [], [])
    if published_here(plan):  # every task's shard is in the published output: each is done
        run.skipped = list(indexes)
        return run
    with work_lock(plan) as work:
        pending = [i for i in indexes if not os.path.exists(os.path.join(work, done_name(plan.tasks[i])))]
        run.skipped = [i for i in indexes if i not in set(pending)]
        if not pending:
            return run
        total = sum(plan.tasks[i].size_bytes for i in pending)
        with opened_job(plan, opener) as (job, _, _):
            tick = ByteCounter(total, progress)
            for i in pending:
                _write_task(plan, job, plan.tasks[i], work, tick)
                run.written.append(i)
    return run


def _write_task(plan: ConversionPlan, job: ShardJob, task: ShardTask, work: str, tick: ByteCounter) -> None:
    """Write one shard into ``work`` (temporary name, fsync, rename), then its done record."""
    remove_stale_tmp(work, task.output)
    shard = job.plan.shards[task.index]
    by_name = {w.out.name: w for w in job.writes}
    writes = [by_name[n] for n in shard.names]
    tmp = os.path.join(work, f"{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}-{task.output}")
    try:
        written = write_safetensors(tmp, writes, job.source, metadata=shard_metadata(job, plan.spec.options.metadata or {}),
                                    progress=tick)
        if written.file_bytes != task.size_bytes:
            raise ShardkitWriteError(f"{task.output}: wrote {written.file_bytes} bytes, the plan says {task.size_bytes}; "
                                     "nothing was published: report this")
        with ManifestRecorder(work, stale=[], enabled=plan.spec.options.manifest) as record:
            record.shard(task.output, tmp, writes, known=written.crc32s, source=job.source)
            digest = record.results().get(task.output) or _header_digest(tmp, written.file_bytes)
        os.rename(tmp, os.path.join(work, task.output))
        fsync_dir(work)
        _faults.point("plan:shard-renamed")
        write_small(work, done_name(task), dump_manifest({task.output: digest}))
    except BaseException:
        remove_path(tmp)
        raise
    _faults.point("plan:task-done")


def _header_digest(path: str, size_bytes: int) -> FileDigest:
    """The record of a shard without a manifest: its size and header region's crc32 only."""
    from ..formats.header import read_header

    data_start = read_header(path).data_start
    _, crcs, _ = read_digests(path, [("", 0, data_start)], sha256=False)
    return FileDigest(size_bytes, None, data_start, crcs[0], {})


def _published(plan: ConversionPlan, work: str) -> bool:
    """Whether a finalize already published this plan (killed before its cleanup): the output's
    shards are the work folder's own files (hard links)."""
    if os.path.exists(os.path.join(work, PUBLISHED)):
        return True
    try:
        return all(os.path.samefile(os.path.join(work, t.output), os.path.join(plan.spec.output, t.output))
                   for t in plan.tasks)
    except OSError:
        return False


def published_here(plan: ConversionPlan) -> bool:
    """Whether the output already holds this plan, published and cleaned up (its work folder gone): the manifest
    naming every shard at its planned size, each shard that size with the plan's tensor count and cast dtypes. Then
    a task or finalize run again does nothing, as a store's finalize only cleans up. Without a manifest nothing
    says whose shards they are: False (a finalize then asks for the tasks again)."""
    from collections import Counter

    from ..errors import HeaderError
    from ..formats.header import read_header
    from ..formats.links import read_inside
    from ..formats.manifest import MANIFEST_NAME, ManifestError, parse_manifest

    out = plan.spec.output
    if not plan.spec.options.manifest or os.path.isdir(work_folder(plan)) or not os.path.isdir(out):
        return False
    try:
        files = parse_manifest(read_inside(out, MANIFEST_NAME, where=out), path=os.path.join(out, MANIFEST_NAME)).files
        for t in plan.tasks:
            path = os.path.join(out, t.output)
            if t.output not in files or not files[t.output].size_bytes == os.path.getsize(path) == t.size_bytes:
                return False
            entries = read_header(path).entries
            dtypes = Counter(e.dtype for e in entries)
            if len(entries) != t.tensors or any(dtypes[cast.split("->")[1]] < n for cast, n in t.casts):
                return False
    except (OSError, ManifestError, HeaderError):
        return False
    return True


def finalize(plan: ConversionPlan, *, opener: SourceOpener = local_source) -> PlanRun:
    """Check every shard, then publish the output (side files, manifest, index last); remove the work folder."""
    if plan.spec.to == "gguf":
        from . import plan_gguf

        return plan_gguf.finalize(plan)
    if is_store_url(plan.spec.output):
        return plan_store.finalize(plan, opener=opener)
    run = PlanRun(plan.plan_id, plan.spec.output, [], [], published=True)
    if published_here(plan):  # finalized before (by another worker, or a run now repeated): nothing left to do
        return run
    with work_lock(plan) as work:
        if not _published(plan, work):
            records = checked_records(plan, work)
            with opened_job(plan, opener) as (job, copies, _):
                run_jobs(plan.spec.output, [job], options=plan.spec.options, side_files=copies,
                         shards=_adopt(work, records))
            _faults.point("plan:published")
            write_small(work, PUBLISHED, b"")
    remove_work(work)
    return run


def _adopt(work: str, records: Mapping[str, FileDigest]) -> ShardWriter:
    """The ``shards=`` of :func:`run_jobs`: each shard hard-linked from ``work`` (copied where the
    filesystem cannot link) and its record handed to the manifest."""

    def adopt(job: ShardJob, out: JobOutput, metadata: Mapping[str, str], tick: ByteCounter) -> None:
        if not isinstance(out, LocalOutput):
            raise ShardkitWriteError(f"{work}: a plan publishes into a local folder; nothing was published")
        for shard in job.plan.shards:
            name = job.path(shard.filename)
            dst = out.tx.path_for(name)
            _link_or_copy(os.path.join(work, name), dst, sync=out.sync)
            out.record.add(name, records[name])
            tick(records[name].size_bytes)

    return adopt


def _link_or_copy(src: str, dst: str, *, sync: BackgroundSync) -> None:
    try:
        os.link(src, dst)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
        copy_side_file(src, dst, sync=sync)
