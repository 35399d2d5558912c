"""One interface for remote stores: list a prefix, stat, read ranges in parallel, write by multipart, publish last.

A store is opened on a folder (``s3://BUCKET/PREFIX``); every name it takes or returns is
relative to that folder, checked by :meth:`~shardkit.stores.urls.StoreUrl.key` before it becomes
a key, so a listing or an index from elsewhere never makes it touch an object outside the prefix.

- :class:`ObjectStore`: what an implementation provides (``s3.S3Store`` today; the ``hf://``
  range reader maps onto ``list``/``stat``/``read_into`` too).
- :class:`RemoteObject`: one object as a :class:`~shardkit.formats.ranges.RangeFile`, so the
  readers read a remote shard the way they read a local file.
- :func:`read_ranges`: many ranges (of one or many objects) on a bounded pool of threads, large
  ones cut into parts, every byte count checked.
- :class:`ObjectWriter`: a multipart upload, streamed with bounded memory; ``commit`` makes the
  object visible, ``abort`` (also on any error) leaves nothing behind.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

from ..errors import StoreError
from ..workers import ReadPool
from .urls import StoreUrl

__all__ = ["MAX_OBJECT_BYTES", "Digest", "ObjectInfo", "ObjectStore", "ObjectWriter", "PendingUpload", "RangeRequest", "RemoteObject",
           "read_ranges"]

PART_BYTES = 16 << 20  # one ranged GET (measured: 16 × 16 MiB in flight reach the loopback limit, docs/s3.md)
READ_THREADS = 16
MAX_OBJECT_BYTES = 5 << 40  # S3's limit for one object (5 TiB): a larger listed or stated size is a lie


Digest = tuple[str, str]  # (kind, hex): ("sha256", ...) or ("git blob id", ...), as a store lists it


@dataclass(frozen=True)
class ObjectInfo:
    """An object under the store's prefix: ``name`` relative to it, its size and entity tag, and the
    digest of its bytes where the store lists one (the Hub does; S3's entity tags are not digests)."""

    name: str
    size_bytes: int
    etag: str = ""
    digest: Digest | None = None


@dataclass(frozen=True)
class PendingUpload:
    """A multipart upload started under the prefix and neither completed nor aborted."""

    name: str
    upload_id: str


class ObjectWriter(Protocol):
    """A streamed multipart upload of one object (bounded memory: full parts are sent as they fill)."""

    name: str

    def write(self, data: bytes | memoryview) -> None: ...

    def commit(self) -> ObjectInfo:
        """Complete the upload: the object appears whole under its name, with the size written."""
        ...

    def abort(self) -> None:
        """Abort the upload (idempotent; nothing of it stays in the store)."""
        ...

    def __enter__(self) -> ObjectWriter: ...

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None: ...


class ObjectStore(Protocol):
    """A folder of objects in a remote store."""

    url: StoreUrl

    def list_objects(self, folder: str = "") -> list[ObjectInfo]:
        """Every object under ``folder`` (the whole prefix by default), recursively, sorted by name."""
        ...

    def stat(self, name: str) -> ObjectInfo:
        """One object's size and entity tag; a missing object raises ``SourceNotFoundError``."""
        ...

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the object's bytes at ``offset`` (one ranged request, retried), from the version
        listed or stated (an object replaced since fails in one line instead of mixing two versions)."""
        ...

    def download_command(self, name: str) -> str:
        """The command line that fetches object ``name`` by hand with the store's own tool (for a message)."""
        ...

    def put(self, name: str, data: bytes) -> ObjectInfo:
        """Write a small object in one request (an index or manifest, published last)."""
        ...

    def writer(self, name: str) -> ObjectWriter:
        """Start a multipart upload of ``name``."""
        ...

    def delete(self, names: Sequence[str]) -> None:
        """Delete objects (missing ones are no error)."""
        ...

    def pending_uploads(self) -> list[PendingUpload]:
        """Multipart uploads under the prefix never completed or aborted (what ``recover`` aborts)."""
        ...

    def abort(self, upload: PendingUpload) -> None:
        """Abort one pending multipart upload."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> ObjectStore: ...

    def __exit__(self, *exc: object) -> None: ...


class RemoteObject:
    """One object of a store as a :class:`~shardkit.formats.ranges.RangeFile`."""

    def __init__(self, store: ObjectStore, info: ObjectInfo) -> None:
        self._store = store
        self._info = info
        self._name = str(store.url.child(info.name))

    @property
    def name(self) -> str:
        return self._name

    @property
    def size_bytes(self) -> int:
        return self._info.size_bytes

    def read_into(self, offset: int, out: memoryview) -> None:
        if offset < 0 or offset + len(out) > self._info.size_bytes:
            raise StoreError(f"{self._name}: bytes {offset}-{offset + len(out) - 1} are past its end "
                             f"({self._info.size_bytes} bytes)")
        if len(out):
            self._store.read_into(self._info.name, offset, out)

    def close(self) -> None:
        pass  # the store owns the connections


@dataclass(frozen=True)
class RangeRequest:
    """``out`` to be filled with the bytes of object ``name`` at ``offset``."""

    name: str
    offset: int
    out: memoryview


def read_ranges(store: ObjectStore, requests: Sequence[RangeRequest], *, threads: int = READ_THREADS,
                part_bytes: int = PART_BYTES) -> None:
    """Fill every request's ``out``, ``threads`` ranged requests in flight, each at most ``part_bytes``.

    On the first failure the requests not started are cancelled, the running ones are waited for
    (the pool is closed with its bound) and the failure is raised as it was.
    """
    parts = [RangeRequest(r.name, r.offset + begin, r.out[begin:begin + part_bytes])
             for r in requests for begin in range(0, len(r.out), part_bytes)]
    if not parts:
        return
    pool = ReadPool(min(threads, len(parts)), name="shardkit-store-read")
    try:
        futures: list[Future[None]] = [
            pool.submit(functools.partial(store.read_into, p.name, p.offset, p.out)) for p in parts]
        for future in futures:
            future.result()
    finally:
        pool.close()
