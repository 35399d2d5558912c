"""Mapping between safetensors dtype codes and torch dtypes (torch is imported lazily)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import InvalidInputError
from ..units import TORCH_NAMES

if TYPE_CHECKING:
    import torch



def to_torch(code: str) -> torch.dtype:
    """The torch dtype for a safetensors code, e.g. ``to_torch("BF16") is torch.bfloat16``."""
    import torch

    name = TORCH_NAMES.get(code)
    dtype: torch.dtype | None = getattr(torch, name, None) if name else None
    if dtype is None:
        raise InvalidInputError(f"dtype {code} has no torch equivalent in this torch version ({torch.__version__})")
    return dtype


def from_torch(dtype: torch.dtype) -> str:
    """The safetensors code for a torch dtype, e.g. ``from_torch(torch.float16) == "F16"``."""
    name = str(dtype).removeprefix("torch.")
    for code, torch_name in TORCH_NAMES.items():
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
