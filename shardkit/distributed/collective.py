"""Writing one checkpoint with every rank of a process group: one plan, shards divided, one commit.

Every rank plans from the same global view (tensor names, dtypes and global shapes) and the
plans are compared; the shards are divided among the ranks by bytes (:mod:`.assign`). Rank 0
opens the one :class:`~shardkit.atomic.commit.OutputTransaction` and tells the others where its
staging files go, as paths relative to the output's parent folder, so each rank resolves them
through its own view of the shared filesystem; a marker file rank 0 writes there proves every
rank sees the same folder. Each rank writes and hashes its own shards; a status exchange then
carries every rank's success or error, and only if all succeeded does rank 0 write the index and
the manifest and publish. Any failure raises the same one-line error on every rank, and rank 0's
transaction removes the staging folder; a rank that dies leaves a staging folder whose lock is
free, which the next write beside it removes.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..atomic.commit import TMP_MARK, OutputTransaction
from ..formats.manifest import FileDigest
from ..sharding import digest
from ..sharding.flush import BackgroundSync, ByteCounter
from ..sharding.job import (
    ShardJob,
    SideFile,
    SplitResult,
    checkpoint_files,
    copy_side_files,
    plan_job,
    publish,
    shard_metadata,
)
from ..sharding.options import WriteOptions, warn_if_output_taken
from ..sharding.writer import write_safetensors
from ..sources.base import Source
from ..stores.urls import is_store_url
from .assign import assign_shards, plan_signature
from .group import (
    DistributedError,
    RankStatus,
    agree,
    broadcast_from_zero,
    check_world_size,
    rank_and_world,
    status_of,
    tell_failure,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from .gather import Gatherer

__all__ = ["CollectiveWrite", "write_collective"]


@dataclass
class CollectiveWrite:
    """The state of one collective write on one rank."""

    process_group: ProcessGroup | None
    rank: int
    world: int
    job: ShardJob
    owners: list[int]
    output: str
    options: WriteOptions
    stale: list[str] = field(default_factory=list)
    paths: dict[str, str] = field(default_factory=dict)  # shard file → path relative to the output's parent
    marker: str = ""  # relative to the output's parent
    token: str = ""

    def local(self, relative: str) -> str:
        """``relative`` (to the output's parent) as this rank sees it."""
        return os.path.join(os.path.dirname(os.path.abspath(self.output)), relative)


def write_collective(src: Source, output: str, *, options: WriteOptions, process_group: ProcessGroup | None,
                     side_files: Sequence[SideFile] = (), gather: Gatherer | None = None,
                     mesh_sizes: Sequence[tuple[str, int]] = ()) -> SplitResult:
    """Write ``src`` into ``output`` together with every other rank of ``process_group``.

    Every rank must call it with an equal plan (same tensors, shapes, dtypes and options).

    Args:
        src: this rank's view of the tensors (global shapes; the bytes of the shards it owns).
        output: the output folder, on a filesystem every rank sees.
        options: the write options (equal on every rank).
        process_group: the ``torch.distributed`` group (None: the default group).
        side_files: files rank 0 publishes with the shards (configs).
        gather: a :class:`~shardkit.distributed.gather.Gatherer` when reading a tensor is a
            collective that every rank must join, in plan order.
        mesh_sizes: ``(tensor name, ranks it spans)`` to check against the group's size.

    Returns:
        The :class:`~shardkit.sharding.job.SplitResult`, equal on every rank.

    write_collective(src, "out/", options=WriteOptions(max_shard_bytes=10**9), process_group=None)
    """
    rank, world = rank_and_world(process_group)
    agree(process_group, check_world_size(process_group, sizes=mesh_sizes), what="checking world sizes")
    job = plan_job(src, options=options)
    _agree_on_plan(process_group, rank, job, options)
    run = CollectiveWrite(process_group, rank, world, job, assign_shards([s.nbytes for s in job.plan.shards], world),
                          os.fspath(output), options)
    if options.dry_run:
        if rank == 0:
            warn_if_output_taken(run.output, overwrite=options.overwrite)
        return job.result(run.output, options, copied=side_files)
    if is_store_url(run.output):  # each rank streams its shards into the store; rank 0 publishes
        from .store_write import write_to_store

        write_to_store(job, run.output, options=options, process_group=process_group, rank=rank, owners=run.owners,
                       side_files=side_files, gather=gather)
        return job.result(run.output, options, copied=side_files)
    run.stale = [job.path(n) for n in checkpoint_files(run.output, job.plan.naming)] + digest.stale_manifests(run.output, [""])
    with contextlib.ExitStack() as stack:
        tx = _open_output(run, stack)
        _check_marker(run)
        records = _write_owned(run, gather)
        _publish(run, tx, records, side_files)
    return job.result(run.output, options, copied=side_files)


def _agree_on_plan(process_group: ProcessGroup | None, rank: int, job: ShardJob, options: WriteOptions) -> None:
    rows: list[Sequence[object]] = [[w.out.name, w.out.dtype, list(w.out.shape)] for w in job.writes]
    rows += [[s.filename, *s.names] for s in job.plan.shards]
    rows += [[repr(options.cast_to), job.plan.max_shard_bytes, options.overwrite, sorted(job.source.aliases().items())]]
    statuses = agree(process_group, RankStatus(rank, payload=plan_signature(rows)), what="comparing plans")
    differ = [s.rank for s in statuses if s.payload != statuses[0].payload]
    if differ:
        raise DistributedError(f"rank(s) {', '.join(map(str, differ))} planned different shards than rank 0 "
                               "(other tensors, shapes, dtypes or options): call save_sharded with the same model "
                               "and options on every rank; nothing was published")


def _open_output(run: CollectiveWrite, stack: contextlib.ExitStack) -> OutputTransaction | None:
    """Rank 0 opens the transaction and writes the marker; every rank learns the staging paths."""
    tx, status = None, None
    if run.rank == 0:
        try:
            tx = stack.enter_context(OutputTransaction(run.output, overwrite=run.options.overwrite, stale=run.stale))
            parent = os.path.dirname(os.path.abspath(run.output))
            paths = {s.filename: os.path.relpath(tx.path_for(run.job.path(s.filename)), parent)
                     for s in run.job.plan.shards}
            root = os.path.dirname(os.path.join(parent, next(iter(paths.values()))))
            marker, token = os.path.join(root, f"{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}-ranks"), secrets.token_hex(8)
            with open(marker, "x", encoding="utf-8") as f:
                f.write(token)
            status = RankStatus(0, payload=(paths, os.path.relpath(marker, parent), token))
        except Exception as e:  # every rank must hear of it, or the others block in the next collective
            tell_failure(run.process_group, status_of(0, e), what=f"opening {run.output}", from_zero=True)
            raise
    got = broadcast_from_zero(run.process_group, status, what=f"opening {run.output}")
    run.paths, run.marker, run.token = got.payload
    return tx


def _check_marker(run: CollectiveWrite) -> None:
    """Every rank must see the marker rank 0 wrote beside the output: one shared folder."""
    path = run.local(run.marker)
    try:
        with open(path, encoding="utf-8") as f:
            seen = f.read() == run.token
    except OSError:
        seen = False
    error = None if seen else (f"cannot see {path}, which rank 0 wrote beside the output: {run.output} must be one "
                               "folder on a filesystem shared by every rank (the same path on every node)")
    agree(run.process_group, RankStatus(run.rank, error), what=f"checking that every rank sees {run.output}")


def _write_owned(run: CollectiveWrite, gather: Gatherer | None) -> dict[str, FileDigest]:
    """Write and hash this rank's shards; join every rank's gathers; exchange the outcome.

    Returns every rank's digests (none with ``manifest=False``); ``run.job.cloned_bytes`` becomes
    the total cloned by all ranks.
    """
    job, metadata = run.job, shard_metadata(run.job, run.options.metadata or {})
    by_name = {w.out.name: w for w in job.writes}
    mine = [s for s, owner in zip(job.plan.shards, run.owners, strict=True) if owner == run.rank]
    tick = ByteCounter(sum(s.nbytes for s in mine), run.options.progress)
    error: BaseException | None = None
    outcome: tuple[dict[str, FileDigest], int] = ({}, 0)
    if gather is not None:
        gather.assign({n: owner for s, owner in zip(job.plan.shards, run.owners, strict=True) for n in s.names},
                      rank=run.rank, process_group=run.process_group)
    try:
        cloned_bytes = 0
        with digest.ManifestRecorder(run.output, stale=run.stale, enabled=run.options.manifest) as record, \
                BackgroundSync() as sync:
            for shard, owner in zip(job.plan.shards, run.owners, strict=True):
                if owner == run.rank:
                    path, writes = run.local(run.paths[shard.filename]), [by_name[n] for n in shard.names]
                    written = write_safetensors(path, writes, job.source, metadata=metadata, progress=tick, sync=sync)
                    cloned_bytes += written.cloned_bytes
                    record.shard(job.path(shard.filename), path, writes, known=written.crc32s, source=job.source)
                if gather is not None:
                    gather.skip_through(shard.names)
            sync.wait()
            outcome = (record.results(), cloned_bytes)
    except Exception as e:  # the others still gather the tensors after ours, then hear of it
        if gather is not None:
            gather.drain(e)
        agree(run.process_group, status_of(run.rank, e), what="writing shards")  # raises on every rank
        raise
    error = gather.drain(None) if gather is not None else None
    statuses = agree(run.process_group, status_of(run.rank, error, payload=outcome), what="writing shards")
    job.cloned_bytes = sum(s.payload[1] for s in statuses)
    return {name: record for s in statuses for name, record in s.payload[0].items()}


def _publish(run: CollectiveWrite, tx: OutputTransaction | None, records: dict[str, FileDigest],
             side_files: Sequence[SideFile]) -> None:
    """Rank 0 writes the side files, index and manifest and commits; every rank learns the outcome."""
    status = None
    if run.rank == 0:
        assert tx is not None
        try:
            _commit(run, tx, records, side_files)
            status = RankStatus(0)
        except Exception as e:  # every rank must hear of it
            tell_failure(run.process_group, status_of(0, e), what=f"publishing {run.output}", from_zero=True)
            raise
    broadcast_from_zero(run.process_group, status, what=f"publishing {run.output}")


def _commit(run: CollectiveWrite, tx: OutputTransaction, records: dict[str, FileDigest],
            side_files: Sequence[SideFile]) -> None:
    """Rank 0's share of the one publish path (:func:`shardkit.sharding.job.publish`)."""
    with digest.ManifestRecorder(run.output, stale=run.stale, enabled=run.options.manifest) as record, \
            BackgroundSync() as sync:
        copy_side_files(side_files, tx, sync=sync, record=record, jobs=[run.job], output=run.output)
        for name, digest_record in records.items():
            record.add(name, digest_record)
        publish(tx, [run.job], sync=sync, record=record,
                before_index=lambda: os.remove(run.local(run.marker)))  # not part of the checkpoint
