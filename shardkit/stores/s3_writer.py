"""One object written to S3 by multipart upload: streamed, bounded memory, aborted on every failure path.

Bytes are gathered into parts of ``part_bytes`` (S3 wants every part but the last ≥ 5 MiB); a
full part is uploaded on a worker while the next one fills, at most ``IN_FLIGHT_PARTS`` at once,
so memory stays under ``(IN_FLIGHT_PARTS + 1) × part_bytes`` whatever the object's size. An object
smaller than one part is written by one ``PutObject`` at :meth:`S3Writer.commit`. Nothing is
visible under the name before ``commit``; leaving the ``with`` block without it (an error, an
interrupt) aborts the upload, so the store keeps no parts.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from types import TracebackType
from typing import Any, Protocol, TypeVar

from ..errors import ShardkitError, ShardkitWriteError, StoreError
from ..workers import ReadPool
from .base import ObjectInfo
from .urls import StoreUrl

__all__ = ["S3Writer"]

T = TypeVar("T")
# boto3 ships no type information: its S3 client is the one foreign object named here.
S3Client = Any  # also its replies


class _Bucket(Protocol):
    """What the writer needs of :class:`~shardkit.stores.s3.S3Store`."""

    url: StoreUrl

    @property
    def client(self) -> S3Client: ...

    def call(self, what: str, fn: Callable[[], T]) -> T: ...

    def put(self, name: str, data: bytes) -> ObjectInfo: ...

    def stat(self, name: str) -> ObjectInfo: ...

IN_FLIGHT_PARTS = 3
MAX_PARTS = 10_000  # S3's limit on parts in one upload
MIN_PART_BYTES = 5 << 20  # S3's least part size (but the last)
GROW_EVERY_PARTS = 2_000  # parts double in size every this many, so an object up to ~5 TiB fits


class S3Writer:
    """``with store.writer("model-00001-of-00002.safetensors") as w: w.write(...); w.commit()``."""

    def __init__(self, store: _Bucket, name: str, *, part_bytes: int) -> None:
        self.name = name
        self._store = store
        self._key = store.url.key(name)
        self._where = str(store.url.child(name))
        self._part_bytes = max(part_bytes, MIN_PART_BYTES)
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._parts: dict[int, str] = {}
        self._sent_parts = 0
        self._pending: deque[Future[None]] = deque()
        self._pool: ReadPool | None = None
        self._written_bytes = 0
        self._done = False

    # ------------------------------------------------------------------ writing

    def write(self, data: bytes | memoryview) -> None:
        if self._done:
            raise StoreError(f"{self._where}: write after commit or abort")
        view = memoryview(data).cast("B")
        while len(view):
            room = self._current_part_bytes() - len(self._buffer)
            self._buffer += view[:room]
            view = view[room:]
            if len(self._buffer) == self._current_part_bytes():
                self._send_part()
        self._written_bytes += len(memoryview(data).cast("B"))

    def _current_part_bytes(self) -> int:
        return self._part_bytes << self._sent_parts // GROW_EVERY_PARTS

    def _next_part(self) -> int:
        """The next part's number: the upload started if it was not, a slot free among the parts in flight."""
        if self._upload_id is None:
            reply = self._store.call(self._where, lambda: self._client.create_multipart_upload(
                Bucket=self._store.url.bucket, Key=self._key))
            self._upload_id = str(reply["UploadId"])
            self._pool = ReadPool(IN_FLIGHT_PARTS, name="shardkit-store-write")
        number = self._sent_parts + 1
        if number > MAX_PARTS:
            raise ShardkitWriteError(f"{self._where}: more than {MAX_PARTS} parts; the object is too large for S3")
        while len(self._pending) >= IN_FLIGHT_PARTS:
            self._pending.popleft().result()
        return number

    def _send_part(self) -> None:
        number = self._next_part()
        data, self._buffer = self._buffer, bytearray()  # handed over whole: no copy
        self._sent_parts = number
        assert self._pool is not None
        self._pending.append(self._pool.submit(lambda: self._upload_part(number, data)))

    def _upload_part(self, number: int, data: bytearray) -> None:
        reply = self._store.call(f"{self._where} part {number}", lambda: self._client.upload_part(
            Bucket=self._store.url.bucket, Key=self._key, UploadId=self._upload_id, PartNumber=number, Body=data))
        self._parts[number] = str(reply["ETag"])

    def copy_range(self, bucket: str, key: str, begin: int, end: int, *, etag: str = "") -> None:
        """Append bytes ``[begin, end)`` of the object ``bucket/key`` as ONE part copied inside the store
        (``UploadPartCopy``): none of them cross the client. The bytes written before go first as a
        part of their own, so the caller keeps them at least 5 MiB (see :mod:`.copy_plan`). A store
        that refuses the copy raises :class:`~shardkit.stores.copy_plan.CopyRefusedError`. ``etag``:
        the source's listed entity tag, the copy pinned to it (``CopySourceIfMatch``: 412 if replaced)."""
        if self._done:
            raise StoreError(f"{self._where}: write after commit or abort")
        if self._buffer:
            self._send_part()
        number = self._next_part()
        self._sent_parts = number
        assert self._pool is not None
        self._pending.append(self._pool.submit(lambda: self._copy_part(number, bucket, key, begin, end, etag)))
        self._written_bytes += end - begin

    def _copy_part(self, number: int, bucket: str, key: str, begin: int, end: int, etag: str) -> None:
        from .copy_plan import refused_copy

        pinned = {"CopySourceIfMatch": f'"{etag}"'} if etag else {}

        def copy() -> S3Client:
            with refused_copy(f"{self._where} part {number} (copy of s3://{bucket}/{key})"):
                return self._client.upload_part_copy(
                    Bucket=self._store.url.bucket, Key=self._key, UploadId=self._upload_id, PartNumber=number,
                    CopySource={"Bucket": bucket, "Key": key}, CopySourceRange=f"bytes={begin}-{end - 1}", **pinned)

        reply = self._store.call(f"{self._where} part {number}", copy)
        self._parts[number] = str(reply["CopyPartResult"]["ETag"])

    @property
    def _client(self) -> S3Client:
        return self._store.client

    # ------------------------------------------------------------------ ending

    def commit(self) -> ObjectInfo:
        """Complete the upload; the stored object's size is checked against the bytes written."""
        if self._done:
            raise StoreError(f"{self._where}: commit after commit or abort")
        try:
            if self._upload_id is None:
                info = self._store.put(self.name, bytes(self._buffer))
            else:
                if self._buffer:
                    self._send_part()
                self._wait_parts()
                parts = [{"PartNumber": n, "ETag": self._parts[n]} for n in sorted(self._parts)]
                upload_id = self._upload_id
                self._store.call(self._where, lambda: self._client.complete_multipart_upload(
                    Bucket=self._store.url.bucket, Key=self._key, UploadId=upload_id,
                    MultipartUpload={"Parts": parts}))
                self._upload_id = None  # completed: nothing to abort
                info = self._store.stat(self.name)
        except BaseException:
            with contextlib.suppress(ShardkitError):  # the first failure is the one to report
                self.abort()
            raise
        self._finish()
        if info.size_bytes != self._written_bytes:
            raise ShardkitWriteError(f"{self._where}: the store holds {info.size_bytes} bytes, "
                                     f"{self._written_bytes} were written")
        return info

    def _wait_parts(self) -> None:
        while self._pending:
            self._pending.popleft().result()

    def abort(self) -> None:
        """Stop the parts not sent, wait (bounded) for those in flight, abort the upload. Idempotent."""
        for future in self._pending:
            future.cancel()
        self._finish()
        upload_id, self._upload_id = self._upload_id, None
        if upload_id is not None:
            self._store.call(self._where, lambda: self._client.abort_multipart_upload(
                Bucket=self._store.url.bucket, Key=self._key, UploadId=upload_id))

    def _finish(self) -> None:
        self._done = True
        self._buffer = bytearray()
        self._pending.clear()
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    @property
    def written_bytes(self) -> int:
        return self._written_bytes

    def __enter__(self) -> S3Writer:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self._done:
            self.abort()
