"""``split``/``convert hf://... --no-cache``: tensor bytes streamed by range reads straight into the shards.

The header-only mirror (:mod:`shardkit.hub.remote`) gives the local readers everything they
validate: headers, indexes, file sizes. :class:`MirrorStreams` gives each of its safetensors files a
:class:`~shardkit.formats.ranges.RangeFile` (:class:`StreamedRange`) whose reads fetch the ranges
from the Hub, so the source opened on the mirror (a :class:`~shardkit.sources.ranged.RangedCheckpoint`)
reads tensor bytes from there instead of from the sparse files, and the writer knows only a
source: each file is read front to back in windows of ``WINDOW_BYTES``, ``PREFETCH_WINDOWS`` of them
in flight on worker threads, so memory stays bounded whatever the checkpoint's size and nothing
is written to the HF cache.

Why front to back with a digest: every byte of a file is fetched once, and a file read whole is
checked against the hash the Hub lists for it (the LFS sha256, or the git blob id of a small
file) before the write can commit. A corrupted transfer or a file replaced mid-read fails the job
and leaves no output. A reader that jumps far ahead (tensors left out by ``--include``) skips the
gap instead of fetching it, and that file's digest is not checked.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

from ..errors import HubError, ShardkitError
from ..workers import ReadPool
from .remote import read_range
from .remote_errors import describe_read_error
from .remote_spec import Mirror, RemoteFile, local_path

logger = logging.getLogger("shardkit")

WINDOW_BYTES = 8 << 20  # one range request (the client holds it about twice while receiving)
PREFETCH_WINDOWS = 4  # requests in flight per file: latency hidden, memory bounded
SKIP_GAP_BYTES = WINDOW_BYTES  # a jump further than this ahead skips the gap rather than fetching it
PENDING_HASHES = 2  # windows waiting for the hashing thread
STOP_WAIT_SECONDS = 15.0  # close() waits this long for requests in flight (a stalled one times out in 10 s)


class _Digest:
    """The Hub's hash of a whole file: sha256 for LFS files, the git blob id (sha1) for the rest.

    Hashing runs on the source's one hashing thread, in order (hashlib releases the GIL on large
    buffers), so it overlaps with the writes instead of adding to them; at most ``PENDING_HASHES``
    windows wait for it, so a slow hash holds back the reader rather than piling windows up.
    """

    def __init__(self, remote: RemoteFile, hasher: ThreadPoolExecutor) -> None:
        self.expected = remote.sha256 or remote.blob_id
        self.kind = "sha256" if remote.sha256 else "git blob id"
        self.hash: hashlib._Hash = hashlib.sha256() if remote.sha256 else hashlib.sha1(b"blob %d\0" % remote.size_bytes)
        self.hasher = hasher
        self.pending: deque[Future[None]] = deque()

    def update(self, data: bytes) -> None:
        while len(self.pending) >= PENDING_HASHES:
            self.pending.popleft().result()
        self.pending.append(self.hasher.submit(self.hash.update, data))

    def matches(self) -> bool:
        while self.pending:
            self.pending.popleft().result()
        return self.hash.hexdigest() == self.expected


class StreamedFile:
    """Sequential, prefetched range reads of one remote file, digested as they pass.

    Args:
        mirror: the header-only mirror the file belongs to.
        remote: the file as the Hub lists it.
        head: its first bytes, the header at least (already fetched for the mirror): the stream
            starts after them, and reads inside them are served from them.
        token: the Hub token.
        pool: worker threads for the range requests.
        hasher: the one thread that hashes, in order.
    """

    def __init__(self, mirror: Mirror, remote: RemoteFile, head: bytes, *, token: str | None,
                 pool: ReadPool, hasher: ThreadPoolExecutor) -> None:
        self.mirror, self.remote, self.token, self.pool = mirror, remote, token, pool
        self.where = f"{mirror.spec}:{remote.path}"
        self.digest: _Digest | None = _Digest(remote, hasher)
        self.digest.update(head)
        self.digested_bytes = len(head)
        self.next_bytes = len(head)  # where the next window to schedule starts
        self.queue: deque[tuple[int, Future[bytes]]] = deque()
        self.window: tuple[int, bytes] = (0, head)
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

    def _window_at(self, at: int) -> tuple[int, bytes]:
        start, data = self.window
        if start <= at < start + len(data):
            return self.window
        if at < start:  # behind the stream: an out-of-order reader; served, but the file is not digested
            self._stop_digest("a tensor was read out of file order")
            return at, self._fetch(at, min(at + WINDOW_BYTES, self.remote.size_bytes))
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
        size = self.remote.size_bytes
        while len(self.queue) < PREFETCH_WINDOWS and self.next_bytes < size:
            end = min(self.next_bytes + WINDOW_BYTES, size)
            self.queue.append((self.next_bytes, self.pool.submit(partial(self._fetch, self.next_bytes, end))))
            self.next_bytes = end
        if not self.queue:
            raise HubError(f"{self.where}: read past the end of the {self.remote.size_bytes}-byte file the Hub lists "
                           "(a header that lies about its tensors)")

    def _skip_to(self, at: int) -> None:
        for _, future in self.queue:
            future.cancel()
        self.queue.clear()
        self.next_bytes = at
        self._stop_digest("tensors left out of the output were skipped")

    def _digest(self, start: int, data: bytes) -> None:
        if self.digest is None or start != self.digested_bytes:
            return
        self.digest.update(data)
        self.digested_bytes += len(data)
        self._check_if_whole()

    def _check_if_whole(self) -> None:
        """Once every byte passed through the digest, it must be the hash the Hub lists."""
        if self.digest is None:
            return
        if self.digested_bytes == self.remote.size_bytes and not self.digest.matches():
            raise HubError(f"{self.where}: the bytes received do not match the {self.digest.kind} the Hub lists "
                           f"({self.digest.expected[:12]}...): the transfer was corrupted or the file changed "
                           "while it was read; nothing was written, try again")
        if self.digested_bytes == self.remote.size_bytes:
            logger.debug("%s: %s checked", self.where, self.digest.kind)

    def _stop_digest(self, why: str) -> None:
        if self.digest is not None:
            logger.debug("%s: not checked against the Hub's hash: %s", self.where, why)
        self.digest = None

    def _fetch(self, begin: int, end: int) -> bytes:
        try:
            return read_range(self.mirror, self.remote, begin, end, token=self.token, stop=self.pool.stopping)
        except ShardkitError:
            raise
        except Exception as e:  # one line, whatever thread and whichever layer the failure surfaces in
            message = describe_read_error(e, self.mirror.spec)
            if message is None:
                raise
            raise HubError(message) from e

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

    def __init__(self, streams: MirrorStreams, stream: StreamedFile) -> None:
        self._streams, self._stream = streams, stream

    @property
    def name(self) -> str:
        return self._stream.where

    @property
    def size_bytes(self) -> int:
        return self._stream.remote.size_bytes

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
        """Nothing to close: the streams' threads are :class:`MirrorStreams`'."""


class MirrorStreams:
    """The streamed files of one header-only mirror: the ``open_file`` of a
    :class:`~shardkit.sources.ranged.RangedCheckpoint` whose tensor bytes come from the Hub.

    Each safetensors file the mirror lists is read front to back in prefetched windows on one
    pool, hashed on one thread; ``close`` stops both (bounded).

    with open_mirror(spec) as mirror, MirrorStreams(mirror) as streams:
        split(RangedCheckpoint(mirror.root, streams.open_file, name=str(spec), read_ahead=False), "out/")
    """

    def __init__(self, mirror: Mirror, *, token: str | None = None) -> None:
        self.mirror, self.token = mirror, token
        self.pool = ReadPool(PREFETCH_WINDOWS, name="shardkit-stream")
        self.hasher = ThreadPoolExecutor(1, thread_name_prefix="shardkit-hash")
        self.remote_files = {os.path.realpath(local_path(mirror, f)): f for f in mirror.files.values()}
        self.streams: dict[str, StreamedFile] = {}
        self.current: StreamedFile | None = None
        self.lock = threading.Lock()

    def open_file(self, local: str) -> StreamedRange:
        """The stream of the mirror file at ``local``; a file the Hub does not list as safetensors
        weights is one line (only those are streamed)."""
        with self.lock:
            return StreamedRange(self, self._stream(local))

    def _stream(self, local: str) -> StreamedFile:
        key = os.path.realpath(local)
        if key not in self.streams:
            remote = self.remote_files.get(key)
            if remote is None or remote.path not in self.mirror.prefix_bytes:
                raise HubError(f"{self.mirror.spec}: {local.replace(self.mirror.root, str(self.mirror.spec))} is not "
                               "a listed safetensors file; only safetensors weights can be streamed (drop cache=False)")
            with open(local, "rb") as f:  # the real bytes fetched for the mirror; the rest is a hole
                head = f.read(self.mirror.prefix_bytes[remote.path])
            self.streams[key] = StreamedFile(self.mirror, remote, head, token=self.token, pool=self.pool,
                                             hasher=self.hasher)
        return self.streams[key]

    def reading(self, stream: StreamedFile) -> None:
        """``stream`` is read now: the previous file's windows are released (call with ``lock`` held)."""
        if self.current is not None and self.current is not stream:
            self.current.release()
        self.current = stream

    def close(self) -> None:
        """Drop every window and stop the requests in flight and the hashing thread (bounded)."""
        for stream in self.streams.values():
            stream.release()
        # Requests in flight see ``stopping``, give up retrying and end within the download timeout.
        self.pool.close(timeout_s=STOP_WAIT_SECONDS)
        self.hasher.shutdown(wait=True, cancel_futures=True)  # at most one window's hash is running

    def __enter__(self) -> MirrorStreams:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
