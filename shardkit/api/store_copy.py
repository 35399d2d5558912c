"""``split s3://A s3://B`` by copies inside the store: the object-store analogue of a copy-on-write reshard.

When the source and the output are prefixes of one S3 store and every tensor keeps its bytes (no
cast, no quantization, no layout change), each output shard is composed in the store: its header
(built exactly as the local writer builds it, padding included) and the tensor bytes up to the
5 MiB mark travel through the client; the runs of tensors that lie contiguous in one source
object are copied by ``UploadPartCopy`` and never cross the network (the parts:
:mod:`shardkit.stores.copy_plan`). The write goes through
:class:`~shardkit.stores.transaction.StoreTransaction`, so the index is published last and a
failure or a kill leaves no index and (after ``recover``) no upload.

The manifest carries each copied tensor's crc32 from the source's manifest where it records the
same byte range; a tensor whose bytes passed through the client is hashed on the way; any other
is recorded with ``"crc32": null`` (not hashed; never a guessed value), which ``verify`` reports.

:func:`copy_split` returns None where copies do not apply (another store, a cast, a pipeline, a
dry run) and when the store refuses ``UploadPartCopy``; the caller then streams as before.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

from .. import _faults
from ..formats.header import build_header
from ..formats.index import dump_index
from ..formats.layout import is_pipeline_folder
from ..formats.manifest import FileDigest, TensorDigest, dump_manifest
from ..formats.suffixes import MANIFEST_FILE, is_manifest_file
from ..sharding.digest import source_digests
from ..sharding.job import ShardJob, SplitResult, open_settled, plan_job, shard_metadata, side_files
from ..sharding.options import WriteOptions
from ..sharding.writer import TensorWrite, clone_alignment
from ..sources.ranged import RangedCheckpoint
from ..stores import ObjectStore, ObjectWriter, RangeRequest, is_store_url, open_store, parse_store_url, read_ranges
from ..stores.copy_plan import (
    CLIENT_PART_BYTES,
    ClientPart,
    CopyPart,
    CopyRefusedError,
    Part,
    SourceSpan,
    client_bytes,
    copied_bytes,
    plan_copy_parts,
)
from ..stores.s3 import S3Store
from ..stores.s3_writer import S3Writer
from ..stores.transaction import StoreTransaction

__all__ = ["StoreCopy", "copy_split"]

logger = logging.getLogger("shardkit")
SIDE_READ_BYTES = 8 << 20
COPY_PART_BYTES = 512 << 20  # under S3's 5 GiB: three copies in flight per shard, each well inside the 60 s timeout


@dataclass(frozen=True)
class StoreCopy:
    """How a copy-composed write moved its bytes: copied in the store, sent through the client."""

    copied_bytes: int
    client_bytes: int


@dataclass(frozen=True)
class _Shard:
    name: str
    header: bytes
    writes: list[TensorWrite]
    spans: list[SourceSpan]
    carried: dict[str, str]


def copy_split(source: object, readable: object, output: str, *, options: WriteOptions,
               key: str | None = None) -> SplitResult | None:
    """``split(source, output)`` composed in the store, or None where that does not apply (stream instead).

    ``readable`` is the opened source (:func:`shardkit.api.stores.store_checkpoint` of ``source``).
    The result's ``cloned_bytes`` are the tensor bytes copied inside the store.
    """
    if not _applies(source, readable, output, options=options, key=key):
        return None
    assert isinstance(readable, RangedCheckpoint) and isinstance(source, str)
    with open_settled(readable, key=None, dry_run=False) as src:
        job = plan_job(src, options=options)
        if not all(w.src.file and w.src.dtype == w.out.dtype and w.src.nbytes == w.out.nbytes for w in job.writes):
            return None  # a cast or a derived tensor: its bytes are made, not kept
        shards = _shards(job, readable, options)
        sides = [(path, name) for path, name in side_files(readable, output)
                 if not is_manifest_file(os.path.basename(name))]
        with open_store(parse_store_url(source)) as src_store, open_store(parse_store_url(output)) as dst_store:
            if getattr(src_store, "endpoint", None) != getattr(dst_store, "endpoint", "") or \
                    getattr(dst_store, "writer", None) is None:
                return None
            try:
                moved = _write(job, shards, sides, readable, src_store, dst_store, options)
            except CopyRefusedError as e:  # rolled back: nothing of this write is left in the store
                logger.info("%s; streaming the bytes instead", e)
                return None
        result = job.result(output, options, copied=[("", name) for _, name in sides])
        return replace(result, cloned_bytes=moved.copied_bytes)


def _applies(source: object, readable: object, output: str, *, options: WriteOptions, key: str | None) -> bool:
    return (isinstance(source, str) and is_store_url(source) and is_store_url(output)
            and isinstance(readable, RangedCheckpoint) and key is None and not options.dry_run
            and options.quantize is None and not parse_store_url(output).prefix.endswith(".safetensors")
            and not parse_store_url(source).prefix.endswith(".safetensors")
            and not is_pipeline_folder(readable.path))


def _object_name(readable: RangedCheckpoint, path: str) -> str:
    return os.path.relpath(path, readable.root).replace(os.sep, "/")


def _shards(job: ShardJob, readable: RangedCheckpoint, options: WriteOptions) -> list[_Shard]:
    """Each output shard's header (as the local writer builds it), source spans and carried crc32s."""
    by_name = {w.out.name: w for w in job.writes}
    files = sorted({w.src.file for w in job.writes if w.src.file})
    known = source_digests(files) if options.manifest else {}
    shards = []
    for spec in job.plan.shards:
        writes = [by_name[n] for n in spec.names]
        metadata = shard_metadata(job, options.metadata or {})
        header, _ = build_header([w.out for w in writes], metadata=dict(sorted(metadata.items())),
                                 data_start_mod=clone_alignment(writes))
        spans = [SourceSpan(_object_name(readable, w.src.file or ""), w.src.offset, w.src.offset + w.src.nbytes)
                 for w in writes]
        carried = {w.out.name: crc for w in writes
                   if (crc := known.get((os.path.realpath(w.src.file or ""), w.src.offset,
                                         w.src.offset + w.src.nbytes))) is not None}
        shards.append(_Shard(spec.filename, header, writes, spans, carried))
    return shards


def _write(job: ShardJob, shards: Sequence[_Shard], sides: Sequence[tuple[str, str]], readable: RangedCheckpoint,
           src_store: ObjectStore, dst_store: ObjectStore, options: WriteOptions) -> StoreCopy:
    index = job.plan.index_filename
    names = [s.name for s in shards] + [n for _, n in sides] + ([index] if index else []) + \
        ([MANIFEST_FILE] if options.manifest else [])
    part_bytes = int(getattr(dst_store, "part_bytes", CLIENT_PART_BYTES))
    plans = [plan_copy_parts(len(s.header), s.spans, client_part_bytes=part_bytes, max_copy_part_bytes=COPY_PART_BYTES)
             for s in shards]
    total = sum(len(s.header) + sum(sp.nbytes for sp in s.spans) for s in shards)
    tick = _Progress(total, options.progress)
    records: dict[str, FileDigest] = {}
    with StoreTransaction(dst_store, names, overwrite=options.overwrite) as tx:
        for shard, parts in zip(shards, plans, strict=True):
            hasher = _TensorCrcs(shard)
            tx.compose(shard.name, functools.partial(_fill, parts=parts, shard=shard, hasher=hasher,
                                                     src_store=src_store, tick=tick))
            records[shard.name] = hasher.record()
        for path, name in sides:
            records[name] = _copy_side_file(tx, src_store, _object_name(readable, path), name)
        if index:
            data = dump_index(job.plan.weight_map(), total_size_bytes=job.plan.total_bytes)
            tx.stream(index, [data])
            records[index] = FileDigest(len(data), hashlib.sha256(data).hexdigest())
        if options.manifest:
            tx.stream(MANIFEST_FILE, [dump_manifest(records)])
        tx.commit()
    return StoreCopy(sum(copied_bytes(p) for p in plans), sum(client_bytes(p) for p in plans))


def _fill(writer: ObjectWriter, parts: Sequence[Part], shard: _Shard, hasher: _TensorCrcs, src_store: ObjectStore,
          tick: _Progress) -> None:
    """Write one shard's parts: client parts filled from the header and ranged GETs, copy parts in the store."""
    if not isinstance(writer, S3Writer):
        raise CopyRefusedError(f"{writer.name}: this store has no server-side copy")
    for number, part in enumerate(parts, 1):
        if isinstance(part, CopyPart):
            etag = src_store.pinned_etag(part.name) if isinstance(src_store, S3Store) else ""  # as its ranged GETs
            writer.copy_range(src_store.url.bucket, src_store.url.key(part.name), part.begin, part.end, etag=etag)
            hasher.skip(part.nbytes)
        else:
            data = _client_bytes(part, shard.header, src_store)
            writer.write(memoryview(data))
            hasher.feed(memoryview(data))
        _faults.point(f"store:part:{shard.name}:{number}")  # the part is in the writer (sent or in flight)
        tick(part.nbytes)


def _client_bytes(part: ClientPart, header: bytes, src_store: ObjectStore) -> bytearray:
    data = bytearray(part.nbytes)
    view, at, requests = memoryview(data), 0, []
    for piece in part.pieces:
        if piece.name is None:
            view[at:at + piece.nbytes] = header[piece.begin:piece.end]
        else:
            requests.append(RangeRequest(piece.name, piece.begin, view[at:at + piece.nbytes]))
        at += piece.nbytes
    read_ranges(src_store, requests)
    return data


def _copy_side_file(tx: StoreTransaction, src_store: ObjectStore, source_name: str, name: str) -> FileDigest:
    """A side file (config, tokenizer...) read from the source object, streamed into the output, sha256 taken."""
    size = src_store.stat(source_name).size_bytes
    digest = hashlib.sha256()

    def chunks() -> Iterator[memoryview]:
        for begin in range(0, size, SIDE_READ_BYTES):
            chunk = memoryview(bytearray(min(SIDE_READ_BYTES, size - begin)))
            src_store.read_into(source_name, begin, chunk)
            digest.update(chunk)
            yield chunk

    tx.stream(name, chunks())
    return FileDigest(size, digest.hexdigest())


class _TensorCrcs:
    """crc32s of a shard's header and of the tensors whose every byte went through the client, in output order."""

    def __init__(self, shard: _Shard) -> None:
        self.shard = shard
        self.data_start = len(shard.header)
        self.ranges: list[tuple[str, int, int]] = []
        at = self.data_start
        for w in shard.writes:
            self.ranges.append((w.out.name, at, at + w.out.nbytes))
            at += w.out.nbytes
        self.crcs: dict[str, int] = {}
        self.spoiled: set[str] = set()
        self.at = 0

    def feed(self, data: memoryview) -> None:
        begin, end = self.at, self.at + len(data)
        for name, t0, t1 in self.ranges:
            lo, hi = max(t0, begin), min(t1, end)
            if lo < hi:
                self.crcs[name] = zlib.crc32(data[lo - begin:hi - begin], self.crcs.get(name, 0))
        self.at = end

    def skip(self, nbytes: int) -> None:
        begin, end = self.at, self.at + nbytes
        self.spoiled |= {name for name, t0, t1 in self.ranges if max(t0, begin) < min(t1, end)}
        self.at = end

    def record(self) -> FileDigest:
        tensors = {}
        for name, t0, t1 in self.ranges:
            crc = self.shard.carried.get(name)
            if crc is None and name not in self.spoiled:
                crc = f"{self.crcs.get(name, 0):08x}"
            tensors[name] = TensorDigest(t0 - self.data_start, t1 - self.data_start, crc)
        header_crc = f"{zlib.crc32(self.shard.header):08x}"
        return FileDigest(self.at, None, self.data_start, header_crc, tensors)


class _Progress:
    def __init__(self, total: int, progress: Callable[[int, int], None] | None) -> None:
        self.total, self.done, self.progress = total, 0, progress

    def __call__(self, nbytes: int) -> None:
        self.done += nbytes
        if self.progress is not None:
            self.progress(self.done, self.total)
