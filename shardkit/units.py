"""Sizes, dtype widths and byte progress.

Size strings are parsed here and only here, at the edges (CLI options, public API
arguments). Everything inside shardkit works on ints named ``*_bytes``.

Units: ``KB``/``MB``/``GB``/``TB`` are decimal (10³ steps), as in huggingface_hub;
``KiB``/``MiB``/``GiB``/``TiB`` are binary (2¹⁰ steps), as accelerate also accepts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from .errors import InvalidInputError, InvalidSizeError

ProgressCallback = Callable[[int, int], None]  # progress(done_bytes, total_bytes): every job reports through it


class ByteCounter:
    """Turns per-chunk byte counts into ``progress(done_bytes, total_bytes)`` calls (writes, pushes, reads).

    >>> seen = []
    >>> count = ByteCounter(10, lambda done, total: seen.append((done, total)))
    >>> count(4); count(6); seen
    [(4, 10), (10, 10)]
    """

    def __init__(self, total_bytes: int, progress: ProgressCallback | None) -> None:
        self.total_bytes = total_bytes
        self.done_bytes = 0
        self._progress = progress

    def __call__(self, n: int) -> None:
        self.done_bytes += n
        if self._progress is not None:
            self._progress(self.done_bytes, self.total_bytes)

_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")

# Bits per element of every safetensors dtype code. Sub-byte types pack; a tensor's byte
# size is ceil(numel * bits / 8).
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8,
    "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "C64": 64, "F64": 64, "I64": 64, "U64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}

FLOAT_DTYPES = frozenset(
    {"F64", "F32", "F16", "BF16", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ"}
)

# Names users type for --dtype, mapped to safetensors codes.
DTYPE_ALIASES: dict[str, str] = {
    "fp32": "F32", "float32": "F32", "f32": "F32",
    "fp16": "F16", "float16": "F16", "half": "F16", "f16": "F16",
    "bf16": "BF16", "bfloat16": "BF16",
    "fp64": "F64", "float64": "F64",
    "fp8": "F8_E4M3", "fp8_e4m3": "F8_E4M3", "float8_e4m3fn": "F8_E4M3", "f8_e4m3": "F8_E4M3",
    "fp8_e5m2": "F8_E5M2", "float8_e5m2": "F8_E5M2", "f8_e5m2": "F8_E5M2",
}

LOSSLESS_TARGETS = frozenset({"F32", "F16", "BF16", "F64"})
COMPUTE_DTYPES = ("BF16", "F16", "F32")  # what weights compute in (fp8 is storage: layerwise casting)
STORAGE_DTYPES = ("F8_E4M3", "F8_E5M2")  # what layerwise casting stores weights in between forwards

# The torch dtype of each code, by attribute name (torch is imported lazily, and an older torch
# lacks some): the one table every code <-> torch.dtype conversion reads (formats/dtypes.py).
TORCH_NAMES: dict[str, str] = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
    "F16": "float16", "BF16": "bfloat16", "I32": "int32", "U32": "uint32", "F32": "float32",
    "C64": "complex64", "F64": "float64", "I64": "int64", "U64": "uint64",
    "F8_E5M2": "float8_e5m2", "F8_E4M3": "float8_e4m3fn", "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
}


def parse_size(value: str | int, *, name: str = "size") -> int:
    """Parse a size such as ``"5GB"``, ``"2GiB"``, ``"1.5GB"``, ``"500MB"`` or ``1000`` into bytes.

    ``KB``/``MB``/``GB``/``TB`` are powers of 10 and ``KiB``/``MiB``/``GiB``/``TiB`` powers of 2;
    units are case-insensitive, a bare number is a byte count, and fractions are truncated.

    Args:
        value: a size string with an optional unit, or an ``int`` byte count.
        name: what the size is, for the error message (``"max_shard_size"``...).

    Returns:
        The size in bytes, greater than zero and below 2**63.

    Raises:
        InvalidSizeError: ``value`` is not a size, is not positive, or is too large for a file.

    >>> parse_size("5GB"), parse_size("1GiB"), parse_size(42)
    (5000000000, 1073741824, 42)
    """
    if isinstance(value, bool):
        raise InvalidSizeError(f"invalid {name} {value!r}: expected a size like '5GB', '2GiB' or a byte count")
    shown = _shown(value)
    if isinstance(value, int):
        size_bytes = value
    else:
        match = _SIZE_RE.match(str(value))
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise InvalidSizeError(
                f"invalid {name} {shown}: expected a number with an optional unit "
                "(KB/MB/GB/TB are powers of 10, KiB/MiB/GiB/TiB powers of 2), e.g. '5GB' or '2GiB'"
            )
        number = float(match.group(1))
        size_bytes = int(number * _UNITS[unit]) if math.isfinite(number * _UNITS[unit]) else MAX_SIZE_BYTES
    if size_bytes <= 0:
        raise InvalidSizeError(f"invalid {name} {shown}: must be greater than zero")
    if size_bytes >= MAX_SIZE_BYTES:
        raise InvalidSizeError(f"invalid {name} {shown}: larger than any file can be (2^63 bytes)")
    return size_bytes


MAX_SIZE_BYTES = 2**63


def _shown(value: object) -> str:
    """``repr`` for messages, kept short (and safe for integers over Python's digit limit)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"<a {value.bit_length()}-bit integer>"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "...'"


def format_count(count: int) -> str:
    """A parameter or element count as people write it: ``"860.0M"``, ``"2.57B"``, ``"12.3K"``, ``"42"``.

    >>> format_count(2_567_000_000), format_count(859_520_964), format_count(42)
    ('2.57B', '859.5M', '42')
    """
    for unit, scale, digits in (("B", 10**9, 2), ("M", 10**6, 1), ("K", 10**3, 1)):
        if count >= scale:
            return f"{count / scale:.{digits}f}{unit}"
    return str(count)


def format_size(size_bytes: int) -> str:
    """Format a byte count as a short human-readable decimal size.

    Units step by 1000 (as :func:`parse_size` reads ``KB``/``MB``/``GB``/``TB``), up to ``TB``;
    byte counts under 1000 print as integers.

    Args:
        size_bytes: the number of bytes.

    Returns:
        A string such as ``"512 B"``, ``"1.50 MB"`` or ``"5.00 GB"``.

    >>> format_size(5_000_000_000), format_size(512)
    ('5.00 GB', '512 B')
    """
    step = 1000.0
    value = float(size_bytes)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(value) < step or unit == "TB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= step
    raise AssertionError("unreachable")


def tensor_nbytes(dtype: str, shape: tuple[int, ...] | list[int]) -> int:
    """Bytes a tensor of ``dtype`` and ``shape`` takes in a safetensors file.

    >>> tensor_nbytes("BF16", (2, 3)), tensor_nbytes("F4", (3,))
    (12, 2)
    """
    bits = DTYPE_BITS.get(dtype)
    if bits is None:
        raise InvalidInputError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(DTYPE_BITS))}")
    return (math.prod(shape) * bits + 7) // 8


def short_dtype(code: str) -> str:
    """The short name users type for a code (the first alias), else the code itself.

    >>> short_dtype("BF16"), short_dtype("F32"), short_dtype("F8_E4M3"), short_dtype("I64")
    ('bf16', 'fp32', 'fp8', 'I64')
    """
    return next((alias for alias, c in DTYPE_ALIASES.items() if c == code), code)


def normalize_dtype(name: str) -> str:
    """Map a user dtype name (``bf16``, ``float16``, ``F32``...) to its safetensors code."""
    key = name.strip()
    if key.upper() in DTYPE_BITS:
        return key.upper()
    code = DTYPE_ALIASES.get(key.lower())
    if code is None:
        raise InvalidInputError(
            f"unknown dtype {name!r}; use one of bf16, fp16, fp32, fp8_e4m3, fp8_e5m2"
        )
    return code
