"""Byte ranges of one file for a source (``split``, ``convert``, ``verify``): read in parallel, and
read ahead while they come in file order.

A source's caller asks for one range at a time and uses it before asking for the next (the
writer's casts, ``verify``'s comparisons), so each request alone would be one synchronous read.
:class:`RangeReads` reads through the same :class:`~shardkit.reading.readers.Reader` as
``shardkit.open`` (``pread``, ``direct`` or a :class:`~shardkit.formats.ranges.RangeFile`), on one
shared :class:`~shardkit.workers.ReadPool`: a request is cut into the reader's chunks, all in
flight at once, and once requests follow each other in file order the next pieces of the file
(``ahead_bytes`` of them) are read ahead while the caller works on the current one. Pieces are
page-aligned blocks of fresh memory, so ``direct`` reads land in them without a bounce copy; a
request inside one piece is a view of it (no copy). Memory stays bounded by ``ahead_bytes`` plus one
piece.

    reads = RangeReads(open_reader(path, "pread"), pool, size_bytes=os.path.getsize(path))
    data = reads.read(offset, nbytes, where="model.safetensors: tensor 'w'")
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from concurrent.futures import Future
from typing import Protocol

from ..errors import HeaderError
from ..workers import ReadPool
from .prefetch import submit_reads, wait_all
from .readers import Reader, ReadJob

AHEAD_BYTES = 64 << 20  # read ahead of a sequential reader, per file
_PAGE = mmap.PAGESIZE
_MAX_CALL_BYTES = 1 << 30  # Linux returns at most ~2 GiB per read call


class FileReads(Protocol):
    """How a source reads one file's byte ranges: :class:`RangeReads` or :class:`CachedReads`."""

    def read(self, offset: int, nbytes: int, *, where: str) -> bytes | memoryview: ...

    def views(self, offset: int, nbytes: int, *, where: str) -> list[memoryview]: ...

    def close(self) -> None: ...


class CachedReads:
    """Reads of a local file whose pages are cached (where ``read="auto"`` maps it): one ``pread`` per
    request on the caller's thread, a copy from the page cache that threads, fresh blocks and
    read-ahead only slow down (measured: ``split --dtype bf16`` of a warm 1.2 GB file 11.4 s this way,
    15.2 s through :class:`RangeReads`)."""

    def __init__(self, fd: int, *, size_bytes: int) -> None:
        self.fd, self.size_bytes = fd, size_bytes

    def read(self, offset: int, nbytes: int, *, where: str) -> bytes:
        """Exactly ``nbytes`` at ``offset``, or :class:`HeaderError` naming ``where``."""
        parts = [os.pread(self.fd, min(_MAX_CALL_BYTES, nbytes - at), offset + at)
                 for at in range(0, nbytes, _MAX_CALL_BYTES)]
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        if len(data) != nbytes:
            raise HeaderError(f"{where} is truncated (got {len(data)} of {nbytes} bytes at offset {offset}; file "
                              "shrank while reading?); restore the file, or convert from an intact copy")
        return data  # bytes: a caller's bytes() of it is no copy

    def views(self, offset: int, nbytes: int, *, where: str) -> list[memoryview]:
        return [memoryview(self.read(offset, nbytes, where=where))] if nbytes else []

    def close(self) -> None:
        """Nothing to release: the descriptor is the source's."""


class _Piece:
    """``nbytes`` of the file at ``offset`` being read into a fresh page-aligned block."""

    def __init__(self, reader: Reader, pool: ReadPool, offset: int, nbytes: int, where: str) -> None:
        self.offset, self.nbytes = offset, nbytes
        self.block = mmap.mmap(-1, max(_PAGE, -(-nbytes // _PAGE) * _PAGE))
        anchor = ctypes.c_char.from_buffer(self.block)
        job = ReadJob(ctypes.addressof(anchor), offset, nbytes, where, padded=offset % _PAGE == 0)
        del anchor
        self.futures: list[Future[None]] = submit_reads(pool, reader, [job], keep=self.block,
                                                        chunk_bytes=reader.chunk_bytes)

    def view(self, start: int, stop: int) -> memoryview:
        """Bytes ``[start, stop)`` of the file (inside this piece), once read."""
        wait_all(self.futures)
        if any(future.cancelled() for future in self.futures):  # never a block that was not filled
            raise RuntimeError(f"read of bytes {self.offset}-{self.offset + self.nbytes} was cancelled")
        return memoryview(self.block)[start - self.offset: stop - self.offset]

    def cancel(self) -> None:
        for future in self.futures:
            future.cancel()


class RangeReads:
    """Reads of one file's byte ranges: exact ranges in parallel, sequential ones read ahead.

    Args:
        reader: the file's reader (its ``chunk_bytes`` is the piece and request size).
        pool: the threads that keep the reads in flight (shared by every file of a source).
        size_bytes: the file's length: read-ahead stops there, a request past it is refused.
        ahead_bytes: how far past a sequential request to read ahead (0: never).
    """

    def __init__(self, reader: Reader, pool: ReadPool, *, size_bytes: int, ahead_bytes: int = AHEAD_BYTES) -> None:
        self.reader, self.pool, self.size_bytes = reader, pool, size_bytes
        self.piece_bytes = max(_PAGE, reader.chunk_bytes // _PAGE * _PAGE)
        self.ahead_pieces = ahead_bytes // self.piece_bytes
        self._pieces: dict[int, _Piece] = {}  # piece index (from ``_origin``) → piece: the read-ahead window
        self._origin = 0  # where the window's pieces start counting: the first sequential request's
        # offset (its page for ``direct``, whose in-place reads need page-aligned offsets), so no byte
        # before it (the header, a tensor already read) is fetched again
        self._align = _PAGE if reader.backend == "direct" else 1
        self._last_end: int | None = None
        self._lock = threading.Lock()

    def read(self, offset: int, nbytes: int, *, where: str) -> memoryview:
        """Exactly ``nbytes`` at ``offset``: a view of one piece, or one joined copy."""
        parts = self.views(offset, nbytes, where=where)
        if len(parts) == 1:
            return parts[0]
        return memoryview(b"".join(parts))

    def views(self, offset: int, nbytes: int, *, where: str) -> list[memoryview]:
        """Bytes ``[offset, offset + nbytes)`` as views of the pieces that hold them, in order (read)."""
        end = offset + nbytes
        if end > self.size_bytes:
            raise HeaderError(f"{where}: bytes {offset}-{end} lie past the end of the {self.size_bytes}-byte file "
                              "(truncated or changed on disk?)")
        if nbytes == 0:
            return []
        with self._lock:  # held while waiting: no other request can cancel a piece being waited for
            sequential = offset == self._last_end or (offset >= self._origin and self._index(offset) in self._pieces)
            self._last_end = end
            if not sequential or not self.ahead_pieces:
                self._drop(below=None)
                pieces = [_Piece(self.reader, self.pool, offset, nbytes, where)]
            else:
                if not self._pieces:
                    self._origin = offset - offset % self._align
                pieces = self._window(offset, end, where)
            views = [piece.view(max(offset, piece.offset), min(end, piece.offset + piece.nbytes)) for piece in pieces]
            self._drop(below=self._index(end - 1))  # the last piece may hold the next request's start
            return views

    def _window(self, offset: int, end: int, where: str) -> list[_Piece]:
        """The pieces covering ``[offset, end)``, the next ``ahead_pieces`` submitted behind them."""
        first, last = self._index(offset), self._index(end - 1)
        self._drop(below=first)
        limit = -(-(self.size_bytes - self._origin) // self.piece_bytes)
        for index in range(first, min(limit, last + 1 + self.ahead_pieces)):
            if index not in self._pieces:
                start = self._origin + index * self.piece_bytes
                stop = min(self.size_bytes, start + self.piece_bytes)
                self._pieces[index] = _Piece(self.reader, self.pool, start, stop - start, where)
        return [self._pieces[i] for i in range(first, last + 1)]

    def _index(self, offset: int) -> int:
        return (offset - self._origin) // self.piece_bytes

    def _drop(self, *, below: int | None) -> None:
        """Forget the pieces before index ``below`` (all of them when None), cancelling their reads."""
        for index in [i for i in self._pieces if below is None or i < below]:
            self._pieces.pop(index).cancel()

    def close(self) -> None:
        """Cancel the read-ahead and close the reader (the pool is the caller's)."""
        with self._lock:
            self._drop(below=None)
        self.reader.close()
