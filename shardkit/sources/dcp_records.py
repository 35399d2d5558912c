"""A DCP chunk's ``torch.save`` record inside a data file: located, checked, read.

Each chunk is a small zip embedded in a data file at ``[blob_offset, blob_offset + blob_length)``.
Its members are always stored uncompressed by ``torch.save``: a compressed member (a zip bomb's
shape) is refused before anything is inflated, and a record whose tensor is not the chunk's
shape is refused, so every byte written comes from bytes really on disk.
"""

from __future__ import annotations

import errno
import io
import math
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import InvalidInputError, UnsafePickleError
from .dcp_metadata import StoredTensor, load_chunk_record

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

__all__ = ["MAX_RECORD_PICKLE_BYTES", "Chunk", "check_stored", "locate_chunk", "record_bytes"]


@dataclass
class Chunk:
    """One stored piece of a tensor: where it sits in the full tensor and in its file."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    blob_offset: int
    blob_length: int
    data_offset: int | None = None  # absolute offset of its contiguous bytes, when located


class _FileSlice(io.RawIOBase):
    """A read-only, seekable window onto ``[offset, offset + length)`` of an open descriptor (``pread``)."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        self.fd, self.offset, self.length, self.pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        new = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        if new < 0:  # as a file does: zipfile then finds no record, never bytes before the window
            raise OSError(errno.EINVAL, f"seek to {new}, before the chunk's first byte")
        self.pos = new
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buf: WriteableBuffer) -> int:
        view = memoryview(buf).cast("B")
        n = max(0, min(len(view), self.length - self.pos))
        data = os.pread(self.fd, n, self.offset + self.pos) if n else b""
        view[: len(data)] = data
        self.pos += len(data)
        return len(data)


# A chunk's data.pkl describes one tensor record: a few hundred bytes. Anything far larger is not torch.save's.
MAX_RECORD_PICKLE_BYTES = 1 << 20


def check_stored(z: zipfile.ZipFile, chunk: Chunk) -> None:
    """Refuse a chunk record with a compressed member (a zip bomb's shape): ``torch.save`` never compresses.

    Nothing is inflated: a member stored uncompressed is at most the chunk's own bytes on disk.
    """
    for info in z.infolist():
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise InvalidInputError(
                f"{chunk.file}: the chunk at byte {chunk.blob_offset} holds member {info.filename!r} compressed "
                f"({info.compress_size} bytes claiming {info.file_size} uncompressed); torch.save never compresses, "
                "so shardkit refuses to inflate it: re-save the checkpoint with torch.distributed.checkpoint")


def locate_chunk(chunk: Chunk, fd: int, *, dtype: str, itemsize: int) -> int | None:
    """Absolute offset of the chunk's bytes in its file, or None when they are not one plain run.

    Raises :class:`InvalidInputError` for a record that cannot be the chunk: a compressed member
    (:func:`check_stored`), an oversized ``data.pkl``, or a tensor of another shape than the chunk.
    """
    try:
        z = zipfile.ZipFile(_FileSlice(fd, chunk.blob_offset, chunk.blob_length))
    except (zipfile.BadZipFile, ValueError, EOFError, struct.error):
        return None  # read through torch.load later, which refuses it in one line
    with z:
        check_stored(z, chunk)
        pkl = next((n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
        if pkl is None or z.getinfo(pkl).file_size > MAX_RECORD_PICKLE_BYTES:
            raise InvalidInputError(f"{chunk.file}: the chunk at byte {chunk.blob_offset} is not a torch.save record "
                                    "(no data.pkl, or one too large to describe a tensor); the checkpoint is damaged")
        try:
            record = load_chunk_record(z.read(pkl))
            if not isinstance(record, StoredTensor):
                return None
            info = z.getinfo(f"{pkl[: -len('data.pkl')]}data/{record.key}")
        except (zipfile.BadZipFile, KeyError, pickle.UnpicklingError, EOFError, ValueError, TypeError):
            return None
    if record.shape != chunk.sizes:
        raise InvalidInputError(f"{chunk.file}: the chunk at byte {chunk.blob_offset} holds a tensor of shape "
                                f"{list(record.shape)}, but .metadata says {list(chunk.sizes)}; the checkpoint is "
                                "damaged or was edited: re-save it")
    if record.storage_dtype != dtype or len(record.stride) != len(record.shape) or \
            not _is_contiguous(record.shape, record.stride):
        return None
    local = os.pread(fd, 30, chunk.blob_offset + info.header_offset)
    if len(local) < 30 or local[:4] != b"PK\x03\x04":
        return None
    name_len: int
    extra_len: int
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    start = info.header_offset + 30 + name_len + extra_len + record.storage_offset * itemsize
    end = start + math.prod(chunk.sizes) * itemsize
    if record.storage_offset < 0 or end > min(info.header_offset + 30 + name_len + extra_len + info.file_size,
                                               chunk.blob_length):
        return None
    return chunk.blob_offset + start


def _is_contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for size, step in reversed(list(zip(shape, stride, strict=True))):
        if size != 1 and step != expected:
            return False
        expected *= size
    return True


def record_bytes(chunk: Chunk, blob: bytes, *, nbytes: int) -> memoryview:
    """The tensor bytes of a chunk's ``torch.save`` record, checked: stored members only, the chunk's shape."""
    import torch

    from .memory import host_bytes

    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as z:
            check_stored(z, chunk)  # before torch's reader could inflate anything
    except zipfile.BadZipFile as e:
        raise UnsafePickleError(f"{chunk.file}: chunk at byte {chunk.blob_offset} is not a torch.save record ({e}); "
                                "the checkpoint is damaged: re-save it") from e
    try:
        value = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as e:  # torch's unpickler raises many kinds (IndexError, KeyError...) on garbage
        raise UnsafePickleError(f"{chunk.file}: chunk at byte {chunk.blob_offset} is not a plain tensor ({e})") from e
    data = host_bytes(value) if isinstance(value, torch.Tensor) else None
    if data is None or tuple(value.shape) != chunk.sizes or len(data) != nbytes:
        found = f"{list(value.shape)} ({len(data)} bytes)" if data is not None else type(value).__name__
        raise InvalidInputError(f"{chunk.file}: the chunk at byte {chunk.blob_offset} holds {found}, but .metadata "
                                f"says shape {list(chunk.sizes)} ({nbytes} bytes); the checkpoint is damaged: re-save it")
    return data
