"""The shard planner: names and byte sizes in, a :class:`ShardPlan` out. No I/O, no torch.

Greedy in key order; the limit counts tensor bytes only (headers are not counted). One shard
means one file with no ``-0000x-of-0000y`` suffix and no index. Two rules differ only in where a
tensor larger than the limit goes; it always gets a shard of its own:

- ``"huggingface_hub"`` (state dicts, :func:`shardkit.save_sharded`): exactly
  ``huggingface_hub.split_torch_state_dict_into_shards``. The oversized tensor's shard is
  numbered at once and the open shard keeps filling, so for a limit of 10 the sizes
  ``[6, 20, 3]`` plan as ``[20], [6, 3]``.
- ``"sequential"`` (safetensors files and folders, whose entries come in data-offset order):
  the oversized tensor closes the open shard, giving ``[6], [20], [3]``. Every shard is then one
  run of the source's bytes, so a split reads its source front to back and the writer copies
  (or reflink-clones) each shard as one coalesced range. The hub's order would interleave: a
  shard ``[6, 3]`` with the 20 between them in the source is two ranges. A hub-equal plan is
  only defined for a state dict anyway, and a file source is not one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ..errors import InvalidInputError
from ..formats.index import Naming
from ..sources.base import ShardRule


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


def plan_shards(items: Iterable[tuple[str, int]], *, max_shard_bytes: int, naming: Naming = Naming(),
                rule: ShardRule = "huggingface_hub") -> ShardPlan:
    """Group ``(name, nbytes)`` pairs into shards of at most ``max_shard_bytes`` tensor bytes.

    Args:
        items: ``(tensor name, byte count)`` pairs in key order; names must be unique.
        max_shard_bytes: the limit on a shard's tensor bytes; a larger tensor gets its own shard.
        naming: the file naming (prefix, variant) of the shards and index.
        rule: where an oversized tensor's shard goes: ``"huggingface_hub"`` numbers it at once and
            keeps filling the open shard; ``"sequential"`` closes the open shard first, so every
            shard is a run of ``items`` (see the module docstring).

    Returns:
        A :class:`ShardPlan`; one shard means a single file with no index.

    >>> items = [("a", 6), ("b", 6), ("c", 20), ("d", 1)]
    >>> [s.names for s in plan_shards(items, max_shard_bytes=10).shards]
    [('a',), ('c',), ('b', 'd')]
    >>> [s.names for s in plan_shards(items, max_shard_bytes=10, rule="sequential").shards]
    [('a',), ('b',), ('c',), ('d',)]
    >>> plan_shards(items, max_shard_bytes=10).shards[0].filename
    'model-00001-of-00003.safetensors'
    """
    if max_shard_bytes <= 0:
        raise InvalidInputError(f"max shard size must be positive, got {max_shard_bytes}")
    if rule not in _RULES:
        raise InvalidInputError(f"unknown shard rule {rule!r}; use one of {', '.join(map(repr, _RULES))}")
    groups = _RULES[rule](_unique(items), max_shard_bytes)
    if not groups:
        raise InvalidInputError("the source holds no tensors; nothing to shard")
    return _name_groups(groups, max_shard_bytes, naming)


def _unique(items: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
    """``items`` as a list, refusing a name that appears twice."""
    seen: set[str] = set()
    out = []
    for name, nbytes in items:
        if name in seen:
            raise InvalidInputError(f"tensor {name!r} appears twice in the source")
        seen.add(name)
        out.append((name, nbytes))
    return out


def _group_like_hub(items: list[tuple[str, int]], max_shard_bytes: int) -> list[list[tuple[str, int]]]:
    """``split_state_dict_into_shards_factory``'s loop: an oversized tensor is a shard of its own,
    listed when it is met, while the open shard keeps filling."""
    groups: list[list[tuple[str, int]]] = []
    current: list[tuple[str, int]] = []
    current_bytes = 0
    for name, nbytes in items:
        if nbytes > max_shard_bytes:
            groups.append([(name, nbytes)])
            continue
        if current_bytes + nbytes > max_shard_bytes:  # never true for an empty open shard
            groups.append(current)
            current, current_bytes = [], 0
        current.append((name, nbytes))
        current_bytes += nbytes
    if current:
        groups.append(current)
    return groups


def _group_sequential(items: list[tuple[str, int]], max_shard_bytes: int) -> list[list[tuple[str, int]]]:
    """Greedy runs of ``items``: an oversized tensor closes the open shard and is closed itself."""
    groups: list[list[tuple[str, int]]] = []
    current: list[tuple[str, int]] = []
    current_bytes = 0
    for name, nbytes in items:
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
    return groups


_RULES = {"huggingface_hub": _group_like_hub, "sequential": _group_sequential}


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
