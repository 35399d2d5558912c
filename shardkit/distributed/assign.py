"""Which rank writes which shard: pure arithmetic on the plan, the same on every rank."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

__all__ = ["assign_shards", "plan_signature"]


def assign_shards(shard_bytes: Sequence[int], world: int) -> list[int]:
    """The owner rank of each shard, balancing bytes: largest shard first to the least-loaded rank.

    Ties go to the lower rank, so rank 0 (which also writes the index) gets the first shard.

    Args:
        shard_bytes: each shard's tensor bytes, in plan order.
        world: the number of ranks.

    Returns:
        One owner rank per shard, in plan order.

    >>> assign_shards([10, 10, 5, 5], 2)
    [0, 1, 0, 1]
    >>> assign_shards([3], 4)
    [0]
    """
    load = [0] * world
    owners = [0] * len(shard_bytes)
    for i in sorted(range(len(shard_bytes)), key=lambda i: (-shard_bytes[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += shard_bytes[i]
    return owners


def plan_signature(rows: Sequence[Sequence[object]]) -> str:
    """A short digest of a plan's rows (file, tensor, dtype, shape...), to compare plans across ranks."""
    return hashlib.sha256(json.dumps(list(map(list, rows))).encode()).hexdigest()[:16]
