"""``shardkit.load_into``: fill a model whose parameters are DTensors, each rank reading only its slice.

A DTensor's placements (``Shard(d)``, ``Replicate``) and its mesh give the part of the global
tensor this rank holds (``compute_local_shape_and_global_offset``, torch's own rule, which
FSDP2 follows with its uneven last chunk). That part is a box in the row-major tensor; it is
read as its contiguous runs, each with one ``pread`` straight into the local tensor: a
``Shard(0)`` slice is a single range read, a ``Shard(1)`` slice one read per row. No rank ever
reads or holds the full tensor.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import InvalidInputError, KeyMismatchError
from ..loading.lazy import LazyCheckpoint
from ..loading.opening import open_checkpoint
from ..reading.host_reads import read_into
from .gather import is_dtensor

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch
    from torch.distributed.tensor import DTensor

__all__ = ["RankLoad", "load_into", "slice_runs"]


@dataclass
class RankLoad:
    """What :func:`load_into` did on this rank.

    Attributes:
        tensors: tensors filled.
        read_bytes: checkpoint bytes this rank read.
        global_bytes: bytes of the full tensors it filled (what loading them whole would read).
    """

    tensors: int = 0
    read_bytes: int = 0
    global_bytes: int = 0


def load_into(model: torch.nn.Module, checkpoint: str | os.PathLike[str] | LazyCheckpoint) -> RankLoad:
    """Copy ``checkpoint``'s tensors into ``model`` in place; DTensors get only this rank's slice.

    Args:
        model: an ``nn.Module`` (FSDP2 ``fully_shard`` or DTensor parameters, or plain ones) or a
            state dict of tensors to fill.
        checkpoint: a path ``shardkit.open`` takes, or an open ``LazyCheckpoint``.

    Returns:
        A :class:`RankLoad` with the bytes this rank read.

    Raises:
        KeyMismatchError: the model has tensors the checkpoint lacks, or shapes differ.

    fully_shard(model)
    shardkit.load_into(model, "out/").read_bytes
    """
    import torch

    state = model.state_dict() if isinstance(model, torch.nn.Module) else model
    ckpt = checkpoint if isinstance(checkpoint, LazyCheckpoint) else open_checkpoint(checkpoint)
    owned = ckpt is not checkpoint
    try:
        names = _stored_names(state, ckpt)
        report = RankLoad()
        with torch.no_grad():
            for name, target in state.items():
                _load_one(ckpt, names[name], target, report)
        return report
    finally:
        if owned:
            ckpt.close()


def _stored_names(state: Mapping[str, torch.Tensor], ckpt: LazyCheckpoint) -> dict[str, str]:
    """Each model name → the name its bytes are stored under (tied names resolve to the written one)."""
    aliases = ckpt.aliases
    names = {n: n if n in ckpt else aliases.get(n, n) for n in state}
    missing = sorted(n for n, stored in names.items() if stored not in ckpt)
    if missing:
        raise KeyMismatchError(f"{ckpt.description} lacks {len(missing)} of the model's tensors: "
                               f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    return names


def _load_one(ckpt: LazyCheckpoint, stored: str, target: torch.Tensor, report: RankLoad) -> None:
    entry = ckpt.entry(stored)
    if tuple(entry.shape) != tuple(target.shape):
        raise KeyMismatchError(f"{stored}: the checkpoint holds shape {list(entry.shape)}, the model "
                               f"{list(target.shape)}")
    if is_dtensor(target):
        offsets, local = _local_box(target)
        dest = target.to_local()
    else:
        offsets, local, dest = (0,) * len(entry.shape), tuple(entry.shape), target
    report.tensors += 1
    report.global_bytes += entry.nbytes
    if math.prod(local) == 0:
        return
    from ..formats.dtypes import to_torch

    stored_dtype = to_torch(entry.dtype)
    buffer = dest if dest.dtype == stored_dtype and dest.is_contiguous() and dest.device.type == "cpu" \
        else _empty_tensor(local, stored_dtype)
    itemsize = stored_dtype.itemsize
    fd = os.open(entry.file or "", os.O_RDONLY)
    try:
        for begin, count, at in slice_runs(tuple(entry.shape), offsets, local):
            part = buffer.view(-1)[at:at + count]
            read_into(fd, part, entry.offset + begin * itemsize, count * itemsize, where=f"{entry.file}: {stored!r}")
            report.read_bytes += count * itemsize
    finally:
        os.close(fd)
    if buffer is not dest:
        dest.copy_(buffer)


def _empty_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    import torch

    return torch.empty(shape, dtype=dtype)


def _local_box(target: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's ``(global offset, local shape)`` of a DTensor, from its placements."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for p in target.placements:
        if not isinstance(p, (Shard, Replicate)):
            raise InvalidInputError(f"placement {p} is neither Shard nor Replicate: a checkpoint holds whole "
                                    "tensors, so only those two can be loaded rank-locally")
    local, offsets = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    return tuple(offsets), tuple(local)


def slice_runs(shape: tuple[int, ...], offsets: tuple[int, ...], local: tuple[int, ...]) -> Iterator[tuple[int, int, int]]:
    """The contiguous runs of a box in a row-major tensor: ``(element offset, elements, offset in the box)``.

    The innermost dimensions the box spans whole merge into one run, so a box over leading rows
    (``Shard(0)``) is a single run.

    >>> list(slice_runs((4, 3), (2, 0), (2, 3)))
    [(6, 6, 0)]
    >>> list(slice_runs((2, 4), (0, 2), (2, 2)))
    [(2, 2, 0), (6, 2, 2)]
    """
    if not shape:
        yield 0, 1, 0
        return
    j = len(shape) - 1
    while j > 0 and local[j] == shape[j] and offsets[j] == 0:
        j -= 1
    inner = math.prod(shape[j + 1:])
    count = local[j] * inner
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    at = 0
    for index in _indices(local[:j]):
        begin = sum((offsets[d] + index[d]) * strides[d] for d in range(j)) + offsets[j] * strides[j]
        yield begin, count, at
        at += count


def _indices(extent: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    import itertools

    return itertools.product(*(range(n) for n in extent))
