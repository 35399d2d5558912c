"""The shard planner: names and byte sizes in, a :class:`ShardPlan` out. No I/O, no torch.

Greedy in key order, the limit counts tensor bytes only (headers are not counted), and a tensor
larger than the limit gets a shard of its own at its key-order position, as huggingface_hub
does. One shard means one file with no ``-0000x-of-0000y`` suffix and no index.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from ..errors import InvalidInputError
from ..formats.index import Naming


@dataclass(frozen=True)
class ShardSpec:
    """One output file and the tensors it holds, in write order."""

    filename: str
    names: tuple[str, ...]
    nbytes: int


@dataclass(frozen=True)
class ShardPlan:
    """Where every tensor goes. ``index_filename`` is None for a single-file output."""

    shards: tuple[ShardSpec, ...]
    index_filename: str | None
    total_bytes: int
    max_shard_bytes: int
    naming: Naming = field(default_factory=Naming)

    def weight_map(self) -> dict[str, str]:
        return {name: shard.filename for shard in self.shards for name in shard.names}

    def filenames(self) -> list[str]:
        files = [s.filename for s in self.shards]
        return files + [self.index_filename] if self.index_filename else files


def plan_shards(items: Iterable[tuple[str, int]], *, max_shard_bytes: int, naming: Naming = Naming()) -> ShardPlan:
    """Group ``(name, nbytes)`` pairs into shards of at most ``max_shard_bytes`` tensor bytes.

    Args:
        items: ``(tensor name, byte count)`` pairs in write order; names must be unique.
        max_shard_bytes: the limit on a shard's tensor bytes; a larger tensor gets its own shard.
        naming: the file naming (prefix, variant) of the shards and index.

    Returns:
        A :class:`ShardPlan`; one shard means a single file with no index.

    >>> plan = plan_shards([("a", 6), ("b", 6), ("c", 20), ("d", 1)], max_shard_bytes=10)
    >>> [s.names for s in plan.shards]
    [('a',), ('b',), ('c',), ('d',)]
    >>> plan.shards[0].filename
    'model-00001-of-00004.safetensors'
    """
    if max_shard_bytes <= 0:
        raise InvalidInputError(f"max shard size must be positive, got {max_shard_bytes}")
    groups: list[list[tuple[str, int]]] = []
    current: list[tuple[str, int]] = []
    current_bytes = 0
    seen: set[str] = set()
    for name, nbytes in items:
        if name in seen:
            raise InvalidInputError(f"tensor {name!r} appears twice in the source")
        seen.add(name)
        if current and (nbytes > max_shard_bytes or current_bytes + nbytes > max_shard_bytes):
            groups.append(current)
            current, current_bytes = [], 0
        current.append((name, nbytes))
        current_bytes += nbytes
        if nbytes > max_shard_bytes:
            groups.append(current)
            current, current_bytes = [], 0
    if current:
        groups.append(current)
    if not groups:
        raise InvalidInputError("the source holds no tensors; nothing to shard")
    return _name_groups(groups, max_shard_bytes, naming)


def _name_groups(groups: list[list[tuple[str, int]]], max_shard_bytes: int, naming: Naming) -> ShardPlan:
    total = len(groups)
    shards = tuple(
        ShardSpec(
            naming.single() if total == 1 else naming.shard(i + 1, total),
            tuple(name for name, _ in group),
            sum(nbytes for _, nbytes in group),
        )
        for i, group in enumerate(groups)
    )
    return ShardPlan(
        shards=shards,
        index_filename=None if total == 1 else naming.index(),
        total_bytes=sum(s.nbytes for s in shards),
        max_shard_bytes=max_shard_bytes,
        naming=naming,
    )
