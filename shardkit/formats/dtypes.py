"""Mapping between safetensors dtype codes and torch dtypes (torch is imported lazily)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import InvalidInputError

if TYPE_CHECKING:
    import torch

_CODE_TO_TORCH_NAME = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
    "F16": "float16", "BF16": "bfloat16", "I32": "int32", "U32": "uint32", "F32": "float32",
    "C64": "complex64", "F64": "float64", "I64": "int64", "U64": "uint64",
    "F8_E5M2": "float8_e5m2", "F8_E4M3": "float8_e4m3fn", "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
}


def to_torch(code: str) -> torch.dtype:
    """The torch dtype for a safetensors code, e.g. ``to_torch("BF16") is torch.bfloat16``."""
    import torch

    name = _CODE_TO_TORCH_NAME.get(code)
    dtype: torch.dtype | None = getattr(torch, name, None) if name else None
    if dtype is None:
        raise InvalidInputError(f"dtype {code} has no torch equivalent in this torch version ({torch.__version__})")
    return dtype


def from_torch(dtype: torch.dtype) -> str:
    """The safetensors code for a torch dtype, e.g. ``from_torch(torch.float16) == "F16"``."""
    name = str(dtype).removeprefix("torch.")
    for code, torch_name in _CODE_TO_TORCH_NAME.items():
        if torch_name == name:
            return code
    raise InvalidInputError(f"torch dtype {dtype} cannot be stored in safetensors")


def resolve_torch_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """Accept ``torch.bfloat16``, ``"bf16"``, ``"bfloat16"`` or ``"BF16"``."""
    if value is None:
        return None
    import torch

    if isinstance(value, torch.dtype):
        return value
    from ..units import normalize_dtype

    return to_torch(normalize_dtype(str(value)))
