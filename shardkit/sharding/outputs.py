"""Where a writing job's files go: the output strategy of :func:`~shardkit.sharding.job.run_jobs`.

A job writes shards, side files and small files (configs, indexes, the manifest), then publishes.
:class:`JobOutput` is that much of an output; there are two:

- :class:`LocalOutput`, a local folder: an :class:`~shardkit.atomic.commit.OutputTransaction`
  (staging folder or temporary names, renamed at the commit), shards written by offset with
  copy-on-write clones, fsyncs on a background worker, digests hashed from the written files;
- ``StoreOutput`` (:mod:`shardkit.sharding.store_output`), an ``s3://`` prefix: each shard streamed
  by :func:`~shardkit.sharding.stream_writer.stream_safetensors` into a multipart upload of a
  :class:`~shardkit.stores.transaction.StoreTransaction`, indexes published last, no local copy.

Which one a job gets is a table (:func:`open_output`): the local folder, unless a caller bound
another opener to that output path with :func:`bind_output` (``api/store_writes.py`` binds the
store to the placeholder path it gives the job). Commands keep handing ``run_jobs`` a path; a job
that does not go through ``run_jobs`` (GGUF, one ``.safetensors`` file) writes to the path.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol

from ..atomic.commit import OutputTransaction
from ..errors import ShardkitWriteError
from ..sources.base import Source
from .digest import ManifestRecorder
from .flush import BackgroundSync, ByteCounter, copy_side_file
from .writer import TensorWrite, write_safetensors

__all__ = ["BoundOutput", "JobOutput", "LocalOutput", "OutputOpener", "OutputPlan", "bind_output", "open_output", "output_target",
           "publish_files"]


@dataclass(frozen=True)
class OutputPlan:
    """What a job will write, known before its first byte: ``names`` relative to the output folder."""

    names: list[str]
    stale: list[str]  # local files the write replaces or removes (a store finds its own from the live index)
    overwrite: bool
    manifest: bool


class JobOutput(Protocol):
    """One open write into an output: its files, recorded in ``record``, then :meth:`publish`."""

    record: ManifestRecorder

    def write_shard(self, name: str, writes: list[TensorWrite], source: Source, *, metadata: dict[str, str],
                    progress: ByteCounter) -> int:
        """Write one shard (and record its digest); returns the bytes cloned rather than copied."""
        ...

    def copy_file(self, path: str, name: str) -> None:
        """Copy a side file (config, tokenizer, README...) published as ``name`` (and record it)."""
        ...

    def write_bytes(self, name: str, data: bytes) -> None:
        """Write a small file from memory (the caller records it; the manifest writes itself this way)."""
        ...

    def publish(self, indexes: Sequence[tuple[str, bytes]], *, before_index: Callable[[], None] | None = None) -> None:
        """Make every file durable, write the indexes and the manifest, publish (indexes last)."""
        ...


OutputOpener = Callable[[str, OutputPlan], contextlib.AbstractContextManager[JobOutput]]


def publish_files(tx: OutputTransaction, indexes: Sequence[tuple[str, bytes]], *, sync: BackgroundSync,
                  record: ManifestRecorder, before_index: Callable[[], None] | None = None) -> None:
    """The local publish (single process and collective): wait for every file to be on disk, write the
    indexes and the manifest, commit. ``before_index`` runs once the data is on disk."""
    sync.wait()
    if before_index is not None:
        before_index()
    for name, data in indexes:
        tx.write_bytes(name, data)
        record.data(name, data)
    record.write(tx)
    tx.commit(last=indexes[-1][0] if indexes else None)


class LocalOutput:
    """A local folder: files under an :class:`OutputTransaction`, fsynced in the background, hashed from disk."""

    def __init__(self, tx: OutputTransaction, sync: BackgroundSync, record: ManifestRecorder) -> None:
        self.tx, self.sync, self.record = tx, sync, record

    def write_shard(self, name: str, writes: list[TensorWrite], source: Source, *, metadata: dict[str, str],
                    progress: ByteCounter) -> int:
        path = self.tx.path_for(name)
        written = write_safetensors(path, writes, source, metadata=metadata, progress=progress, sync=self.sync)
        # hashed on a worker while the next shard is copied; what went through Python was crc'd on the way
        self.record.shard(name, path, writes, known=written.crc32s, source=source)
        return written.cloned_bytes

    def copy_file(self, path: str, name: str) -> None:
        copy_side_file(path, dst := self.tx.path_for(name), sync=self.sync)
        self.record.file(name, dst)

    def write_bytes(self, name: str, data: bytes) -> None:
        self.tx.write_bytes(name, data)

    def publish(self, indexes: Sequence[tuple[str, bytes]], *, before_index: Callable[[], None] | None = None) -> None:
        publish_files(self.tx, indexes, sync=self.sync, record=self.record, before_index=before_index)

    @classmethod
    @contextlib.contextmanager
    def open(cls, output: str, plan: OutputPlan) -> Iterator[JobOutput]:
        with OutputTransaction(output, overwrite=plan.overwrite, stale=plan.stale) as tx, BackgroundSync() as sync, \
                ManifestRecorder(output, stale=plan.stale, enabled=plan.manifest) as record:
            yield cls(tx, sync, record)


@dataclass
class BoundOutput:
    """An opener bound to one output path; ``used`` counts the jobs that wrote through it (at most one)."""

    path: str
    opener: OutputOpener
    used: int = 0
    target: str = ""  # what the path stands for (``s3://BUCKET/PREFIX``), "" for the path itself


_BOUND: ContextVar[BoundOutput | None] = ContextVar("shardkit_bound_output", default=None)


@contextlib.contextmanager
def bind_output(path: str, opener: OutputOpener, *, target: str = "") -> Iterator[BoundOutput]:
    """Within the block, a job writing into ``path`` writes through ``opener`` instead of the local folder.

    with bind_output("/tmp/x/out", store_output(store)) as bound:
        split_with(source, "/tmp/x/out", options=options)   # streamed into the store
    bound.used  # 1: the job went through run_jobs (0: it wrote /tmp/x/out itself)
    """
    bound = BoundOutput(os.path.abspath(path), opener, target=target)
    token = _BOUND.set(bound)
    try:
        yield bound
    finally:
        _BOUND.reset(token)


def output_target(output: str) -> str:
    """What ``output`` stands for: the URL it is bound to (:func:`bind_output`), else the path itself."""
    bound = _BOUND.get()
    return bound.target if bound is not None and bound.target and bound.path == os.path.abspath(output) else output


def open_output(output: str, plan: OutputPlan) -> contextlib.AbstractContextManager[JobOutput]:
    """The output a job writes ``output`` through: the opener bound to that path, else the local folder."""
    bound = _BOUND.get()
    if bound is None or bound.path != os.path.abspath(output):
        return LocalOutput.open(output, plan)
    if bound.used:
        raise ShardkitWriteError(f"{output}: a bound output takes one job; nothing was published")
    bound.used += 1
    return bound.opener(output, plan)
