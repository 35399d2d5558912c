"""A plan whose output is an ``s3://BUCKET/PREFIX``: each task its own multipart upload, finalize publishes last.

The store has no rename, so a task uploads its shard under the shard's own name, streamed
(:func:`~shardkit.sharding.stream_writer.stream_safetensors`: the bytes of a local write, no local
copy, bounded memory), and then records it done: ``.shardkit-plan-<id>/done/<task>.json`` under
the prefix, the shard's manifest record. A done task is skipped by one listing (or one ``HEAD``);
a task killed mid-upload left only an open multipart upload (a task that fails aborts its own),
and is redone. No reader sees the shards as a checkpoint before the index names them.

Before its first upload a task puts the plan's journal (``.shardkit-write-plan-<id>.json``, read by
``shardkit recover s3://...`` like any write journal): it names every shard and record of the plan,
so recover aborts the uploads of an abandoned plan and deletes what it left unpublished.

Finalize lists the prefix once, checks each shard against the plan and its record (the listed size,
the crc32 of its header region read back by range), aborts the multipart uploads that killed tasks
left, then publishes through the store transaction every store write uses (side files, manifest,
the index last): byte-identical to a single-process write into the store. Then it removes the
records and the journal.

Fault points: ``store:sent:NAME:BYTES`` at each write into an upload (with its byte count),
``plan:shard-uploaded`` (the shard is complete, not yet recorded), ``plan:task-done``,
``store:put:NAME`` at the publish, ``plan:published``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import zlib
from collections.abc import Iterator, Mapping, Sequence

from .. import _faults
from ..atomic.journal import PLAN_MARK
from ..errors import InvalidInputError, Option, OutputExistsError, ShardkitWriteError, SourceNotFoundError, parts_of
from ..formats.manifest import MANIFEST_NAME, FileDigest, ManifestError, dump_manifest, parse_manifest
from ..sharding.digest import ManifestRecorder
from ..sharding.flush import ByteCounter
from ..sharding.job import ShardJob, ShardWriter, SideFile, run_jobs, shard_metadata
from ..sharding.options import warn
from ..sharding.outputs import JobOutput, OutputOpener, OutputPlan, bind_output
from ..sharding.store_output import SOURCE_CHUNK_BYTES, StoreOutput
from ..sharding.stream_writer import stream_safetensors
from ..stores import ObjectInfo, ObjectStore, ObjectWriter, RangeRequest, open_store, read_ranges
from ..stores.transaction import JOURNAL_PREFIX, StoreTransaction, index_names
from ..units import ProgressCallback
from .plan_file import ConversionPlan, ShardTask
from .plan_source import PlanRun, SourceOpener, local_source, opened_job

__all__ = ["done_tasks", "finalize", "journal_name", "refuse_taken_prefix", "run_tasks", "work_prefix"]

MAX_RECORD_BYTES = 64 << 20  # a done record lists one shard's tensors: far below
MAX_HEADER_BYTES = (100 << 20) + 8  # safetensors' own bound on a header region


def work_prefix(plan: ConversionPlan) -> str:
    """The folder under the output prefix where the plan's tasks record what they finished."""
    return f"{PLAN_MARK}{plan.plan_id}"


def journal_name(plan: ConversionPlan) -> str:
    """The plan's write journal under the output prefix (what ``recover`` reads)."""
    return f"{JOURNAL_PREFIX}plan-{plan.plan_id}.json"


def _done_name(plan: ConversionPlan, task: ShardTask) -> str:
    return f"{work_prefix(plan)}/done/{task.index:05d}.json"


def _marker(plan: ConversionPlan) -> str:
    return f"{work_prefix(plan)}/published"


def _side_names(plan: ConversionPlan) -> list[str]:
    """Every name the publish puts besides the shards: side files, manifest, index."""
    return [*plan.side_files, *([MANIFEST_NAME] if plan.spec.options.manifest else []),
            *([plan.index] if plan.index else [])]


def done_tasks(plan: ConversionPlan, store: ObjectStore | None = None) -> set[int]:
    """The tasks recorded done (one listing of the records' folder)."""
    if store is None:
        with open_store(plan.spec.output) as opened:
            return done_tasks(plan, opened)
    found = {o.name for o in store.list_objects(f"{work_prefix(plan)}/done")}
    return {t.index for t in plan.tasks if _done_name(plan, t) in found}


def refuse_taken_prefix(plan: ConversionPlan, *, dry_run: bool) -> None:
    """Refuse a plan into a prefix that holds objects (without ``overwrite``) or objects of the plan's names
    (a store cannot replace them atomically), unless the plan already ran there (its journal is there)."""
    with open_store(plan.spec.output) as store:
        existing = {o.name for o in store.list_objects()}
    if not existing or journal_name(plan) in existing:
        return
    if dry_run:  # a dry run warns, as for a local folder
        if not plan.spec.options.overwrite:
            warn(f"{plan.spec.output}: the prefix already holds {len(existing)} object(s); running this plan needs ",
                 Option("overwrite", True))
        return
    if not plan.spec.options.overwrite:
        raise OutputExistsError(f"{plan.spec.output}: the prefix already holds {len(existing)} object(s); pass ",
                                Option("overwrite", True), " to replace the checkpoint there")
    clash = sorted(n for n in [t.output for t in plan.tasks] + list(plan.side_files)
                   if n in existing and not n.endswith(".json"))
    if clash:
        raise InvalidInputError(f"{plan.spec.output}/{clash[0]}: an object of that name exists; a store without rename "
                                "cannot replace it atomically: write to a new prefix, or delete the old checkpoint first")


class _Sink:
    """The upload of one shard, each write a fault point carrying its byte count."""

    def __init__(self, writer: ObjectWriter, name: str) -> None:
        self.writer, self.label, self.size_bytes = writer, f"store:sent:{name}:", 0

    def write(self, data: bytes | memoryview) -> None:
        self.writer.write(data)
        nbytes = memoryview(data).nbytes
        self.size_bytes += nbytes
        if _faults.ACTIVE:
            _faults.point(f"{self.label}{self.size_bytes}", nbytes)


def run_tasks(plan: ConversionPlan, indexes: Sequence[int], *, progress: ProgressCallback | None = None,
              opener: SourceOpener = local_source) -> PlanRun:
    """Run the tasks ``indexes`` not recorded done, each shard its own multipart upload into the prefix."""
    run = PlanRun(plan.plan_id, plan.spec.output, [], [])
    with open_store(plan.spec.output) as store:
        done = done_tasks(plan, store)
        pending = [i for i in indexes if i not in done]
        run.skipped = [i for i in indexes if i in done]
        if not pending:
            return run
        with opened_job(plan, opener) as (job, _, _):  # a changed source is refused before anything is written
            _put_journal(store, plan)  # before the first upload: recover finds every upload of the plan
            tick = ByteCounter(sum(plan.tasks[i].size_bytes for i in pending), progress)
            for i in pending:
                _write_task(store, plan, job, plan.tasks[i], tick)
                run.written.append(i)
    return run


def _put_journal(store: ObjectStore, plan: ConversionPlan) -> None:
    try:
        store.stat(journal_name(plan))
    except SourceNotFoundError:
        created = [t.output for t in plan.tasks] + [_done_name(plan, t) for t in plan.tasks] + [_marker(plan)]
        store.put(journal_name(plan), json.dumps({"created": created, "stale": [], "held": []}).encode())


def _write_task(store: ObjectStore, plan: ConversionPlan, job: ShardJob, task: ShardTask, tick: ByteCounter) -> None:
    """Upload one shard (aborted on any error), then record it done."""
    by_name = {w.out.name: w for w in job.writes}
    writes = [by_name[n] for n in job.plan.shards[task.index].names]
    with store.writer(task.output) as writer:
        sink = _Sink(writer, task.output)
        streamed = stream_safetensors(sink, task.output, writes, job.source, progress=tick,
                                      metadata=shard_metadata(job, plan.spec.options.metadata or {}),
                                      chunk_bytes=SOURCE_CHUNK_BYTES)
        if streamed.file_bytes != task.size_bytes:
            raise ShardkitWriteError(f"{task.output}: wrote {streamed.file_bytes} bytes, the plan says "
                                     f"{task.size_bytes}; nothing was published: report this")
        writer.commit()
    _faults.point("plan:shard-uploaded")
    _refuse_gone_plan(store, plan, task)
    store.put(_done_name(plan, task), dump_manifest({task.output: streamed.digest}))
    _faults.point("plan:task-done")


def _refuse_gone_plan(store: ObjectStore, plan: ConversionPlan, task: ShardTask) -> None:
    """Refuse to record a task once the journal it put is gone (one ``HEAD``): another process finalized the plan
    (or recover removed it) meanwhile, and a record now would stay in the published prefix."""
    try:
        store.stat(journal_name(plan))
    except SourceNotFoundError as e:
        raise InvalidInputError(
            f"{plan.spec.output}: the plan was published (or removed by recover) by another process while task "
            f"{task.index} ran; {task.output} was uploaded again, not recorded: a run with no task runs every task and "
            "publishes, so give each worker ", Option("task"), ", then ", Option("finalize", True),
                                " once all are done") from e


def finalize(plan: ConversionPlan, *, opener: SourceOpener = local_source) -> PlanRun:
    """Check every shard, publish (side files, manifest, the index last), then remove the records and journal."""
    run = PlanRun(plan.plan_id, plan.spec.output, [], [], published=True)
    with open_store(plan.spec.output) as store:
        listed = {o.name: o for o in store.list_objects()}
        if not _published(store, plan, listed):
            records = _records(store, plan, listed)
            _refuse_others(plan, listed)
            _clear_leftovers(store, plan, listed)
            with opened_job(plan, opener) as (job, copies, _):
                _publish(store, plan, job, copies, records)
            _faults.point("plan:published")
            store.put(_marker(plan), b"")
        work = [n for n in listed if n.startswith(f"{work_prefix(plan)}/")]
        store.delete(sorted(set(work) - {_marker(plan)}))
        store.delete([_marker(plan)])
        store.delete([journal_name(plan)])  # last: until here recover still knows the plan
    return run


def _published(store: ObjectStore, plan: ConversionPlan, listed: Mapping[str, ObjectInfo]) -> bool:
    """Whether a finalize already published this plan (killed before its cleanup, or done): its marker, a live
    index naming exactly the plan's shards, or, a plan without an index (one shard), no record left (the cleanup had
    begun), every shard at its planned size and every name the publish puts, the manifest naming each shard at that
    size (without a manifest: the journal gone, the cleanup over). A second finalize then only cleans up."""
    if _marker(plan) in listed:
        return True
    if plan.index is not None:
        return plan.index in listed and index_names(store, listed[plan.index]) == {t.output for t in plan.tasks}
    if any(n.startswith(f"{work_prefix(plan)}/done/") for n in listed) or \
            any(t.output not in listed or listed[t.output].size_bytes != t.size_bytes for t in plan.tasks) or \
            any(n not in listed for n in _side_names(plan)):
        return False
    if not plan.spec.options.manifest:  # nothing to read back: only once the cleanup is over (the journal gone)
        return journal_name(plan) not in listed
    data = _read_whole(store, [listed[MANIFEST_NAME]], bound=MAX_RECORD_BYTES)[0]
    try:
        files = parse_manifest(bytes(data), path=f"{plan.spec.output}/{MANIFEST_NAME}").files
    except ManifestError:
        return False  # not the manifest the publish put: not published
    return all(t.output in files and files[t.output].size_bytes == t.size_bytes for t in plan.tasks)


def _records(store: ObjectStore, plan: ConversionPlan, listed: Mapping[str, ObjectInfo]) -> dict[str, FileDigest]:
    """Every task's record, each shard checked against it and the plan (listed size, header crc32)."""
    missing = [t.index for t in plan.tasks if _done_name(plan, t) not in listed]
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        raise InvalidInputError(f"{plan.spec.output}: {len(missing)} task(s) not done ({shown}); run them "
                                "(shardkit.run_plan(plan, task=N), or every one with no task) before ",
                                Option("finalize", True))
    names = [_done_name(plan, t) for t in plan.tasks]
    raw = _read_whole(store, [listed[n] for n in names], bound=MAX_RECORD_BYTES)
    records: dict[str, FileDigest] = {}
    for t, name, data in zip(plan.tasks, names, raw, strict=True):
        try:
            records[t.output] = parse_manifest(bytes(data), path=f"{plan.spec.output}/{name}").files[t.output]
        except (ManifestError, KeyError) as e:
            raise InvalidInputError(f"{plan.spec.output}/{name}: task {t.index}'s record is unreadable (", *parts_of(e),
                                    "); delete it and run the task again") from e
    heads = [bytearray(min(records[t.output].data_start or 0, MAX_HEADER_BYTES)) for t in plan.tasks]
    sizes = [listed[t.output].size_bytes if t.output in listed else None for t in plan.tasks]
    read_ranges(store, [RangeRequest(t.output, 0, memoryview(h)) for t, h, n in zip(plan.tasks, heads, sizes, strict=True)
                        if n is not None and len(h) <= n])
    for t, head, size in zip(plan.tasks, heads, sizes, strict=True):
        record = records[t.output]
        if not size == record.size_bytes == t.size_bytes or f"{zlib.crc32(head):08x}" != record.header_crc32:
            raise InvalidInputError(f"{plan.spec.output}/{t.output}: not the shard task {t.index} recorded (size "
                                    f"{size}, plan {t.size_bytes}); delete {_done_name(plan, t)} and run the task again")
    return records


def _read_whole(store: ObjectStore, infos: Sequence[ObjectInfo], *, bound: int) -> list[bytearray]:
    """Small objects, read in parallel (each at most ``bound`` bytes)."""
    for info in infos:
        if info.size_bytes > bound:
            raise InvalidInputError(f"{store.url.child(info.name)}: {info.size_bytes} bytes is no plan record")
    out = [bytearray(info.size_bytes) for info in infos]
    read_ranges(store, [RangeRequest(i.name, 0, memoryview(b)) for i, b in zip(infos, out, strict=True)])
    return out


def _refuse_others(plan: ConversionPlan, listed: Mapping[str, ObjectInfo]) -> None:
    """Without ``overwrite``, the prefix holds nothing but what this plan wrote (its shards, records,
    journal, and what a finalize killed mid-publish put)."""
    if plan.spec.options.overwrite:
        return
    ours = {t.output for t in plan.tasks} | set(_side_names(plan))
    others = sorted(n for n in listed if n not in ours and not n.startswith(f"{work_prefix(plan)}/")
                    and not os.path.basename(n).startswith(JOURNAL_PREFIX))
    if others:
        raise OutputExistsError(f"{plan.spec.output}: {others[0]} appeared in the prefix while the plan ran; nothing was "
                                "published: pass ", Option("overwrite", True), " to the plan, or remove it")


def _clear_leftovers(store: ObjectStore, plan: ConversionPlan, listed: Mapping[str, ObjectInfo]) -> None:
    """Abort the uploads killed tasks left open; drop what a finalize killed mid-publish put (its journal,
    and the side files it streamed: put again below)."""
    shards = {t.output for t in plan.tasks}
    for upload in store.pending_uploads():
        if upload.name in shards:
            store.abort(upload)
    journals = [n for n in listed if n != journal_name(plan) and os.path.basename(n).startswith(JOURNAL_PREFIX)
                and "/" not in n]
    store.delete(journals + [n for n in plan.side_files if n in listed and not n.endswith(".json")])


def _publish(store: ObjectStore, plan: ConversionPlan, job: ShardJob, copies: Sequence[SideFile],
             records: Mapping[str, FileDigest]) -> None:
    """The store transaction of a single-process write, with the shards already in the store."""
    staging = tempfile.mkdtemp(prefix="shardkit-plan-publish-")
    try:
        placeholder = os.path.join(staging, "out")
        with bind_output(placeholder, _opener(store, {t.output for t in plan.tasks}), target=plan.spec.output):
            run_jobs(placeholder, [job], options=plan.spec.options, side_files=copies, shards=_adopt(records))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _opener(store: ObjectStore, shards: set[str]) -> OutputOpener:

    @contextlib.contextmanager
    def opener(output: str, out_plan: OutputPlan) -> Iterator[JobOutput]:
        with ManifestRecorder(output, stale=[], enabled=out_plan.manifest) as record:
            names = [n for n in out_plan.names if n not in shards and (record.enabled or n != MANIFEST_NAME)]
            # overwrite: the prefix holds the plan's shards (never replaced: they are not among the names)
            with StoreTransaction(store, names, overwrite=True, on_put=_put_point) as tx:
                yield StoreOutput(tx, record)

    return opener


def _adopt(records: Mapping[str, FileDigest]) -> ShardWriter:
    """The ``shards=`` of :func:`run_jobs`: each shard is in the store already; its record goes to the manifest."""

    def adopt(job: ShardJob, out: JobOutput, metadata: Mapping[str, str], tick: ByteCounter) -> None:
        for shard in job.plan.shards:
            name = job.path(shard.filename)
            out.record.add(name, records[name])
            tick(records[name].size_bytes)

    return adopt


def _put_point(name: str) -> None:
    _faults.point(f"store:put:{name}")
