"""Synchronous host reads: one tensor's bytes into its memory, and casts through a small buffer.

A cast goes through one small reusable buffer per thread, so memory never depends on the
tensor's size (a whole-tensor temporary would also fragment the heap, pinning a second copy's
worth of RAM).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..formats.header import TensorEntry
from .readers import pread_exact

if TYPE_CHECKING:
    import torch

CAST_CHUNK_BYTES = 16 << 20


def read_into(fd: int, tensor: torch.Tensor, offset: int, nbytes: int, *, where: str) -> None:
    """``pread`` ``nbytes`` at ``offset`` straight into a contiguous CPU tensor's memory."""
    pread_exact(fd, tensor.data_ptr(), offset, nbytes, where=where)


def cast_staging() -> torch.Tensor:
    """A fresh staging buffer for :func:`read_cast` (keep one per thread)."""
    import torch

    return torch.empty(CAST_CHUNK_BYTES, dtype=torch.uint8)


def read_cast(fd: int, entry: TensorEntry, src_dtype: torch.dtype, dtype: torch.dtype, *,
              staging: torch.Tensor) -> torch.Tensor:
    """Read ``entry`` from ``fd`` chunk by chunk through ``staging``, cast into a new ``dtype`` tensor."""
    import torch

    out = torch.empty(entry.shape, dtype=dtype)
    flat = out.view(-1)
    itemsize = src_dtype.itemsize
    per_chunk = max(1, staging.numel() // itemsize)
    for start in range(0, flat.numel(), per_chunk):
        count = min(per_chunk, flat.numel() - start)
        chunk = staging[: count * itemsize]
        read_into(fd, chunk, entry.offset + start * itemsize, count * itemsize,
                  where=f"{entry.file}: tensor {entry.name!r}")
        flat[start:start + count].copy_(chunk.view(src_dtype))
    return out
