"""Stream tensors from a source into one safetensors file, in bounded memory.

Bytes that already lie in a file are copied kernel-side with ``os.copy_file_range``, adjacent
tensors coalesced into one *run* and one call; everything else moves through fixed-size chunks.
Casting is a chunked transform too, so memory never depends on the size of the largest tensor.

Copy-on-write: XFS (reflink), btrfs and other sharing filesystems clone a ``copy_file_range``
range instead of copying it, but only where the source and destination offsets are both
block-aligned. Tensors must tile the data buffer with no gap, so the only free offset is where
the buffer starts, set by padding the header JSON with spaces: each file gets the padding that
puts its *largest* copyable group of runs (runs sharing one source-offset-minus-buffer-offset
class modulo 4096) at the same offset inside a block as in its source, and every copy is issued
as a short head up to the next block boundary, a block-aligned middle (cloned) and a short tail;
heads and tails (and any reads or casts) are written first, the middles last.
A split of one file has one run per shard, so everything but a few KB per shard is cloned; a
merge of the shards of such a split is cloned whole, since their paddings all descend from the
same source; shards from other writers align only their largest run (tensors must tile the
buffer, so runs from differently aligned places cannot all be aligned: a zip pickle stores each
tensor as its own record, so a shard clones its largest tensor's class of runs). On filesystems that cannot
clone the same calls simply copy, and the padding costs under 4 KB per file.
"""

from __future__ import annotations

import errno
import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from .. import _faults
from ..atomic.extents import CLONE_BLOCK_BYTES, shared_bytes_fd
from ..errors import HeaderError, InvalidInputError
from ..formats.header import HEADER_ALIGN_BYTES, TensorEntry, build_header
from ..formats.links import write_fd
from ..sources.base import Source
from ..units import DTYPE_BITS, tensor_nbytes
from .flush import BackgroundSync, write_error

CHUNK_BYTES = 64 * 2**20
CAST_CHUNK_BYTES = 16 * 2**20
COPY_CALL_BYTES = 256 * 2**20  # one copy_file_range call (a block multiple); bounds the time between ticks
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


@dataclass(frozen=True)
class WrittenFile:
    """What :func:`write_safetensors` put on disk.

    Attributes:
        path: the file written.
        file_bytes: its size.
        cloned_bytes: bytes that share extents with another file after the write (copy-on-write
            clones of the source); 0 when nothing was cloned or the filesystem does not tell.
        crc32s: output tensor name → crc32 (8 hex digits) of the bytes written through Python
            (read from the source, or cast), taken as they passed: the manifest need not read
            those tensors back. Tensors copied kernel-side are not in it.
    """

    path: str
    file_bytes: int
    cloned_bytes: int = 0
    crc32s: dict[str, str] = field(default_factory=dict)


def tensor_write(entry: TensorEntry, cast_to: str | None) -> TensorWrite:
    """Decide the output dtype of one tensor: float tensors are cast, others kept as stored.

    >>> tensor_write(TensorEntry("w", "F32", (2,), 8), "BF16").out.nbytes
    4
    """
    if cast_to is None or entry.dtype not in CASTABLE or entry.dtype == cast_to:
        return TensorWrite(entry, TensorEntry(entry.name, entry.dtype, entry.shape, entry.nbytes))
    return TensorWrite(entry, TensorEntry(entry.name, cast_to, entry.shape, tensor_nbytes(cast_to, entry.shape)))


def write_safetensors(path: str, writes: list[TensorWrite], source: Source, *,
                      metadata: dict[str, str] | None = None, progress: ProgressFn | None = None,
                      sync: BackgroundSync | None = None) -> WrittenFile:
    """Write ``writes`` to a new file at ``path`` (which must not exist) and fsync it.

    The header is padded so that copyable bytes can be cloned (see the module docstring).
    With ``sync``, the fsync is handed to that background worker instead of done in line.

    Args:
        path: the file to create.
        writes: every tensor, in file order.
        source: where the bytes come from.
        metadata: the ``__metadata__`` map.
        progress: called with each chunk's byte count.
        sync: the background fsync worker, if any.

    Returns:
        A :class:`WrittenFile` with the bytes cloned rather than copied.

    write_safetensors("out/a.safetensors", writes, src).cloned_bytes
    4999610368
    """
    head, _ = build_header([p.out for p in writes], metadata=dict(sorted((metadata or {}).items())),
                           data_start_mod=clone_alignment(writes))
    tick = progress or (lambda n: None)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as e:
        raise write_error(path, e) from e
    try:
        # The final size first: writes below EOF get no speculative preallocation, which XFS
        # would otherwise leave allocated under the ranges that clones replace.
        os.ftruncate(fd, len(head) + sum(p.out.nbytes for p in writes))
        write_all(fd, head, path)
        crc32s: dict[str, str] = {}
        cloneable = _write_pieces(fd, writes, source, path, tick, data_start=len(head), crc32s=crc32s)
        cloned = _cloned_bytes(fd, len(head)) if cloneable else 0
        file_bytes = os.fstat(fd).st_size
        if sync is None:
            os.fsync(fd)
    except OSError as e:
        raise write_error(path, e) from e
    finally:
        os.close(fd)
    if sync is not None:
        sync.submit(path)
    _faults.point("file-done")
    return WrittenFile(path, file_bytes, cloned, crc32s)


def clone_alignment(writes: list[TensorWrite]) -> int | None:
    """The ``data_start % 4096`` that block-aligns the most copyable bytes with their source.

    Runs whose source offset minus their offset in the buffer fall in one class modulo the
    block are aligned together; the class holding the most bytes wins. A class is skipped when
    it would move a tensor that the default 8-byte padding keeps at a multiple of its item size
    (what zero-copy loaders such as ``torch.frombuffer`` need) off that multiple; a run's own
    tensors keep their source's alignment. None when nothing can be cloned.

    >>> w = TensorWrite(TensorEntry("w", "F32", (2048,), 8192, "a", 1004), TensorEntry("w", "F32", (2048,), 8192))
    >>> clone_alignment([w])
    1004
    """
    weight: dict[int, int] = {}
    begin, need = 0, 1
    for run in _runs(writes):
        first, nbytes = run[0], sum(p.out.nbytes for p in run)
        if first.src.file is not None and first.src.dtype == first.out.dtype and nbytes >= CLONE_BLOCK_BYTES:
            key = (first.src.offset - begin) % CLONE_BLOCK_BYTES
            weight[key] = weight.get(key, 0) + nbytes
        for p in run:
            item_bytes = min(HEADER_ALIGN_BYTES, max(1, DTYPE_BITS[p.out.dtype] // 8))
            if begin % item_bytes == 0:
                need = max(need, item_bytes)
            begin += p.out.nbytes
    allowed = [k for k in weight if k % need == 0]
    return max(allowed, key=lambda k: weight[k]) if allowed else None


def _cloned_bytes(fd: int, data_start: int) -> int:
    """Bytes of the data buffer that the filesystem shares with another file (0 when it does not tell)."""
    try:
        return shared_bytes_fd(fd, start=data_start) or 0
    except OSError:
        return 0  # only a report: never fail a good write over it


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


@dataclass(frozen=True)
class _Piece:
    """One span of a run for ``copy_file_range``: source offset, destination offset, length."""

    src_path: str
    src_offset: int
    dst_offset: int
    nbytes: int
    name: str  # the run's first tensor, for error messages


def _pieces(run: list[TensorWrite], dst_offset: int) -> tuple[list[_Piece], _Piece | None]:
    """A copyable run as its edges (head up to the source's next block boundary, tail under a
    block) and its block-aligned middle, the part a copy-on-write filesystem can clone."""
    first = run[0]
    src, count = first.src.offset, sum(p.src.nbytes for p in run)
    head = min(count, -src % CLONE_BLOCK_BYTES)
    middle = (count - head) // CLONE_BLOCK_BYTES * CLONE_BLOCK_BYTES
    tail = count - head - middle

    def piece(at: int, nbytes: int) -> _Piece:
        return _Piece(first.src.file or "", src + at, dst_offset + at, nbytes, first.src.name)

    edges = [piece(at, n) for at, n in ((0, head), (head + middle, tail)) if n]
    return edges, piece(head, middle) if middle else None


def _write_pieces(fd: int, writes: list[TensorWrite], source: Source, path: str, tick: ProgressFn, *,
                  data_start: int, crc32s: dict[str, str]) -> bool:
    """Write every run at its offset; True when some block-aligned middle went through copy_file_range.

    Middles go last: on XFS a write into a file that already holds a clone is treated as
    copy-on-write and preallocates a 32-block CoW extent that stays allocated until background
    cleanup (measured: 97 stray blocks for a 4-shard merge). Edges, reads and casts first.
    """
    middles: list[_Piece] = []
    begin = data_start
    with _SourceFds(source) as fds:
        for run in _runs(writes):
            first = run[0]
            if source.kernel_copy and first.src.file is not None and first.src.dtype == first.out.dtype:
                edges, middle = _pieces(run, begin)
                for piece in edges:
                    _copy_piece(fd, piece, fds.get(piece.src_path), path, tick)
                middles += [middle] if middle else []
            else:
                os.lseek(fd, begin, os.SEEK_SET)
                for p in run:
                    crc32s[p.out.name] = f"{_write_through(fd, p, source, path, tick):08x}"
            begin += sum(p.out.nbytes for p in run)
        for piece in middles:
            _copy_piece(fd, piece, fds.get(piece.src_path), path, tick)
    return bool(middles)


class _SourceFds:
    """Read descriptors of the source files: the source's own where it holds one, else opened once."""

    def __init__(self, source: Source) -> None:
        self._source = source
        self._opened: dict[str, int] = {}

    def get(self, path: str) -> int:
        held = self._source.held_fd(path)
        if held is not None:
            return held
        if path not in self._opened:
            self._opened[path] = os.open(path, os.O_RDONLY)
        return self._opened[path]

    def __enter__(self) -> _SourceFds:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self._opened.values():
            os.close(fd)


def _write_through(fd: int, p: TensorWrite, source: Source, path: str, tick: ProgressFn) -> int:
    """Write one tensor that is not copied kernel-side (or needs a cast) at the current offset, through
    Python; returns the crc32 of the bytes written."""
    if p.src.dtype != p.out.dtype:
        return _cast_tensor(fd, p, source, path, tick)
    crc, done = 0, 0
    for chunk in source.chunks(p.src, CHUNK_BYTES):
        write_all(fd, chunk, path)
        crc = zlib.crc32(chunk, crc)
        nbytes = memoryview(chunk).nbytes
        done += nbytes
        tick(nbytes)
    _check_length(p.src, done, p.src.nbytes, source)
    return crc


def _check_length(entry: TensorEntry, got_bytes: int, want_bytes: int, source: Source) -> None:
    """A source that gave another byte count than the tensor's size (it shrank or changed while
    read) must never be published as that tensor."""
    if got_bytes != want_bytes:
        raise HeaderError(f"{source.description}: tensor {entry.name!r} gave {got_bytes} of its {want_bytes} bytes "
                          "(the source changed while it was read?); nothing was published: convert from an intact copy")


def _copy_piece(fd: int, piece: _Piece, src_fd: int, path: str, tick: ProgressFn) -> None:
    """``copy_file_range`` one piece in calls of at most COPY_CALL_BYTES (a block multiple, so a
    middle stays aligned call after call); falls back to pread/pwrite where the kernel refuses."""
    done = 0
    while done < piece.nbytes:
        src_at, dst_at = piece.src_offset + done, piece.dst_offset + done
        try:
            n = os.copy_file_range(src_fd, fd, min(COPY_CALL_BYTES, piece.nbytes - done), src_at, dst_at)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
                raise
            _copy_by_chunks(src_fd, fd, src_at, dst_at, piece.nbytes - done, path, tick)
            return
        if n == 0:
            raise InvalidInputError(
                f"{piece.src_path}: ended early while copying tensor data near {piece.name!r} (file truncated?)"
            )
        done += n
        _faults.point("write:copy", n)
        tick(n)


def _copy_by_chunks(src_fd: int, fd: int, src_offset: int, dst_offset: int, count: int, path: str,
                    tick: ProgressFn) -> None:
    done = 0
    while done < count:
        chunk = os.pread(src_fd, min(CHUNK_BYTES, count - done), src_offset + done)
        if not chunk:
            raise InvalidInputError("source file ended early while copying tensor data (truncated?)")
        write_fd(fd, chunk, path=path, offset=dst_offset + done, wrote=_wrote)  # the checked loop, a fault point a call
        done += len(chunk)
        tick(len(chunk))


def _cast_tensor(fd: int, p: TensorWrite, source: Source, path: str, tick: ProgressFn) -> int:
    """Cast one tensor chunk by chunk while writing it; returns the crc32 of the bytes written."""
    crc = 0
    for cast in cast_chunks(p, source):
        write_all(fd, cast, path)
        crc = zlib.crc32(cast, crc)
        tick(cast.nbytes)  # progress counts output bytes, as the plan's total does
    return crc


def cast_chunks(p: TensorWrite, source: Source) -> Iterator[memoryview]:
    """One tensor's bytes cast to its output dtype, in order, 16 MiB of source bytes at a time."""
    import torch

    from ..formats.dtypes import to_torch

    src_dtype, out_dtype = to_torch(p.src.dtype), to_torch(p.out.dtype)
    itemsize = src_dtype.itemsize
    step = max(itemsize, CAST_CHUNK_BYTES // itemsize * itemsize)
    for begin in range(0, p.src.nbytes, step):
        end = min(begin + step, p.src.nbytes)
        raw = bytearray(source.read(p.src, begin, end))
        _check_length(p.src, begin + len(raw), end, source)
        yield torch.frombuffer(raw, dtype=src_dtype).to(out_dtype).view(torch.uint8).numpy().data


def write_all(fd: int, data: bytes | memoryview, path: str) -> None:
    """Write every byte of ``data`` at ``fd``'s position through the one checked loop
    (:func:`~shardkit.formats.links.write_fd`): a call that writes nothing raises ``OSError(EIO)`` naming ``path``
    instead of looping forever; callers turn it into their :class:`~shardkit.errors.ShardkitWriteError`.
    A fault point per call counts output bytes (shards, GGUF files); bookkeeping (plan files, done records), which
    the crash tests do not count as output, calls ``write_fd`` itself.
    """
    write_fd(fd, data, path=path, wrote=_wrote)


def _wrote(nbytes: int) -> None:
    _faults.point("write", nbytes)
