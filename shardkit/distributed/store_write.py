"""A collective write into ``s3://BUCKET/PREFIX``: every rank streams its own shards into the store, rank 0 publishes.

The order and the guarantees are those of one process's
:class:`~shardkit.stores.transaction.StoreTransaction`, which rank 0 holds for the whole write:

1. Rank 0 copies the side files (configs) into a small local folder, then opens the transaction:
   it lists the prefix, refuses a clash, and puts the journal naming every object of the write.
   The other ranks open the store too; no rank uploads a byte before every rank has heard that
   the journal is there.
2. Each rank streams each shard it owns into a multipart upload
   (:func:`~shardkit.sharding.stream_writer.stream_safetensors`: byte for byte the local
   writer's shard, never staged on a local disk) and takes its crc32s on the way for the manifest.
3. The ranks exchange their outcome. If every rank succeeded, rank 0 checks each shard's object
   size, writes the index and manifest through the one publish path
   (:func:`shardkit.sharding.job.publish`) into a local folder of small files, and puts them:
   configs and manifest, the index last. The objects equal those of one process's write.

On any rank's failure every rank raises the same one-line error: each rank's open upload is
aborted by its writer; rank 0 then aborts the uploads still open under the write's shard names
(a rank that died), deletes every shard of the write and the journal. A rank 0 that dies leaves
the journal, which ``shardkit recover s3://...`` reads to clean up.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .. import _faults
from ..atomic.commit import OutputTransaction
from ..errors import ShardkitError, ShardkitWriteError
from ..formats.header import parse_header
from ..formats.manifest import MANIFEST_NAME, FileDigest, TensorDigest
from ..sharding import digest
from ..sharding.flush import BackgroundSync, ByteCounter
from ..sharding.job import SideFile, copy_side_files, publish, shard_metadata
from ..sharding.store_output import file_chunks
from ..sharding.stream_writer import stream_safetensors
from ..stores import ObjectStore, ObjectWriter, StoreUrl, open_store, parse_store_url
from ..stores.transaction import StoreTransaction
from .group import RankStatus, agree, status_of, tell_failure

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from ..sharding.job import ShardJob
    from ..sharding.options import WriteOptions
    from .gather import Gatherer

__all__ = ["write_to_store"]


@dataclass(frozen=True)
class _Run:
    """One rank's view of the write: who it is, what is planned, who owns which shard."""

    process_group: ProcessGroup | None
    rank: int
    job: ShardJob
    owners: list[int]
    output: str
    options: WriteOptions


@dataclass
class _RankZero:
    """What rank 0 holds besides the store: the transaction and the local folder of small files."""

    tx: StoreTransaction
    folder: str
    side: dict[str, FileDigest] = field(default_factory=dict)  # side files' digests, for the manifest


class _HeadSink:
    """A byte sink that keeps the first write (the shard's header region) and counts every byte."""

    def __init__(self, writer: ObjectWriter, name: str) -> None:
        self.writer, self.name = writer, name
        self.head: bytes | None = None
        self.size_bytes = 0

    def write(self, data: bytes | memoryview) -> None:
        if self.head is None:
            self.head = bytes(data)
        self.writer.write(data)
        nbytes = memoryview(data).nbytes
        self.size_bytes += nbytes
        if _faults.ACTIVE:
            _faults.point(f"store:sent:{self.name}:{self.size_bytes}", nbytes)


def write_to_store(job: ShardJob, output: str, *, options: WriteOptions, process_group: ProcessGroup | None,
                   rank: int, owners: list[int], side_files: Sequence[SideFile] = (),
                   gather: Gatherer | None = None) -> None:
    """Write ``job`` under the ``s3://`` URL ``output`` with every rank of ``process_group``.

    Args:
        job: the planned job (the same plan on every rank).
        output: ``s3://BUCKET/PREFIX``.
        options: the write options (equal on every rank).
        process_group, rank: the group and this rank in it.
        owners: the rank that writes each shard, in plan order (:func:`~shardkit.distributed.assign.assign_shards`).
        side_files: files rank 0 publishes with the shards (configs).
        gather: as in :func:`~shardkit.distributed.collective.write_collective`.

    write_to_store(job, "s3://models/out", options=options, process_group=None, rank=0, owners=[0, 1, 0])
    """
    run = _Run(process_group, rank, job, owners, output, options)
    url = parse_store_url(run.output)
    shards = [run.job.path(s.filename) for s in run.job.plan.shards]
    with contextlib.ExitStack() as stack:
        store, zero = _open(run, url, shards, side_files, stack)
        try:
            records = _stream_owned(run, store, gather)
            _publish(run, store, zero, records)
        except BaseException:
            if zero is not None:  # a rank that died left its upload open; the others aborted theirs
                with contextlib.suppress(ShardkitError):  # the first failure is the one to report
                    _abort_uploads(store, set(shards))
            raise  # then the transaction deletes every shard of the write and the journal


def _open(run: _Run, url: StoreUrl, shards: list[str], side_files: Sequence[SideFile],
          stack: contextlib.ExitStack) -> tuple[ObjectStore, _RankZero | None]:
    """Every rank opens the store; rank 0 also stages the side files and puts the journal."""
    zero = None
    try:
        store = stack.enter_context(open_store(url))
        if run.rank == 0:
            zero = _open_transaction(run, store, shards, side_files, stack)
    except Exception as e:  # every rank must hear of it, or the others block in the next collective
        _tell(run, e, what=f"opening {run.output}")
        raise
    _agree(run, what=f"opening {run.output}")
    return store, zero


def _open_transaction(run: _Run, store: ObjectStore, shards: list[str], side_files: Sequence[SideFile],
                      stack: contextlib.ExitStack) -> _RankZero:
    folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="shardkit-s3-publish-"))
    side_folder = os.path.join(folder, "side")
    with OutputTransaction(side_folder) as tx, BackgroundSync() as sync, \
            digest.ManifestRecorder(side_folder, stale=[], enabled=run.options.manifest) as record:
        copy_side_files(side_files, tx, sync=sync, record=record, jobs=[run.job], output=side_folder)
        sync.wait()
        side = record.results()  # hashed from the staging folder: before the commit moves it
        tx.commit()
    names = shards + list(_local_files(side_folder))
    if run.job.plan.index_filename:
        names.append(run.job.path(run.job.plan.index_filename))
    if run.options.manifest and digest.ENABLED:
        names.append(MANIFEST_NAME)
    zero = _RankZero(stack.enter_context(StoreTransaction(store, names, overwrite=run.options.overwrite)), folder, side)
    zero.tx.adopt(shards)  # every rank's shards, rank 0's own too: deleted on any failure
    return zero


def _stream_owned(run: _Run, store: ObjectStore, gather: Gatherer | None) -> dict[str, FileDigest]:
    """Stream this rank's shards into the store; join every rank's gathers; exchange the outcome.

    Returns every rank's shards: their digests with the manifest, else their sizes only.
    """
    job, metadata = run.job, shard_metadata(run.job, run.options.metadata or {})
    by_name = {w.out.name: w for w in job.writes}
    owned = list(zip(job.plan.shards, run.owners, strict=True))
    tick = ByteCounter(sum(s.nbytes for s, owner in owned if owner == run.rank), run.options.progress)
    written: dict[str, FileDigest] = {}
    if gather is not None:
        gather.assign({n: owner for s, owner in owned for n in s.names}, rank=run.rank, process_group=run.process_group)
    try:
        for shard, owner in owned:
            if owner == run.rank:
                name, writes = job.path(shard.filename), [by_name[n] for n in shard.names]
                with store.writer(name) as writer:  # aborted on any error
                    sink = _HeadSink(writer, name)
                    out = stream_safetensors(sink, name, writes, job.source, metadata=metadata, progress=tick)
                    writer.commit()
                written[name] = _shard_digest(sink, out.crc32s, hashed=run.options.manifest)
            if gather is not None:
                gather.skip_through(shard.names)
    except Exception as e:  # the others still gather the tensors after ours, then hear of it
        if gather is not None:
            gather.drain(e)
        _tell(run, e, what="writing shards")
        raise
    error = gather.drain(None) if gather is not None else None
    if error is not None:  # a peer died while we gathered for it
        _tell(run, error, what="writing shards")
        raise error
    statuses = _agree(run, what="writing shards", payload=written)
    return {name: record for s in statuses for name, record in s.payload.items()}


def _shard_digest(sink: _HeadSink, crc32s: dict[str, str], *, hashed: bool) -> FileDigest:
    """The manifest record of a streamed shard: the crc32 of its header region and of each tensor."""
    if not hashed or not digest.ENABLED or sink.head is None:
        return FileDigest(sink.size_bytes, None)
    header = parse_header(sink.head[8:], file_bytes=sink.size_bytes)
    start = header.data_start
    tensors = {e.name: TensorDigest(e.offset - start, e.offset + e.nbytes - start, crc32s[e.name])
               for e in header.entries}
    return FileDigest(sink.size_bytes, None, start, f"{zlib.crc32(sink.head[:start]):08x}", tensors)


def _publish(run: _Run, store: ObjectStore, zero: _RankZero | None, records: dict[str, FileDigest]) -> None:
    """Rank 0 checks the shards, writes the index and manifest, puts the small objects (index last)."""
    if zero is not None:
        try:
            _check_sizes(store, records)
            final = os.path.join(zero.folder, "final")
            with OutputTransaction(final) as tx, BackgroundSync() as sync, \
                    digest.ManifestRecorder(final, stale=[], enabled=run.options.manifest) as record:
                for name, found in {**zero.side, **records}.items():
                    record.add(name, found)
                publish(tx, [run.job], sync=sync, record=record)
            for folder in (os.path.join(zero.folder, "side"), final):
                for name, path in _local_files(folder).items():
                    zero.tx.stream(name, file_chunks(path))
            zero.tx.commit()
        except Exception as e:  # every rank must hear of it
            _tell(run, e, what=f"publishing {run.output}")
            raise
    _agree(run, what=f"publishing {run.output}")


def _check_sizes(store: ObjectStore, records: dict[str, FileDigest]) -> None:
    """Every shard a rank reported is an object of the size it wrote (nothing else touched it)."""
    found = {o.name: o.size_bytes for o in store.list_objects()}
    for name, record in records.items():
        if found.get(name) != record.size_bytes:
            raise ShardkitWriteError(f"{store.url.child(name)}: {found.get(name, 'no')} bytes in the store where a rank "
                                     f"wrote {record.size_bytes}; nothing was published")


def _abort_uploads(store: ObjectStore, names: set[str]) -> None:
    for upload in store.pending_uploads():
        if upload.name in names:
            store.abort(upload)


def _agree(run: _Run, *, what: str, payload: object = None) -> list[RankStatus]:
    """This rank's success at step ``what``: every rank's status, or the shared error where another failed."""
    return agree(run.process_group, status_of(run.rank, None, payload=payload), what=what)


def _tell(run: _Run, error: BaseException, *, what: str) -> None:
    """This rank's failure at step ``what`` to the others; the caller raises its own error."""
    tell_failure(run.process_group, status_of(run.rank, error), what=what)


def _local_files(folder: str) -> dict[str, str]:
    """Every file under ``folder``: name relative to it ('/'-separated) → path, sorted."""
    found: dict[str, str] = {}
    for root, _dirs, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            found[os.path.relpath(path, folder).replace(os.sep, "/")] = path
    return dict(sorted(found.items()))
