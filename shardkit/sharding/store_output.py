"""A job's output in an object store (``s3://BUCKET/PREFIX``), streamed: no local copy, bounded memory.

The :class:`~shardkit.sharding.outputs.JobOutput` of a store. Every file goes into one
:class:`~shardkit.stores.transaction.StoreTransaction` (journal first, indexes last, rolled back
on any failure or interrupt):

- each shard is written front to back by :func:`~shardkit.sharding.stream_writer.stream_safetensors`
  into the transaction's multipart writer (parts of 16 MiB, at most 3 in flight), one shard after
  another, reading 16 MiB of a tensor at a time, so memory holds one source chunk (and the source's
  read-ahead) and four parts whatever the checkpoint's size. The
  bytes are those of a local write with the same options, and the shard's manifest record is
  taken on the way (nothing is read back);
- side files are streamed from their local file (``.json`` ones held for the publish), hashed on
  the way; configs written from memory and the manifest are ``put`` at the publish, before the
  indexes.

Fault points: ``store:sent:NAME:BYTES`` each time a multiple of 8 MiB of an object (and its last
byte) is in the writer (at 16 MiB its first part has gone and its multipart upload is open);
``store:put:NAME`` after each ``.json`` object is put at the publish (``store:put:shardkit.manifest.json``:
the manifest is in, no index yet).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable, Iterator, Sequence

from .. import _faults
from ..errors import ShardkitWriteError, describe_os_error
from ..formats.links import open_regular
from ..formats.manifest import MANIFEST_NAME, FileDigest
from ..sources.base import Source
from ..stores import ObjectStore
from ..stores.base import ObjectWriter
from ..stores.transaction import StoreTransaction
from .digest import ManifestRecorder
from .flush import ByteCounter
from .outputs import JobOutput, OutputOpener, OutputPlan
from .stream_writer import stream_safetensors
from .writer import TensorWrite

__all__ = ["FAULT_STEP_BYTES", "StoreOutput", "file_chunks", "store_output"]

FAULT_STEP_BYTES = 8 << 20  # a fault point each time this many bytes of an object are in the writer
READ_BYTES = 8 << 20  # side files are read this much at a time
SOURCE_CHUNK_BYTES = 16 << 20  # tensors are read this much at a time: one part's worth (a local write reads 64 MiB)


class _Counted:
    """A writer that fires ``store:sent:NAME:BYTES`` at every :data:`FAULT_STEP_BYTES` boundary."""

    def __init__(self, writer: ObjectWriter, name: str) -> None:
        self._writer, self._label, self.written_bytes = writer, f"store:sent:{name}:", 0

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            room = FAULT_STEP_BYTES - self.written_bytes % FAULT_STEP_BYTES
            self._writer.write(view[:room])
            self.written_bytes += min(room, len(view))
            view = view[room:]
            if self.written_bytes % FAULT_STEP_BYTES == 0:
                _faults.point(f"{self._label}{self.written_bytes}")

    def close(self) -> None:
        if self.written_bytes % FAULT_STEP_BYTES:
            _faults.point(f"{self._label}{self.written_bytes}")


class StoreOutput:
    """A store prefix as a job's output: see the module docstring."""

    def __init__(self, tx: StoreTransaction, record: ManifestRecorder) -> None:
        self.tx, self.record = tx, record

    def write_shard(self, name: str, writes: list[TensorWrite], source: Source, *, metadata: dict[str, str],
                    progress: ByteCounter) -> int:
        with self.tx.writer(name) as writer:
            sink = _Counted(writer, name)
            streamed = stream_safetensors(sink, name, writes, source, metadata=metadata, progress=progress,
                                          chunk_bytes=SOURCE_CHUNK_BYTES)
            sink.close()
        self.record.add(name, streamed.digest)
        return 0

    def copy_file(self, path: str, name: str) -> None:
        sha, size = hashlib.sha256(), [0]

        def hashed() -> Iterator[bytes]:
            for chunk in file_chunks(path):
                sha.update(chunk)
                size[0] += len(chunk)
                yield chunk

        if name.endswith(".json"):  # held in memory for the publish, as the transaction holds every .json
            self.tx.stream(name, hashed())
        else:
            with self.tx.writer(name) as writer:
                sink = _Counted(writer, name)
                for chunk in hashed():
                    sink.write(chunk)
                sink.close()
        self.record.add(name, FileDigest(size[0], sha.hexdigest()))

    def write_bytes(self, name: str, data: bytes) -> None:
        self.tx.stream(name, [data])

    def publish(self, indexes: Sequence[tuple[str, bytes]], *, before_index: Callable[[], None] | None = None) -> None:
        if before_index is not None:
            before_index()
        for name, data in indexes:
            self.write_bytes(name, data)
            self.record.data(name, data)
        self.record.write(self)  # the manifest, put before the indexes by the transaction
        self.tx.commit()


def store_output(store: ObjectStore, *, overwrite: bool) -> OutputOpener:
    """An opener that writes a job into ``store``'s prefix (bind it with :func:`~shardkit.sharding.outputs.bind_output`).

    ``overwrite`` is the caller's: the job itself is run with ``overwrite=False`` on a placeholder path.
    """

    @contextlib.contextmanager
    def opener(output: str, plan: OutputPlan) -> Iterator[JobOutput]:
        with ManifestRecorder(output, stale=[], enabled=plan.manifest) as record:
            names = [n for n in plan.names if record.enabled or n != MANIFEST_NAME]
            with StoreTransaction(store, names, overwrite=overwrite, on_put=_put_point) as tx:
                yield StoreOutput(tx, record)

    return opener


def _put_point(name: str) -> None:
    _faults.point(f"store:put:{name}")  # the object is in the store; the indexes are put last


def file_chunks(path: str) -> Iterator[bytes]:
    """A side file's bytes, :data:`READ_BYTES` at a time, through a checked descriptor; the count checked."""
    fd = open_regular(path)  # a file swapped for a FIFO or device since listing is refused unread
    try:
        size_bytes, done = os.fstat(fd).st_size, 0
        while done < size_bytes:
            chunk = os.read(fd, min(READ_BYTES, size_bytes - done))
            if not chunk:
                raise ShardkitWriteError(f"{path}: the file ended after {done} of {size_bytes} bytes; nothing was published")
            done += len(chunk)
            yield chunk
    except OSError as e:
        raise ShardkitWriteError(f"reading {path} failed: {describe_os_error(e)}; nothing was published") from e
    finally:
        os.close(fd)
