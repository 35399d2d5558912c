"""The safetensors file format: read, validate and build headers. Standard library only.

Layout: an 8-byte little-endian header length N, N bytes of UTF-8 JSON (an object), then the
data buffer. Every entry's ``data_offsets`` are relative to the buffer start; sorted by offset,
entries must tile the buffer exactly, and the buffer must end where the file ends.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field
from typing import BinaryIO

from ..errors import HeaderError, InvalidInputError, SourceNotFoundError, parts_of
from ..units import DTYPE_BITS
from .links import OutsideFolderError, loads_json, open_regular

MAX_HEADER_BYTES = 100_000_000  # the reference reader's limit
HEADER_ALIGN_BYTES = 8
PAD_BLOCK_BYTES = 4096  # build_header(data_start_mod=): the filesystem block that clones need
_MAX_DIMS = 64
MAX_DIM = 2**63  # every dimension below it (see _is_dim)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor: its name, safetensors dtype code, shape and byte size.

    ``file`` and ``offset`` (absolute byte offset in ``file``) are set when the bytes lie
    contiguously in a file on disk, which lets the writer copy them kernel-side.

    Attributes:
        name: the tensor's key in the checkpoint.
        dtype: a safetensors dtype code (``"F32"``, ``"BF16"``, ``"F8_E4M3"``...).
        shape: the tensor's dimensions.
        nbytes: bytes of its data (sub-byte dtypes rounded up).
        file: the file holding the bytes, or None for tensors that are not in a file.
        offset: absolute byte offset of the data in ``file``.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: str | None = None
    offset: int = 0


@dataclass
class Header:
    """A parsed, validated safetensors header, as :func:`read_header` returns it.

    Attributes:
        path: the file the header was read from.
        entries: one :class:`TensorEntry` per tensor, in data-offset order.
        metadata: the ``__metadata__`` string map (empty when absent).
        data_start: absolute byte offset where the data buffer begins (8 + header length).
        file_bytes: the file's size; equal to the end of the last tensor's data.
    """

    path: str
    entries: list[TensorEntry]
    metadata: dict[str, str] = field(default_factory=dict)
    data_start: int = 0
    file_bytes: int = 0

    def by_name(self) -> dict[str, TensorEntry]:
        """The entries keyed by tensor name."""
        return {e.name: e for e in self.entries}


def read_header(path: str | os.PathLike[str]) -> Header:
    """Read and fully validate the header of a safetensors file.

    Only the header is read, never the tensor data. Validation covers the length prefix, the
    JSON (UTF-8, no duplicate names), every entry's dtype, shape and byte count, and the data
    offsets, which must tile the buffer with no gap or overlap and end exactly at the end of
    the file.

    Args:
        path: a ``.safetensors`` file.

    Returns:
        The :class:`Header`, entries in data-offset order with absolute offsets.

    Raises:
        SourceNotFoundError: ``path`` does not exist.
        HeaderError: the file is truncated, not safetensors, or its header is inconsistent.

    header = read_header("model.safetensors")
    [e.name for e in header.entries][:2]
    ['conv_in.bias', 'conv_in.weight']
    """
    path = os.fspath(path)
    try:  # one checked descriptor: a FIFO or a device is refused before anything is read
        fd = open_regular(path)
    except (FileNotFoundError, IsADirectoryError, PermissionError) as e:
        raise open_error(path, e) from e
    except OutsideFolderError as e:
        raise HeaderError(*parts_of(e)) from e
    with os.fdopen(fd, "rb") as f:
        raw, file_bytes = read_header_bytes(f, path)
    return parse_header(raw, path=path, file_bytes=file_bytes)


def open_error(path: str, error: OSError) -> InvalidInputError | SourceNotFoundError:
    """The one-line error for a checkpoint file that cannot be opened for reading.

    >>> str(open_error("a.safetensors", FileNotFoundError()))
    'a.safetensors: no such file'
    """
    if isinstance(error, FileNotFoundError):
        return SourceNotFoundError(f"{path}: no such file")
    if isinstance(error, IsADirectoryError):
        return HeaderError(f"{path}: is a directory, expected a .safetensors file")
    if isinstance(error, PermissionError):
        return InvalidInputError(f"{path}: cannot be read (permission denied); check the file's permissions")
    return HeaderError(f"{path}: cannot open the file for reading ({error.strerror or error})")


def read_header_bytes(f: BinaryIO, path: str) -> tuple[bytes, int]:
    """Read the length prefix and the header JSON bytes of an open safetensors file.

    The length is checked against the file's size before anything that large is read, so a
    corrupt prefix never allocates gigabytes.

    Args:
        f: the file, opened for binary reading and positioned at its start.
        path: its name, for error messages.

    Returns:
        ``(raw, file_bytes)``: the header JSON bytes (without the prefix) and the file's size.

    Raises:
        HeaderError: the file is too short, or the length prefix is impossible for it.
    """
    file_bytes = os.fstat(f.fileno()).st_size
    prefix = f.read(8)
    if len(prefix) < 8:
        raise HeaderError(f"{path}: file is {file_bytes} bytes, too short to be safetensors (truncated?)")
    (header_bytes,) = struct.unpack("<Q", prefix)
    _check_header_length(path, header_bytes, file_bytes)
    raw = f.read(header_bytes)
    if len(raw) != header_bytes:
        raise HeaderError(f"{path}: header is truncated")
    return raw, file_bytes


def _check_header_length(path: str, header_bytes: int, file_bytes: int) -> None:
    if header_bytes > MAX_HEADER_BYTES:
        raise HeaderError(
            f"{path}: header length {header_bytes} is over the {MAX_HEADER_BYTES}-byte limit "
            "(corrupt or not a safetensors file)"
        )
    if 8 + header_bytes > file_bytes:
        raise HeaderError(
            f"{path}: header length {header_bytes} runs past the end of the {file_bytes}-byte file (truncated?)"
        )
    if header_bytes < 2:
        raise HeaderError(f"{path}: header length {header_bytes} is too small for a JSON object")


def parse_header(raw: bytes, *, path: str = "<bytes>", file_bytes: int | None = None) -> Header:
    """Validate header JSON bytes (without the 8-byte prefix) and return a :class:`Header`.

    ``file_bytes`` is the whole file's size; when given, the buffer must end exactly there.
    """
    data_start = 8 + len(raw)
    doc = _decode_json(raw, path)
    metadata = _parse_metadata(doc.pop("__metadata__", None), path)
    entries = [_parse_entry(name, spec, path, data_start) for name, spec in doc.items()]
    entries.sort(key=lambda e: (e.offset, e.offset + e.nbytes))
    buffer_bytes = _check_tiling(entries, path, data_start)
    if file_bytes is not None and data_start + buffer_bytes != file_bytes:
        raise HeaderError(
            f"{path}: tensors end at byte {data_start + buffer_bytes} but the file has {file_bytes} bytes "
            "(truncated or trailing data)"
        )
    return Header(path, entries, metadata, data_start, data_start + buffer_bytes if file_bytes is None else file_bytes)


def _decode_json(raw: bytes, path: str) -> dict[str, object]:
    if not raw.lstrip(b" ").startswith(b"{"):
        raise HeaderError(f"{path}: header does not start with '{{' (not a safetensors file?)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HeaderError(f"{path}: header is not valid UTF-8 ({e.reason} at byte {e.start})") from e

    def no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
        out: dict[str, object] = {}
        for key, value in pairs:
            if key in out:
                raise HeaderError(f"{path}: tensor {key!r} appears twice in the header")
            out[key] = value
        return out

    try:
        doc = loads_json(text, object_pairs_hook=no_duplicates)
    except HeaderError:  # a duplicate name: already a precise message (HeaderError is a ValueError)
        raise
    except (ValueError, RecursionError) as e:  # ValueError: also integers over Python's digit limit
        raise HeaderError(f"{path}: header is not valid JSON ({e})") from e
    if not isinstance(doc, dict):
        raise HeaderError(f"{path}: header JSON must be an object, got {type(doc).__name__}")
    return doc


def _parse_metadata(value: object, path: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and _is_text(k) and _is_text(v) for k, v in value.items()
    ):
        raise HeaderError(f"{path}: __metadata__ must map strings to strings")
    return dict(value)


def _is_text(value: str) -> bool:
    """False for strings JSON can carry but UTF-8 cannot (lone surrogate escapes like \\ud800)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _parse_entry(name: str, spec: object, path: str, data_start: int) -> TensorEntry:
    where = f"{path}: tensor {name!r}"
    if not _is_text(name):
        raise HeaderError(f"{where}: name is not valid Unicode (a lone surrogate escape)")
    if not isinstance(spec, dict):
        raise HeaderError(f"{where}: entry must be an object with dtype, shape and data_offsets")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in spec]
    if missing:
        raise HeaderError(f"{where}: missing field(s) {', '.join(missing)}")
    dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise HeaderError(f"{where}: unknown dtype {dtype!r}; known: {', '.join(sorted(DTYPE_BITS))}")
    if not isinstance(shape, list) or len(shape) > _MAX_DIMS or not all(_is_dim(d) for d in shape):
        raise HeaderError(f"{where}: shape must be a list of non-negative integers below 2^63 (every dimension, even "
                          f"of a zero-element tensor: torch sizes are signed 64-bit), got {str(shape)[:200]}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_uint(o) for o in offsets)):
        raise HeaderError(f"{where}: data_offsets must be [begin, end] non-negative integers below 2^64, got "
                          f"{str(offsets)[:200]}")
    begin, end = offsets
    if end < begin:
        raise HeaderError(f"{where}: data_offsets [{begin}, {end}] are reversed")
    numel = math.prod(shape)
    expected = (numel * DTYPE_BITS[dtype] + 7) // 8
    if expected >= 2**63:
        raise HeaderError(f"{where}: shape {shape} overflows 64-bit sizes")
    if end - begin != expected:
        raise HeaderError(
            f"{where}: holds {end - begin} bytes but shape {shape} of {dtype} needs {expected}"
        )
    return TensorEntry(name, dtype, tuple(shape), expected, path, data_start + begin)


def _is_dim(value: object) -> bool:
    """A dimension every reader can hold: 0 <= value < 2**63 (torch sizes are signed 64-bit), even in a
    zero-element shape such as ``[2**64 - 1, 0]``, which the format allows and torch cannot build."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_DIM


def _is_uint(value: object) -> bool:
    """A JSON integer the reference reader accepts as an offset: 0 <= value < 2**64."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**64


def _check_tiling(entries: list[TensorEntry], path: str, data_start: int) -> int:
    """Entries sorted by offset must cover the buffer with no gap and no overlap."""
    cursor = 0
    for entry in entries:
        begin = entry.offset - data_start
        if begin > cursor:
            raise HeaderError(f"{path}: gap of {begin - cursor} bytes before tensor {entry.name!r}")
        if begin < cursor:
            raise HeaderError(f"{path}: tensor {entry.name!r} overlaps the tensor before it")
        cursor = begin + entry.nbytes
    return cursor


def build_header(
    entries: list[TensorEntry], *, metadata: dict[str, str] | None = None, data_start_mod: int | None = None
) -> tuple[bytes, list[int]]:
    """Build the bytes that precede the data buffer for tensors laid out in ``entries`` order.

    The JSON is padded with spaces to a multiple of 8 bytes, as the reference writer does. With
    ``data_start_mod``, it is padded further (by less than :data:`PAD_BLOCK_BYTES`) so that the
    data buffer starts at an absolute file offset congruent to ``data_start_mod`` modulo
    :data:`PAD_BLOCK_BYTES`: the writer uses it to put a shard's bytes at the same offset inside
    a filesystem block as in the source, which lets copy-on-write filesystems clone them.
    Trailing spaces are valid JSON; every safetensors reader accepts them.

    Args:
        entries: the tensors, in the order their bytes follow each other in the buffer.
        metadata: the ``__metadata__`` string map, if any.
        data_start_mod: the wanted ``data_start % PAD_BLOCK_BYTES``. The caller keeps tensors
            at multiples of their item size (the writer derives it from a source that does).

    Returns:
        ``(prefix_and_header, begins)`` where ``begins`` are buffer-relative offsets.

    >>> head, begins = build_header([TensorEntry("w", "F32", (2,), 8)])
    >>> head[:8], begins
    (b'8\\x00\\x00\\x00\\x00\\x00\\x00\\x00', [0])
    >>> len(build_header([TensorEntry("w", "F32", (2,), 8)], data_start_mod=0)[0]) % 4096
    0
    """
    doc: dict[str, object] = {}
    if metadata:
        doc["__metadata__"] = dict(metadata)
    begins, cursor = [], 0
    for entry in entries:
        if entry.name in doc or entry.name == "__metadata__":
            raise HeaderError(f"tensor name {entry.name!r} is used twice; names must be unique")
        doc[entry.name] = {
            "dtype": entry.dtype,
            "shape": list(entry.shape),
            "data_offsets": [cursor, cursor + entry.nbytes],
        }
        begins.append(cursor)
        cursor += entry.nbytes
    raw = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % HEADER_ALIGN_BYTES)
    if data_start_mod is not None:
        raw += b" " * ((data_start_mod - 8 - len(raw)) % PAD_BLOCK_BYTES)
    if len(raw) > MAX_HEADER_BYTES:
        raise HeaderError(f"header would be {len(raw)} bytes, over the {MAX_HEADER_BYTES}-byte limit; use smaller shards")
    return struct.pack("<Q", len(raw)) + raw, begins
