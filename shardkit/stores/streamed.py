"""Objects read front to back and checked against the digest their store lists: the checked range-file opener.

The header-only mirror (:mod:`shardkit.stores.mirror`) gives the local readers everything they
validate: headers, indexes, file sizes. :class:`StreamedObjects` gives each of its safetensors
objects whose store lists a digest (the Hub: the LFS sha256 or git blob id) a
:class:`~shardkit.formats.ranges.RangeFile` (:class:`StreamedRange`) whose reads fetch the ranges
from the store, so the source opened on the mirror reads tensor bytes from there, and the writer
knows only a source: each object is read front to back in windows of ``WINDOW_BYTES``,
``PREFETCH_WINDOWS`` of them in flight on worker threads, so memory stays bounded whatever the
checkpoint's size and nothing is written to a cache (``split``/``convert`` of ``hf://`` with ``cache=False``).

Why front to back with a digest: every byte of an object is fetched once, and an object read whole
is checked against the digest its store lists before the write can commit. A corrupted transfer or a file replaced mid-read fails the job
and leaves no output. A reader that jumps far ahead (tensors left out by ``--include``) skips the
gap instead of fetching it, and that file's digest is not checked.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

from ..errors import HubError, Option
from ..formats.links import open_inside
from ..workers import ReadPool
from .base import ObjectInfo, ObjectStore
from .mirror import HeaderMirror

__all__ = ["StreamedFile", "StreamedObjects", "StreamedRange"]

logger = logging.getLogger("shardkit")

WINDOW_BYTES = 8 << 20  # one range request (the client holds it about twice while receiving)
PREFETCH_WINDOWS = 4  # requests in flight per file: latency hidden, memory bounded
SKIP_GAP_BYTES = WINDOW_BYTES  # a jump further than this ahead skips the gap rather than fetching it
PENDING_HASHES = 2  # windows waiting for the hashing thread
STOP_WAIT_SECONDS = 15.0  # close() waits this long for requests in flight (a stalled one times out in 10 s)


class _Digest:
    """The digest a store lists for a whole object: a sha256, or a git blob id (sha1 of a header and the bytes).

    Hashing runs on the source's one hashing thread, in order (hashlib releases the GIL on large
    buffers), so it overlaps with the writes instead of adding to them; at most ``PENDING_HASHES``
    windows wait for it, so a slow hash holds back the reader rather than piling windows up.
    """

    def __init__(self, kind: str, expected: str, size_bytes: int, hasher: ThreadPoolExecutor) -> None:
        self.kind, self.expected = kind, expected
        self.hash: hashlib._Hash = hashlib.sha256() if kind == "sha256" else hashlib.sha1(b"blob %d\0" % size_bytes)
        self.hasher = hasher
        self.pending: deque[Future[None]] = deque()

    def update(self, data: bytes | bytearray) -> None:
        while len(self.pending) >= PENDING_HASHES:
            self.pending.popleft().result()
        self.pending.append(self.hasher.submit(self.hash.update, data))

    def matches(self) -> bool:
        while self.pending:
            self.pending.popleft().result()
        return self.hash.hexdigest() == self.expected


class StreamedFile:
    """Sequential, prefetched range reads of one object, digested as they pass.

    Args:
        store: the store the object is read from.
        info: the object as the store lists it (its ``digest`` is checked; None: nothing to check).
        head: its first bytes, the header at least (already fetched for the mirror): the stream
            starts after them, and reads inside them are served from them.
        pool: worker threads for the range requests.
        hasher: the one thread that hashes, in order.
    """

    def __init__(self, store: ObjectStore, info: ObjectInfo, head: bytes, *, pool: ReadPool,
                 hasher: ThreadPoolExecutor) -> None:
        self.store, self.info, self.pool = store, info, pool
        self.size_bytes = info.size_bytes
        self.where = f"{store.url}:{info.name}"
        self.digest = _Digest(*info.digest, info.size_bytes, hasher) if info.digest else None
        if self.digest is not None:
            self.digest.update(head)
        self.digested_bytes = len(head)
        self.next_bytes = len(head)  # where the next window to schedule starts
        self.queue: deque[tuple[int, Future[bytearray]]] = deque()
        self.window: tuple[int, bytes | bytearray] = (0, head)
        self._check_if_whole()  # a file that fit in its first range is complete already

    def read(self, begin: int, end: int) -> bytes | memoryview:
        """Bytes ``[begin, end)`` of the file (absolute offsets): a view of one window, or one joined copy."""
        parts = list(self.views(begin, end))
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def views(self, begin: int, end: int) -> Iterator[memoryview]:
        """Bytes ``[begin, end)`` as views of the windows that hold them, in order."""
        at = begin
        while at < end:
            start, data = self._window_at(at)
            part = memoryview(data)[at - start: end - start]
            yield part
            at += len(part)

    def _window_at(self, at: int) -> tuple[int, bytes | bytearray]:
        start, data = self.window
        if start <= at < start + len(data):
            return self.window
        if at < start:  # behind the stream: an out-of-order reader; served, but the file is not digested
            self._stop_digest("a tensor was read out of file order")
            return at, self._fetch(at, min(at + WINDOW_BYTES, self.size_bytes))
        if at >= self.next_bytes + SKIP_GAP_BYTES:
            self._skip_to(at)
        while True:
            self._fill_queue()
            start, future = self.queue.popleft()
            data = future.result()
            self._digest(start, data)
            self.window = (start, data)
            if at < start + len(data):
                return self.window

    def _fill_queue(self) -> None:
        size = self.size_bytes
        while len(self.queue) < PREFETCH_WINDOWS and self.next_bytes < size:
            end = min(self.next_bytes + WINDOW_BYTES, size)
            self.queue.append((self.next_bytes, self.pool.submit(partial(self._fetch, self.next_bytes, end))))
            self.next_bytes = end
        if not self.queue:
            raise HubError(f"{self.where}: read past the end of the {self.size_bytes}-byte file its store lists "
                           "(a header that lies about its tensors)")

    def _skip_to(self, at: int) -> None:
        for _, future in self.queue:
            future.cancel()
        self.queue.clear()
        self.next_bytes = at
        self._stop_digest("tensors left out of the output were skipped")

    def _digest(self, start: int, data: bytes | bytearray) -> None:
        if self.digest is None or start != self.digested_bytes:
            return
        self.digest.update(data)
        self.digested_bytes += len(data)
        self._check_if_whole()

    def _check_if_whole(self) -> None:
        """Once every byte passed through the digest, it must be the one the store lists."""
        if self.digest is None:
            return
        if self.digested_bytes == self.size_bytes and not self.digest.matches():
            raise HubError(f"{self.where}: the bytes received do not match the {self.digest.kind} listed for it "
                           f"({self.digest.expected[:12]}...): the transfer was corrupted or the file changed "
                           "while it was read; nothing was written, try again")
        if self.digested_bytes == self.size_bytes:
            logger.debug("%s: %s checked", self.where, self.digest.kind)

    def _stop_digest(self, why: str) -> None:
        if self.digest is not None:
            logger.debug("%s: not checked against its listed digest: %s", self.where, why)
        self.digest = None

    def _fetch(self, begin: int, end: int) -> bytearray:
        out = bytearray(end - begin)  # the store's errors are one line already, whatever thread they surface in
        self.store.read_into(self.info.name, begin, memoryview(out))
        return out

    def release(self) -> None:
        """Drop the windows held and in flight (the reader moved on to another file). A later read
        of this file is still served: after the dropped window it goes on with the hash check,
        inside it the bytes are fetched again and the file is not hash-checked."""
        for _, future in self.queue:
            future.cancel()
        self.queue.clear()
        start, data = self.window
        self.next_bytes = start + len(data)
        self.window = (self.next_bytes, b"")


class StreamedRange:
    """One streamed file as a :class:`~shardkit.formats.ranges.RangeFile`: what the source's readers
    fill memory through. Requests come one at a time (the source reads these files with
    ``read_ahead=False``); reading one file releases the windows of the file read before, so memory
    stays bounded by one file's prefetch however many files there are."""

    def __init__(self, streams: StreamedObjects, stream: StreamedFile) -> None:
        self._streams, self._stream = streams, stream

    @property
    def name(self) -> str:
        return self._stream.where

    @property
    def size_bytes(self) -> int:
        return self._stream.size_bytes

    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` from the windows holding bytes ``offset ..`` (fetched in order, hash-checked)."""
        with self._streams.lock:
            self._streams.reading(self._stream)
            at = 0
            for part in self._stream.views(offset, offset + len(out)):
                out[at:at + len(part)] = part
                at += len(part)
        if at != len(out):
            raise HubError(f"{self.name}: got {at} of the {len(out)} bytes at offset {offset}")

    def close(self) -> None:
        """Nothing to close: the streams' threads are :class:`StreamedObjects`'."""


class StreamedObjects:
    """The streamed objects of one header-only mirror: the ``open_file`` of a
    :class:`~shardkit.sources.ranged.RangedCheckpoint` whose tensor bytes come from the store, checked.

    Each safetensors object the mirror lists is read front to back in prefetched windows on one
    pool, hashed on one thread; ``close`` calls ``stop`` (the store's reads still retrying give up),
    then stops both (bounded).

    with StreamedObjects(store, mirror, stop=store.close) as streams:
        split(RangedCheckpoint(mirror.root, streams.open_file, read_ahead=False), "out/")
    """

    def __init__(self, store: ObjectStore, mirror: HeaderMirror, *, stop: Callable[[], None] | None = None) -> None:
        self.store, self.mirror, self._stop = store, mirror, stop
        self.pool = ReadPool(PREFETCH_WINDOWS, name="shardkit-stream")
        self.hasher = ThreadPoolExecutor(1, thread_name_prefix="shardkit-hash")
        self.streams: dict[str, StreamedFile] = {}
        self.current: StreamedFile | None = None
        self.lock = threading.Lock()

    def open_file(self, local: str) -> StreamedRange:
        """The stream of the mirror file at ``local``; one that is not a listed safetensors object is one line."""
        with self.lock:
            return StreamedRange(self, self._stream(local))

    def _stream(self, local: str) -> StreamedFile:
        name = os.path.relpath(local, self.mirror.root).replace(os.sep, "/")
        if name not in self.streams:
            info = self.mirror.objects.get(name)
            if info is None or name not in self.mirror.prefix_bytes:
                raise HubError(f"{self.store.url}: {name} is not a listed safetensors file; only safetensors "
                               "weights can be streamed (drop ", Option("cache", False), ")")
            fd = open_inside(self.mirror.root, name, where=str(self.store.url))
            try:  # the real bytes fetched for the mirror; the rest is a hole
                head = os.pread(fd, self.mirror.prefix_bytes[name], 0)
            finally:
                os.close(fd)
            self.streams[name] = StreamedFile(self.store, info, head, pool=self.pool, hasher=self.hasher)
        return self.streams[name]

    def reading(self, stream: StreamedFile) -> None:
        """``stream`` is read now: the previous file's windows are released (call with ``lock`` held)."""
        if self.current is not None and self.current is not stream:
            self.current.release()
        self.current = stream

    def close(self) -> None:
        """Drop every window and stop the requests in flight and the hashing thread (bounded)."""
        for stream in self.streams.values():
            stream.release()
        if self._stop is not None:  # requests retrying give up; each running one ends within its timeout
            self._stop()
        self.pool.close(timeout_s=STOP_WAIT_SECONDS)
        self.hasher.shutdown(wait=True, cancel_futures=True)  # at most one window's hash is running

    def __enter__(self) -> StreamedObjects:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
