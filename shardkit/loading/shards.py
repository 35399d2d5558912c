"""One shard of a lazy checkpoint: its open state, and the checks that keep reads honest.

A shard must hold exactly the tensors its index assigns to it, and must not change on disk while
it is open: a truncated memory map would crash the process with SIGBUS on the next touch, a
rewritten file would mix old and new bytes.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointIndexError, InvalidInputError
from ..formats.header import Header, TensorEntry
from .readers import Reader

if TYPE_CHECKING:
    import torch


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


def check_shard_names(shard: Shard, header: Header) -> None:
    """A shard must hold exactly the tensors its index assigns to it."""
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


class TensorSlice:
    """Partial reads of one tensor, like ``safetensors.safe_open(...).get_slice``.

    Indexing returns a fresh tensor holding just the indexed part; ``ckpt.get_slice("w")[0:2, :]``
    reads only those rows' pages.
    """

    def __init__(self, checkpoint: Any, name: str) -> None:  # a LazyCheckpoint (which imports this module)
        self._checkpoint = checkpoint
        self._name = name

    def get_shape(self) -> list[int]:
        """The tensor's shape, from the header."""
        return list(self._checkpoint.shape_of(self._name))

    def get_dtype(self) -> "torch.dtype":
        """The tensor's stored dtype, from the header."""
        return self._checkpoint.dtype_of(self._name)

    def __getitem__(self, index: Any) -> "torch.Tensor":
        return self._checkpoint.get_tensor(self._name)[index].clone()
