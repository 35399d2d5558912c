"""Sizes, dtype widths and the torch dtype table."""

from __future__ import annotations

import pytest
from conftest import TORCH_DTYPE_CODES

from shardkit.errors import InvalidInputError, InvalidSizeError, ShardkitError
from shardkit.units import DTYPE_BITS, format_size, normalize_dtype, parse_size, tensor_nbytes

DESIGN_CODES = {
    "BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16",
    "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64", "F4", "F6_E2M3", "F6_E3M2",
}


@pytest.mark.parametrize("text, expected", [
    ("5GB", 5 * 10**9),
    ("5GiB", 5 * 2**30),
    ("1.5GB", 1_500_000_000),
    ("500MB", 500 * 10**6),
    ("500mb", 500 * 10**6),
    (" 2 gib ", 2 * 2**30),
    ("1KiB", 1024),
    ("3KB", 3000),
    ("1TB", 10**12),
    ("1TiB", 2**40),
    ("1000", 1000),
    ("7B", 7),
    (".5KB", 500),
    (1234, 1234),
])
def test_parse_size_accepts_decimal_binary_fractions_and_ints(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["5XB", "0", "-1GB", "abc", "", "GB", "1.2.3GB", "0.0001B", "5 G B", "1e9", True, 0, -5])
def test_parse_size_rejects_garbage_with_a_helpful_message(text: str | int) -> None:
    with pytest.raises(InvalidSizeError) as info:
        parse_size(text, name="--max-shard-size")
    assert isinstance(info.value, ValueError) and isinstance(info.value, ShardkitError)
    assert info.value.exit_code == 2
    assert "--max-shard-size" in str(info.value)


def test_format_size() -> None:
    assert format_size(0) == "0 B"
    assert format_size(999) == "999 B"
    assert format_size(1000) == "1.00 KB"
    assert format_size(5_000_000_000) == "5.00 GB"
    assert format_size(10**16) == "10000.00 TB"


def test_dtype_table_covers_every_safetensors_code() -> None:
    assert set(DTYPE_BITS) == DESIGN_CODES


@pytest.mark.parametrize("dtype, shape, expected", [
    ("F32", (2, 3), 24),
    ("BF16", (), 2),
    ("BOOL", (7,), 7),
    ("I64", (0, 5), 0),
    ("C64", (3,), 24),
    ("F8_E4M3", (4, 4), 16),
    ("F4", (3,), 2),  # 12 bits round up to 2 bytes
    ("F4", (4,), 2),
    ("F6_E2M3", (4,), 3),
    ("F6_E3M2", (5,), 4),  # 30 bits → 4 bytes
    ("F4", (0,), 0),
])
def test_tensor_nbytes_rounds_sub_byte_types_up(dtype: str, shape: tuple, expected: int) -> None:
    assert tensor_nbytes(dtype, shape) == expected


def test_tensor_nbytes_unknown_dtype() -> None:
    with pytest.raises(InvalidInputError, match="unknown dtype"):
        tensor_nbytes("F7", (1,))


@pytest.mark.parametrize("name, code", [
    ("bf16", "BF16"), ("bfloat16", "BF16"), ("fp16", "F16"), ("float16", "F16"), ("half", "F16"),
    ("fp32", "F32"), ("F32", "F32"), ("f32", "F32"), ("fp8", "F8_E4M3"), ("fp8_e5m2", "F8_E5M2"),
    ("float8_e4m3fn", "F8_E4M3"), ("i64", "I64"), (" BF16 ", "BF16"),
])
def test_normalize_dtype(name: str, code: str) -> None:
    assert normalize_dtype(name) == code


def test_normalize_dtype_unknown() -> None:
    with pytest.raises(InvalidInputError, match="unknown dtype 'int3'"):
        normalize_dtype("int3")


# ------------------------------------------------------------------ torch_dtypes

def test_torch_table_agrees_with_safetensors_and_dtype_widths() -> None:
    import safetensors.torch as st
    import torch

    from shardkit.formats.dtypes import from_torch, to_torch

    for code in TORCH_DTYPE_CODES:
        dtype = to_torch(code)
        assert from_torch(dtype) == code
        assert dtype.itemsize * 8 == DTYPE_BITS[code], code
    for code, dtype in st._TYPES.items():  # the reference library's own table
        assert to_torch(code) is dtype
        assert from_torch(dtype) == code
    assert to_torch("BOOL") is torch.bool


def test_torch_table_refuses_what_torch_cannot_hold() -> None:
    import torch

    from shardkit.formats.dtypes import from_torch, to_torch

    for code in ("F4", "F6_E2M3", "F6_E3M2"):
        with pytest.raises(InvalidInputError, match=code):
            to_torch(code)
    with pytest.raises(InvalidInputError, match="cannot be stored"):
        from_torch(torch.quint8)


def test_resolve_torch_dtype() -> None:
    import torch

    from shardkit.formats.dtypes import resolve_torch_dtype

    assert resolve_torch_dtype(None) is None
    assert resolve_torch_dtype(torch.float16) is torch.float16
    assert resolve_torch_dtype("bf16") is torch.bfloat16
    assert resolve_torch_dtype("bfloat16") is torch.bfloat16
    assert resolve_torch_dtype("F32") is torch.float32
    with pytest.raises(InvalidInputError):
        resolve_torch_dtype("nope")


def test_format_count_never_rounds_a_small_model_to_zero() -> None:
    from shardkit.units import format_count

    assert format_count(2_567_000_000) == "2.57B"
    assert format_count(859_520_964) == "859.5M"
    assert format_count(91_654) == "91.7K"
    assert format_count(42) == "42"
