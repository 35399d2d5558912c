"""Stream tensors from a source into one safetensors file, in bounded memory.

Bytes that already lie in a file are copied kernel-side with ``os.copy_file_range``, adjacent
tensors coalesced into one call; everything else moves through fixed-size chunks. Casting is a
chunked transform too, so memory never depends on the size of the largest tensor.
"""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass
from typing import Callable, Iterator

from .. import _faults
from ..atomic.journal import fsync_dir as _fsync_path  # fsync works the same on a file
from ..errors import InvalidInputError, ShardkitWriteError, describe_os_error
from ..formats.header import TensorEntry, build_header
from ..sources.base import Source
from ..units import tensor_nbytes

CHUNK_BYTES = 64 * 2**20
CAST_CHUNK_BYTES = 16 * 2**20
COPY_CALL_BYTES = 256 * 2**20  # one copy_file_range call; bounds the time between progress ticks
CASTABLE = frozenset({"F64", "F32", "F16", "BF16"})
ProgressFn = Callable[[int], None]


@dataclass(frozen=True)
class TensorWrite:
    """Where one tensor's bytes go in a shard (``out``) and what they are produced from (``src``).

    Equal dtypes mean a byte copy (kernel-side when ``src`` lies in a file); different dtypes
    mean a chunked cast.
    """

    src: TensorEntry
    out: TensorEntry


def tensor_write(entry: TensorEntry, cast_to: str | None) -> TensorWrite:
    """Decide the output dtype of one tensor: float tensors are cast, others kept as stored.

    >>> tensor_write(TensorEntry("w", "F32", (2,), 8), "BF16").out.nbytes
    4
    """
    if cast_to is None or entry.dtype not in CASTABLE or entry.dtype == cast_to:
        return TensorWrite(entry, TensorEntry(entry.name, entry.dtype, entry.shape, entry.nbytes))
    return TensorWrite(entry, TensorEntry(entry.name, cast_to, entry.shape, tensor_nbytes(cast_to, entry.shape)))


class ByteCounter:
    """Turns per-chunk byte counts into ``progress(done_bytes, total_bytes)`` calls."""

    def __init__(self, total_bytes: int, progress: "Callable[[int, int], None] | None") -> None:
        self.total_bytes = total_bytes
        self.done_bytes = 0
        self._progress = progress

    def __call__(self, n: int) -> None:
        self.done_bytes += n
        if self._progress is not None:
            self._progress(self.done_bytes, self.total_bytes)


class BackgroundSync:
    """fsync finished files on a worker thread while the next one is written.

    Copying is page-cache speed and flushing is disk speed; overlapping them keeps the disk busy
    the whole time instead of idling while the next shard is copied. :meth:`wait` must return
    before anything that names these files is published.
    """

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardkit-fsync")
        self._pending: list[tuple[str, object]] = []

    def submit(self, path: str) -> None:
        self._pending.append((path, self._pool.submit(_fsync_path, path)))

    def wait(self) -> None:
        """Block until every submitted file is on disk; raise the first failure."""
        pending, self._pending = self._pending, []
        for path, future in pending:
            try:
                future.result()  # type: ignore[attr-defined]
            except OSError as e:
                raise _write_error(path, e) from e

    def __enter__(self) -> "BackgroundSync":
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True)


def write_safetensors(path: str, writes: list[TensorWrite], source: Source, *,
                      metadata: dict[str, str] | None = None, progress: ProgressFn | None = None,
                      sync: BackgroundSync | None = None) -> None:
    """Write ``writes`` to a new file at ``path`` (which must not exist) and fsync it.

    With ``sync``, the fsync is handed to that background worker instead of done in line.
    """
    head, _ = build_header([p.out for p in writes], metadata=dict(sorted((metadata or {}).items())))
    tick = progress or (lambda n: None)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as e:
        raise _write_error(path, e) from e
    try:
        _write_all(fd, head, path)
        for run in _runs(writes):
            _write_run(fd, run, source, path, tick)
        if sync is None:
            os.fsync(fd)
    except OSError as e:
        raise _write_error(path, e) from e
    finally:
        os.close(fd)
    if sync is not None:
        sync.submit(path)
    _faults.point("file-done")


def copy_side_file(src: str, path: str, *, sync: BackgroundSync) -> None:
    """Copy a file that travels with the weights (config, tokenizer...) to a new ``path``.

    Its fsync goes to ``sync`` like a shard's: a side file that is published but still only in
    the page cache could come back empty after a power loss, beside complete shards.
    """
    try:
        shutil.copyfile(src, path)
    except OSError as e:
        raise _write_error(path, e) from e
    sync.submit(path)
    _faults.point("file-done:side-file")


def _runs(writes: list[TensorWrite]) -> Iterator[list[TensorWrite]]:
    """Group writes whose bytes are adjacent in one source file and need no cast."""
    run: list[TensorWrite] = []
    for p in writes:
        copyable = p.src.file is not None and p.src.dtype == p.out.dtype
        if run and copyable and run[-1].src.file == p.src.file and \
                run[-1].src.offset + run[-1].src.nbytes == p.src.offset and run[-1].src.dtype == run[-1].out.dtype:
            run.append(p)
            continue
        if run:
            yield run
        run = [p]
    if run:
        yield run


def _write_run(fd: int, run: list[TensorWrite], source: Source, path: str, tick: ProgressFn) -> None:
    first = run[0]
    if first.src.dtype != first.out.dtype:
        _cast_tensor(fd, first, source, path, tick)
    elif first.src.file is not None:
        _copy_file_range(fd, first.src.file, first.src.offset, sum(p.src.nbytes for p in run), tick, source, run)
    else:
        for begin in range(0, first.src.nbytes, CHUNK_BYTES):
            chunk = source.read(first.src, begin, min(begin + CHUNK_BYTES, first.src.nbytes))
            _write_all(fd, chunk, path)
            tick(len(chunk))


def _copy_file_range(fd: int, src_path: str, offset: int, count: int, tick: ProgressFn,
                     source: Source, run: list[TensorWrite]) -> None:
    held = source.held_fd(src_path)
    src_fd = held if held is not None else os.open(src_path, os.O_RDONLY)
    try:
        done = 0
        while done < count:
            try:
                n = os.copy_file_range(src_fd, fd, min(COPY_CALL_BYTES, count - done), offset + done)
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
                    raise
                _copy_by_chunks(src_fd, fd, offset + done, count - done, tick)
                return
            if n == 0:
                raise InvalidInputError(
                    f"{src_path}: ended early while copying tensor data near {run[0].src.name!r} (file truncated?)"
                )
            done += n
            _faults.point("write:copy", n)
            tick(n)
    finally:
        if held is None:
            os.close(src_fd)


def _copy_by_chunks(src_fd: int, fd: int, offset: int, count: int, tick: ProgressFn) -> None:
    done = 0
    while done < count:
        chunk = os.pread(src_fd, min(CHUNK_BYTES, count - done), offset + done)
        if not chunk:
            raise InvalidInputError("source file ended early while copying tensor data (truncated?)")
        _write_all(fd, chunk, "output")
        done += len(chunk)
        tick(len(chunk))


def _cast_tensor(fd: int, p: TensorWrite, source: Source, path: str, tick: ProgressFn) -> None:
    import torch

    from ..formats.dtypes import to_torch

    src_dtype, out_dtype = to_torch(p.src.dtype), to_torch(p.out.dtype)
    itemsize = src_dtype.itemsize
    step = max(itemsize, CAST_CHUNK_BYTES // itemsize * itemsize)
    for begin in range(0, p.src.nbytes, step):
        raw = bytearray(source.read(p.src, begin, min(begin + step, p.src.nbytes)))
        cast = torch.frombuffer(raw, dtype=src_dtype).to(out_dtype).view(torch.uint8).numpy()
        _write_all(fd, memoryview(cast), path)
        tick(cast.nbytes)  # progress counts output bytes, as the plan's total does


def _write_all(fd: int, data: bytes | memoryview, path: str) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.write(fd, view)
        view = view[written:]
        _faults.point("write", written)


def _write_error(path: str, e: OSError) -> ShardkitWriteError:
    return ShardkitWriteError(f"writing {path} failed: {describe_os_error(e)}; nothing was published")
