"""The GGUF container (llama.cpp, ComfyUI-GGUF, diffusers): read and validate it, build its header. Standard library only.

Layout (little-endian, versions 2 and 3): ``b"GGUF"``, a uint32 version, a uint64 tensor count, a uint64
key/value count; the key/values (a string key, a uint32 value type, the value: numbers, bool, string,
or an array of one type); one info per tensor (name, uint32 dim count, uint64 dims innermost first,
uint32 ggml type, uint64 offset into the data section); the data section begins at the next multiple
of ``general.alignment`` (default 32) and every tensor's offset is a multiple of it.

The file is untrusted: every count and length is checked against what is left of the file before it
is read, strings, arrays and the whole header (:data:`MAX_HEADER_BYTES`) against fixed bounds, tensors against the data section (inside it, aligned,
no two overlapping), and every error is one line naming the field.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ..errors import HeaderError
from .header import MAX_DIM
from .links import UntrustedFileError, open_regular

__all__ = ["GGML_TYPES", "GGUF_MAGIC", "GGUF_QUANTIZE", "MAX_HEADER_BYTES", "GgmlType", "GgufFile", "GgufTensor",
           "ReadsBytes", "Value", "build_gguf_header", "ggml_type", "is_gguf_file", "metadata_rows", "padded", "read_gguf",
           "read_gguf_from", "tensor_nbytes_ggml"]

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_STRING_BYTES = 64 * 2**20     # one key or string value (chat templates are ~10 KB)
MAX_ARRAY_ITEMS = 2**24           # one array (vocabularies are ~256 k tokens)
MAX_TOTAL_ITEMS = 2**26           # every array element of the file together
MAX_NAME_BYTES = 1024             # a tensor name (llama.cpp's own limit is 64)
MAX_DIMS = 4                      # GGML_MAX_DIMS
MAX_ALIGNMENT = 2**16
MAX_HEADER_BYTES = 256 * 2**20    # everything before the data section (a 262 k-token vocabulary with merges is ~20 MB)
GGUF_QUANTIZE = ("f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "f32")  # what ``convert --to gguf --quantize`` writes


@dataclass(frozen=True)
class GgmlType:
    """One ggml tensor type: its id, name, elements per block and bytes per block."""

    id: int
    name: str
    block: int
    block_bytes: int


GGML_TYPES: dict[int, GgmlType] = {t.id: t for t in (
    GgmlType(0, "F32", 1, 4), GgmlType(1, "F16", 1, 2), GgmlType(2, "Q4_0", 32, 18), GgmlType(3, "Q4_1", 32, 20),
    GgmlType(6, "Q5_0", 32, 22), GgmlType(7, "Q5_1", 32, 24), GgmlType(8, "Q8_0", 32, 34), GgmlType(9, "Q8_1", 32, 36),
    GgmlType(10, "Q2_K", 256, 84), GgmlType(11, "Q3_K", 256, 110), GgmlType(12, "Q4_K", 256, 144),
    GgmlType(13, "Q5_K", 256, 176), GgmlType(14, "Q6_K", 256, 210), GgmlType(15, "Q8_K", 256, 292),
    GgmlType(16, "IQ2_XXS", 256, 66), GgmlType(17, "IQ2_XS", 256, 74), GgmlType(18, "IQ3_XXS", 256, 98),
    GgmlType(19, "IQ1_S", 256, 50), GgmlType(20, "IQ4_NL", 32, 18), GgmlType(21, "IQ3_S", 256, 110),
    GgmlType(22, "IQ2_S", 256, 82), GgmlType(23, "IQ4_XS", 256, 136), GgmlType(24, "I8", 1, 1),
    GgmlType(25, "I16", 1, 2), GgmlType(26, "I32", 1, 4), GgmlType(27, "I64", 1, 8), GgmlType(28, "F64", 1, 8),
    GgmlType(29, "IQ1_M", 256, 56), GgmlType(30, "BF16", 1, 2), GgmlType(34, "TQ1_0", 256, 54),
    GgmlType(35, "TQ2_0", 256, 66), GgmlType(39, "MXFP4", 32, 17), GgmlType(40, "NVFP4", 64, 36),
    GgmlType(41, "Q1_0", 128, 18),  # MXFP4: gpt-oss's experts as llama.cpp's converter keeps them
)}
_BY_NAME = {t.name: t for t in GGML_TYPES.values()}

# Metadata value types: id → (name, struct format) for the fixed-size ones.
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_SCALARS = {UINT8: "B", INT8: "b", UINT16: "H", INT16: "h", UINT32: "I", INT32: "i", FLOAT32: "f", BOOL: "?",
            UINT64: "Q", INT64: "q", FLOAT64: "d"}

Scalar = int | float | bool | str
Value = Scalar | list["Value"]  # list: of Scalars, or of lists (nested arrays)


def ggml_type(name: str) -> GgmlType:
    """The :class:`GgmlType` called ``name`` (``"Q8_0"``), case-insensitive.

    >>> ggml_type("q8_0").block_bytes
    34
    """
    found = _BY_NAME.get(name.upper())
    if found is None:
        raise HeaderError(f"unknown ggml type {name!r}; known: {', '.join(_BY_NAME)}")
    return found


def tensor_nbytes_ggml(kind: GgmlType, dims: Sequence[int]) -> int:
    """Bytes of a tensor of ``kind`` with ``dims`` (innermost first); the innermost must be whole blocks.

    >>> tensor_nbytes_ggml(ggml_type("Q8_0"), (64, 3))
    204
    """
    inner = dims[0] if dims else 1
    return inner // kind.block * kind.block_bytes * math.prod(dims[1:])


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of a GGUF file.

    Attributes:
        name: its name in the file (llama.cpp's, e.g. ``blk.0.attn_q.weight``).
        dims: its dimensions innermost first, as GGUF stores them (``ne``); the torch shape is reversed.
        kind: its ggml type.
        offset: absolute byte offset of its data in the file.
        nbytes: bytes of its data.
    """

    name: str
    dims: tuple[int, ...]
    kind: GgmlType
    offset: int
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The row-major (torch) shape: ``dims`` reversed."""
        return tuple(reversed(self.dims))


@dataclass
class GgufFile:
    """A parsed, validated GGUF header (no tensor data read).

    Attributes:
        path: the file.
        version: the GGUF version (2 or 3).
        metadata: key → value (numbers, bools, strings, lists of them).
        value_types: key → its metadata value type id (``STRING``, ``UINT32``...), for writing it back.
        item_types: array key → the type id of its items.
        tensors: every tensor, in the order the header lists them.
        alignment: ``general.alignment``.
        data_start: absolute offset of the data section.
        file_bytes: the file's size.
    """

    path: str
    version: int
    metadata: dict[str, Value] = field(default_factory=dict)
    value_types: dict[str, int] = field(default_factory=dict)
    item_types: dict[str, int] = field(default_factory=dict)
    tensors: list[GgufTensor] = field(default_factory=list)
    alignment: int = DEFAULT_ALIGNMENT
    data_start: int = 0
    file_bytes: int = 0

    @property
    def architecture(self) -> str:
        """``general.architecture`` (``"llama"``, ``"flux"``...), or ``""``."""
        value = self.metadata.get("general.architecture")
        return value if isinstance(value, str) else ""


def is_gguf_file(path: str) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic."""
    try:  # a FIFO or device is not a GGUF file: refused unread, never waited on
        with os.fdopen(open_regular(path), "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except (OSError, UntrustedFileError):  # missing, a folder, a FIFO...: not a GGUF file
        return False


class ReadsBytes(Protocol):
    """What the header parser reads from: ``read(n)`` gives the next ``n`` bytes (fewer only at the end)."""

    def read(self, n: int, /) -> bytes: ...


class _Cursor:
    """Bounded reads from the header: each one checked against the bytes left in the file."""

    def __init__(self, f: ReadsBytes, path: str, file_bytes: int) -> None:
        self.f, self.path, self.file_bytes, self.pos, self.items = f, path, file_bytes, 0, 0
        self.last_item = -1

    def take(self, nbytes: int, what: str) -> bytes:
        if nbytes > self.file_bytes - self.pos:
            raise HeaderError(f"{self.path}: {what} needs {nbytes} bytes at offset {self.pos} but the file ends at "
                              f"{self.file_bytes} (truncated or corrupt GGUF)")
        if nbytes > MAX_HEADER_BYTES - self.pos:
            raise HeaderError(f"{self.path}: {what} ({nbytes} bytes at offset {self.pos}) runs the header past "
                              f"{MAX_HEADER_BYTES} bytes, more than GGUF writers produce (corrupt or hostile GGUF)")
        data = self.f.read(nbytes)
        if len(data) != nbytes:
            raise HeaderError(f"{self.path}: {what}: short read at offset {self.pos} (file changed while reading?)")
        self.pos += nbytes
        return data

    def unpack(self, fmt: str, what: str) -> int | float | bool:
        value: int | float | bool
        (value,) = struct.unpack("<" + fmt, self.take(struct.calcsize(fmt), what))
        return value

    def uint(self, fmt: str, what: str) -> int:
        return int(self.unpack(fmt, what))

    def string(self, what: str, limit: int = MAX_STRING_BYTES) -> str:
        length = self.uint("Q", f"{what} length")
        if length > limit:
            raise HeaderError(f"{self.path}: {what} is {length} bytes long, over the {limit}-byte limit (corrupt GGUF)")
        raw = self.take(length, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise HeaderError(f"{self.path}: {what} is not valid UTF-8 ({e.reason} at byte {e.start})") from e

    def value(self, kind: int, what: str, depth: int = 0) -> Value:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind], what)
        if kind == STRING:
            return self.string(what)
        if kind != ARRAY or depth > 0:
            raise HeaderError(f"{self.path}: {what} has unknown value type {kind}" if kind != ARRAY else
                              f"{self.path}: {what} is an array of arrays nested deeper than GGUF writers produce")
        item_kind = self.uint("I", f"{what} item type")
        self.last_item = item_kind
        count = self.uint("Q", f"{what} item count")
        smallest = struct.calcsize(_SCALARS[item_kind]) if item_kind in _SCALARS else 8
        if count > MAX_ARRAY_ITEMS or count * smallest > self.file_bytes - self.pos:
            raise HeaderError(f"{self.path}: {what} claims {count} items, more than the file or the "
                              f"{MAX_ARRAY_ITEMS}-item limit allows (corrupt GGUF)")
        self.items += count
        if self.items > MAX_TOTAL_ITEMS:
            raise HeaderError(f"{self.path}: metadata arrays hold over {MAX_TOTAL_ITEMS} items (corrupt GGUF)")
        if item_kind in _SCALARS and item_kind != BOOL:
            fmt = _SCALARS[item_kind]
            return list(struct.unpack(f"<{count}{fmt}", self.take(count * smallest, what)))
        return [self.value(item_kind, f"{what}[{i}]", depth + 1) for i in range(count)]


def read_gguf(path: str | os.PathLike[str]) -> GgufFile:
    """Read and validate the header of a GGUF file: metadata and tensor infos, never tensor data.

    Raises:
        HeaderError: not GGUF, an unsupported version or big-endian file, a count, length, type,
            dimension or offset the file cannot hold; the message names the field.
    """
    path = os.fspath(path)
    try:  # a checked descriptor: a FIFO, /dev/zero or a directory is refused before reading
        with os.fdopen(open_regular(path), "rb") as f:
            return _parse(_Cursor(f, path, os.fstat(f.fileno()).st_size))
    except (FileNotFoundError, IsADirectoryError, PermissionError) as e:
        from .header import open_error

        raise open_error(path, e) from e


def read_gguf_from(f: ReadsBytes, name: str, size_bytes: int) -> GgufFile:
    """:func:`read_gguf` of an open binary file of ``size_bytes`` positioned at its start (a remote object through a
    buffered range reader); ``name`` is what messages call it."""
    return _parse(_Cursor(f, name, size_bytes))


def _parse(cur: _Cursor) -> GgufFile:
    path = cur.path
    if cur.take(4, "magic") != GGUF_MAGIC:
        raise HeaderError(f"{path}: does not start with b'GGUF' (not a GGUF file)")
    version = cur.uint("I", "version")
    if version not in (2, 3):
        swapped = struct.unpack(">I", struct.pack("<I", version))[0]
        why = "big-endian GGUF files are not supported" if swapped in (2, 3) else "only versions 2 and 3 are read"
        raise HeaderError(f"{path}: GGUF version {version}: {why}")
    tensor_count = cur.uint("Q", "tensor count")
    kv_count = cur.uint("Q", "metadata count")
    left = cur.file_bytes - cur.pos
    if kv_count * 13 > left or tensor_count * 24 > left:  # the smallest possible entries
        raise HeaderError(f"{path}: {tensor_count} tensors and {kv_count} metadata entries cannot fit in the "
                          f"{cur.file_bytes}-byte file (corrupt GGUF)")
    out = GgufFile(path, version, file_bytes=cur.file_bytes)
    for i in range(kv_count):
        key = cur.string(f"metadata key #{i}", MAX_NAME_BYTES)
        if key in out.metadata:
            raise HeaderError(f"{path}: metadata key {key!r} appears twice")
        kind = cur.uint("I", f"metadata {key!r} type")
        out.metadata[key] = cur.value(kind, f"metadata {key!r}")
        out.value_types[key] = kind
        if kind == ARRAY:
            out.item_types[key] = cur.last_item
    out.alignment = _alignment(out, path)
    infos = [_tensor_info(cur, i) for i in range(tensor_count)]
    out.data_start = -(-cur.pos // out.alignment) * out.alignment
    out.tensors = _place(infos, out, path)
    return out


def _alignment(out: GgufFile, path: str) -> int:
    value = out.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= MAX_ALIGNMENT or value & (value - 1):
        raise HeaderError(f"{path}: general.alignment {value!r} is not a power of two up to {MAX_ALIGNMENT}")
    return value


def _tensor_info(cur: _Cursor, i: int) -> tuple[str, tuple[int, ...], GgmlType, int]:
    name = cur.string(f"tensor #{i} name", MAX_NAME_BYTES)
    ndims = cur.uint("I", f"tensor {name!r} dimension count")
    if ndims > MAX_DIMS:
        raise HeaderError(f"{cur.path}: tensor {name!r} has {ndims} dimensions; GGUF allows at most {MAX_DIMS}")
    dims = tuple(cur.uint("Q", f"tensor {name!r} dimension") for _ in range(ndims))
    if any(d >= MAX_DIM for d in dims):  # even when another is 0: torch sizes are signed 64-bit
        raise HeaderError(f"{cur.path}: tensor {name!r} dimensions {list(dims)}: each must be below 2^63 (torch "
                          "cannot hold a larger one, even in a zero-element tensor); the file is damaged or hostile")
    type_id = cur.uint("I", f"tensor {name!r} type")
    kind = GGML_TYPES.get(type_id)
    if kind is None:
        raise HeaderError(f"{cur.path}: tensor {name!r} has unknown ggml type {type_id}")
    if dims and dims[0] % kind.block:
        raise HeaderError(f"{cur.path}: tensor {name!r} has rows of {dims[0]} values, not a multiple of the "
                          f"{kind.block}-value blocks of {kind.name}")
    if math.prod(dims) >= 2**62:
        raise HeaderError(f"{cur.path}: tensor {name!r} dimensions {list(dims)} overflow 64-bit sizes")
    return name, dims, kind, cur.uint("Q", f"tensor {name!r} offset")


def _place(infos: list[tuple[str, tuple[int, ...], GgmlType, int]], out: GgufFile, path: str) -> list[GgufTensor]:
    """Tensors with absolute offsets, each inside the data section, aligned, none overlapping another."""
    tensors, seen = [], set()
    data_bytes = out.file_bytes - out.data_start
    for name, dims, kind, offset in infos:
        if name in seen:
            raise HeaderError(f"{path}: tensor {name!r} appears twice")
        seen.add(name)
        nbytes = tensor_nbytes_ggml(kind, dims)
        if offset % out.alignment:
            raise HeaderError(f"{path}: tensor {name!r} offset {offset} is not a multiple of the alignment "
                              f"{out.alignment}")
        if offset > data_bytes or nbytes > data_bytes - offset:
            raise HeaderError(f"{path}: tensor {name!r} ({nbytes} bytes at data offset {offset}) runs past the end "
                              f"of the {out.file_bytes}-byte file (truncated?)")
        tensors.append(GgufTensor(name, dims, kind, out.data_start + offset, nbytes))
    ordered = sorted(tensors, key=lambda t: (t.offset, t.nbytes))
    for before, after in zip(ordered, ordered[1:], strict=False):
        if after.offset < before.offset + before.nbytes:
            raise HeaderError(f"{path}: tensor {after.name!r} overlaps tensor {before.name!r}")
    return tensors


# ----------------------------------------------------------------------------- writing


def _pack_string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _pack_value(kind: int, value: Value, item_kind: int | None = None) -> bytes:
    if kind in _SCALARS:
        return struct.pack("<" + _SCALARS[kind], value)
    if kind == STRING:
        if not isinstance(value, str):
            raise HeaderError(f"GGUF string value expected, got {type(value).__name__}")
        return _pack_string(value)
    if kind == ARRAY and isinstance(value, list) and item_kind is not None:
        head = struct.pack("<IQ", item_kind, len(value))
        if item_kind in _SCALARS and item_kind != BOOL:
            return head + struct.pack(f"<{len(value)}{_SCALARS[item_kind]}", *value)
        return head + b"".join(_pack_value(item_kind, v) for v in value)
    raise HeaderError(f"GGUF value type {kind} cannot hold {value!r}")


def build_gguf_header(metadata: Sequence[tuple[str, int, Value, int | None]],
                      tensors: Sequence[tuple[str, Sequence[int], GgmlType]], *,
                      alignment: int = DEFAULT_ALIGNMENT) -> tuple[bytes, list[int]]:
    """The bytes before the data section of a GGUF v3 file, padded to ``alignment``, and each tensor's data offset.

    Args:
        metadata: ``(key, value type, value, array item type or None)`` in the order to write.
        tensors: ``(name, dims innermost first, ggml type)`` in data order.
        alignment: the data alignment (written as ``general.alignment`` when not 32).

    Returns:
        ``(header, offsets)``: offsets relative to the data section; each tensor is padded to ``alignment``.

    >>> head, offsets = build_gguf_header([("general.architecture", STRING, "llama", None)],
    ...                                   [("a", (32,), ggml_type("F32")), ("b", (32,), ggml_type("Q8_0"))])
    >>> head[:4], len(head) % 32, offsets
    (b'GGUF', 0, [0, 128])
    """
    rows = list(metadata)
    if alignment != DEFAULT_ALIGNMENT:
        rows.append(("general.alignment", UINT32, alignment, None))
    parts = [GGUF_MAGIC, struct.pack("<IQQ", 3, len(tensors), len(rows))]
    for key, kind, value, item_kind in rows:
        parts += [_pack_string(key), struct.pack("<I", kind), _pack_value(kind, value, item_kind)]
    offsets, cursor = [], 0
    for name, dims, ggml in tensors:
        parts += [_pack_string(name), struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ggml.id, cursor)]
        offsets.append(cursor)
        cursor += -(-tensor_nbytes_ggml(ggml, dims) // alignment) * alignment
    head = b"".join(parts)
    return head + b"\0" * (-len(head) % alignment), offsets


def padded(nbytes: int, alignment: int = DEFAULT_ALIGNMENT) -> int:
    """``nbytes`` rounded up to ``alignment``."""
    return -(-nbytes // alignment) * alignment


def metadata_rows(gguf: GgufFile, *, skip: frozenset[str] = frozenset()) -> list[tuple[str, int, Value, int | None]]:
    """:func:`build_gguf_header` rows that write ``gguf``'s metadata back as read (but the ``skip`` keys)."""
    return [(key, gguf.value_types[key], value, gguf.item_types.get(key)) for key, value in gguf.metadata.items()
            if key not in skip]
