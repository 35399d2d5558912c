"""Partial reads of one tensor, like ``safetensors.safe_open(...).get_slice``: only the rows asked for.

A slice's first index (an int or a forward slice) picks a contiguous range of rows (the tensor's
leading dimension): only that byte range is read (``pread``/``direct`` shards) or paged in
(memory-mapped ones); the other indices are applied to those rows. Any other index reads the
tensor whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


def row_range(index: Any, rows: int) -> tuple[int, int, Any] | None:
    """``(start, stop, rest)``: the rows an index touches and the index to apply to them; None when
    the index is not a leading int or forward slice.

    >>> row_range((slice(2, 8, 2), 0), 10)
    (2, 7, (slice(None, None, 2), 0))
    >>> row_range(slice(5, 5), 10)
    (5, 5, (slice(None, None, 1),))
    >>> row_range(-1, 10)
    (9, 10, (0,))
    >>> row_range(..., 10) is None
    True
    """
    parts = index if isinstance(index, tuple) else (index,)
    if not parts:
        return None
    first, rest = parts[0], parts[1:]
    if isinstance(first, int) and not isinstance(first, bool):
        row = first + rows if first < 0 else first
        if not 0 <= row < rows:
            raise IndexError(f"index {first} is out of bounds for dimension 0 with size {rows}")
        return row, row + 1, (0, *rest)
    if isinstance(first, slice) and (first.step is None or first.step > 0):
        start, stop, step = first.indices(rows)
        last = start + (stop - start - 1) // step * step if stop > start else start - 1  # the last row picked
        return start, last + 1, (slice(None, None, step), *rest)
    return None


class RowSource(Protocol):
    """What a slice reads through: a :class:`~shardkit.loading.lazy.LazyCheckpoint` (which imports this module)."""

    def shape_of(self, name: str) -> tuple[int, ...]: ...

    def dtype_of(self, name: str) -> torch.dtype: ...

    def get_tensor(self, name: str) -> torch.Tensor: ...

    def read_rows(self, name: str, start: int, stop: int) -> tuple[torch.Tensor, bool]: ...


class TensorSlice:
    """A handle for partial reads: ``ckpt.get_slice("w")[0:2, :]`` reads only rows 0 and 1.

    Indexing returns a fresh tensor holding just the indexed part.
    """

    def __init__(self, checkpoint: RowSource, name: str) -> None:
        self._checkpoint = checkpoint
        self._name = name

    def get_shape(self) -> list[int]:
        """The tensor's shape, from the header."""
        return list(self._checkpoint.shape_of(self._name))

    def get_dtype(self) -> torch.dtype:
        """The tensor's stored dtype, from the header."""
        return self._checkpoint.dtype_of(self._name)

    def __getitem__(self, index: Any) -> torch.Tensor:
        shape = self.get_shape()
        rows = row_range(index, shape[0]) if shape else None
        if rows is None:
            return self._checkpoint.get_tensor(self._name)[index].clone()
        start, stop, rest = rows
        part, fresh = self._checkpoint.read_rows(self._name, start, stop)
        picked = part[rest]
        return picked.contiguous() if fresh else picked.clone()
