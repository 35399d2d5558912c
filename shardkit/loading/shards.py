"""One shard of a lazy checkpoint: its open state, and the checks that keep reads honest.

A shard is opened once: the descriptor first, then the header read through that descriptor (so a
file replaced between the two can never pair one file's offsets with another's bytes), then its
read backend. A shard must hold exactly the tensors its index assigns to it, and must not change on disk while
it is open: a truncated memory map would crash the process with SIGBUS on the next touch, a
rewritten file would mix old and new bytes.
"""

from __future__ import annotations

import logging
import mmap
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import CheckpointIndexError, HeaderError, InvalidInputError
from ..formats.header import Header, TensorEntry, open_error, parse_header, read_header_bytes
from ..formats.ranges import RangeFile
from ..reading.map_ahead import MapReadAhead
from ..reading.readers import Reader, open_reader
from ..reading.residency import BackendChoice, choose_backend

log = logging.getLogger("shardkit")


@dataclass
class Shard:
    """A shard file: header once read, descriptor and map or reader once opened."""

    path: str
    expected: frozenset[str] | None  # names the index puts in this shard (None: single file)
    header: Header | None = None
    fd: int | None = None
    mapped: mmap.mmap | None = None
    entries: dict[str, TensorEntry] | None = None
    backend: str | None = None          # "mmap", "pread" or "direct", once opened
    reason: str = ""                    # why (auto's choice)
    reader: Reader | None = None        # pread/direct
    identity: tuple[int, int, int] | None = None  # (inode, size, mtime_ns) at open: changes are refused
    open_file: Callable[[str], RangeFile] | None = None  # the file is a header-only stand-in: bytes come from here
    ahead: MapReadAhead | None = None   # mmap on a passthrough mount: parallel read-ahead of the map


def check_shard_names(shard: Shard, header: Header) -> None:
    """A shard is opened once: the descriptor first, then the header read through that descriptor (so a
file replaced between the two can never pair one file's offsets with another's bytes), then its
read backend. A shard must hold exactly the tensors its index assigns to it."""
    if shard.expected is None:
        return
    names = {e.name for e in header.entries}
    extra = sorted(names - shard.expected)
    missing = sorted(shard.expected - names)
    if extra or missing:
        parts = []
        if missing:
            parts.append(f"lacks {', '.join(map(repr, missing[:5]))}{' ...' if len(missing) > 5 else ''}")
        if extra:
            parts.append(f"holds {', '.join(map(repr, extra[:5]))}{' ...' if len(extra) > 5 else ''} not in the index")
        raise CheckpointIndexError(f"{shard.path}: does not match the index: it {' and '.join(parts)}")


def check_unchanged(shard: Shard) -> None:
    """Refuse a shard whose open file was truncated or rewritten in place since it was opened.

    A truncated memory map would crash the process with SIGBUS on the next touch; a rewritten
    file would mix old and new bytes. ``fstat`` on the open descriptor: a file replaced by a
    rename leaves the opened one intact, so reads through it stay consistent.
    """
    if shard.fd is None or shard.identity is None:
        return
    try:
        st = os.fstat(shard.fd)
    except OSError as e:
        raise InvalidInputError(f"{shard.path}: changed on disk while open ({e.strerror}); reopen it") from e
    if (st.st_ino, st.st_size, st.st_mtime_ns) != shard.identity:
        raise InvalidInputError(f"{shard.path}: changed on disk while open (size or modification time differ); "
                                "reopen the checkpoint to read the new file")


def open_shard(shard: Shard, read: str) -> None:
    """Open ``shard``: descriptor, header read and validated through it, identity, read backend.

    Raises:
        SourceNotFoundError: the file is gone.
        HeaderError: not a readable safetensors file (truncated, corrupt, a folder...).
        InvalidInputError: permission denied.
        CheckpointIndexError: it does not hold the tensors its index assigns to it.
    """
    try:
        fd = os.open(shard.path, os.O_RDONLY)
    except OSError as e:
        raise open_error(shard.path, e) from e
    try:
        _open_fd(shard, fd, read)
    except BaseException:
        os.close(fd)
        if shard.ahead is not None:
            shard.ahead.close()
        shard.reader = shard.mapped = shard.ahead = None
        raise


RANGED = BackendChoice("range", "remote object: parallel ranged reads", "remote")


def _open_fd(shard: Shard, fd: int, read: str) -> None:
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode):
        raise HeaderError(f"{shard.path}: is a directory, expected a .safetensors file")
    choice = choose_backend(shard.path, read, fd=fd) if shard.open_file is None else RANGED
    header = read_header_fd(fd, shard.path)
    check_shard_names(shard, header)
    try:
        if shard.open_file is not None:  # a remote object: its bytes by ranged reads, whatever ``read`` says
            shard.reader = open_reader(shard.open_file(shard.path), "pread")
        elif choice.backend == "mmap":
            shard.mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
            if choice.tuning == "passthrough" and hasattr(os, "posix_fadvise"):
                shard.ahead = MapReadAhead(fd, st.st_size)
        else:
            shard.reader = open_reader(shard.path, choice.backend, fd=fd, remote=choice.remote is not None, tuning=choice.tuning,
                                       quiet=read == "auto")
    except (OSError, ValueError) as e:
        raise HeaderError(f"{shard.path}: cannot open the file for reading ({e})") from e
    shard.header, shard.entries = header, header.by_name()
    shard.identity = (st.st_ino, st.st_size, st.st_mtime_ns)
    shard.fd = fd
    shard.backend = shard.reader.backend if shard.reader is not None else "mmap"
    shard.reason = choice.reason if shard.backend == choice.backend else f"{choice.reason}; O_DIRECT refused"
    log.debug("%s: read backend %s (%s)", shard.path, shard.backend, shard.reason)


def read_header_fd(fd: int, path: str) -> Header:
    """Read and validate the header of the open file ``fd``, from its start (reads elsewhere use ``pread``)."""
    # A duplicate (closing it leaves ``fd`` open); an 8-byte buffer reads exactly the header's bytes.
    with os.fdopen(os.dup(fd), "rb", buffering=8) as f:
        f.seek(0)
        raw, file_bytes = read_header_bytes(f, path)
    return parse_header(raw, path=path, file_bytes=file_bytes)


def close_shard(shard: Shard) -> None:
    """Close the descriptor and the reader. Never ``mmap.close()``: ``torch.frombuffer`` keeps a
    reference to the map but holds no buffer export, so closing would unmap pages live tensors
    still point to; dropping our reference unmaps it once the last zero-copy tensor is gone."""
    if shard.reader is not None:
        shard.reader.close()
        shard.reader = None
    if shard.ahead is not None:
        if not shard.ahead.close():
            log.warning("%s: read-ahead still running after close; leaving its descriptor open", shard.path)
        shard.ahead = None
    if shard.fd is not None:
        os.close(shard.fd)
        shard.fd = None
    shard.mapped = None
