"""Full tensors of a DTensor state dict, gathered one at a time in plan order by every rank together.

``DTensor.full_tensor()`` is a collective: every rank must call it for every tensor, in the same
order. :class:`Gatherer` walks one agreed sequence (the plan's non-empty tensors, shard by
shard); the owner of a shard keeps each tensor while its writer reads it, every other rank drops
it at once, so no rank holds more than one gathered tensor beyond its own local shards. Where a
tensor lives comes from its placements (``Shard``, ``Replicate``), never from its values.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, TypeGuard

from ..formats.header import TensorEntry
from ..formats.index import Naming
from ..sources.base import Source
from ..sources.memory import check_all_tensors, host_bytes
from ..units import tensor_nbytes

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup
    from torch.distributed.tensor import DTensor

__all__ = ["GatheredSource", "Gatherer", "is_dtensor", "local_view", "mesh_sizes"]


def is_dtensor(t: object) -> TypeGuard[DTensor]:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor``."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_view(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each DTensor's local shard, other tensors as they are (for storage-based tie detection)."""
    return {name: t.to_local() if is_dtensor(t) else t for name, t in tensors.items()}


def mesh_sizes(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, int]]:
    """``(name, number of ranks its mesh spans)`` for every DTensor."""
    return [(name, t.device_mesh.size()) for name, t in tensors.items() if is_dtensor(t)]


class Gatherer:
    """Walks ``sequence`` (tensor names) collectively; :meth:`take` returns a full tensor on the host.

    Every rank advances through the same sequence: :meth:`take` gathers every tensor up to the
    one asked for (dropping the others), :meth:`skip_through` and :meth:`drain` gather and drop.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], sequence: list[str]) -> None:
        self._tensors = tensors
        self._sequence = sequence
        self._position = {name: i for i, name in enumerate(sequence)}
        self._next = 0
        self._owner_of: dict[str, int] = {}
        self._rank = 0
        self._group: ProcessGroup | None = None
        self.gathered_bytes = 0

    def assign(self, owner_of: Mapping[str, int], *, rank: int, process_group: ProcessGroup | None) -> None:
        """Who writes each tensor: only that rank receives it (otherwise every rank gets every tensor)."""
        self._owner_of, self._rank, self._group = dict(owner_of), rank, process_group

    def take(self, name: str) -> torch.Tensor:
        """The full tensor ``name`` (which must be at or after the current position)."""
        target = self._position[name]
        if target < self._next:
            raise RuntimeError(f"tensor {name!r} was already gathered; the writer read out of plan order")
        while self._next < target:
            self._gather(self._sequence[self._next])
        full = self._gather(name)
        if full is None:  # gathered to its owner only: the plan gave this tensor to another rank
            raise RuntimeError(f"tensor {name!r} is written by another rank; the writer read it out of plan")
        return full

    def skip_through(self, names: Collection[str]) -> None:
        """Gather and drop up to the last of ``names`` (a shard another rank writes)."""
        last = max((self._position[n] for n in names if n in self._position), default=-1)
        while self._next <= last:
            self._gather(self._sequence[self._next])

    def drain(self, error: BaseException | None) -> BaseException | None:
        """Join the remaining gathers (after a failure too, so the others do not block); the first error."""
        try:
            while self._next < len(self._sequence):
                self._gather(self._sequence[self._next])
        except RuntimeError as e:  # a peer died (torch's DistBackendError): nothing more can be gathered
            return error or e
        return error

    def _gather(self, name: str) -> torch.Tensor | None:
        self._next += 1
        t = self._tensors[name]
        if not is_dtensor(t):
            return t
        owner = self._owner_of.get(name)
        full = gather_to(t, owner, rank=self._rank, process_group=self._group) if owner is not None \
            else t.full_tensor()
        if full is not None:
            self.gathered_bytes += full.numel() * full.element_size()
        return full


def gather_to(t: DTensor, owner: int, *, rank: int, process_group: ProcessGroup | None) -> torch.Tensor | None:
    """The full tensor of DTensor ``t`` on rank ``owner`` (of ``process_group``) only; None elsewhere.

    A 1-D mesh placed ``Replicate`` needs no communication; ``Shard(d)`` is one ``dist.gather`` of
    the local chunks (padded to torch's chunk size) to the owner. Other layouts all-gather
    (``full_tensor``) on every rank.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard

    mesh, placement = t.device_mesh, t.placements[0]
    ranks = mesh.mesh.flatten().tolist()
    owner_global = dist.get_global_rank(process_group, owner) if process_group is not None else owner
    if mesh.ndim != 1 or ranks != sorted(ranks) or owner_global not in ranks or \
            not isinstance(placement, (Shard, Replicate)):
        return t.full_tensor()
    if isinstance(placement, Replicate):
        return t.to_local() if rank == owner else None
    dim, size, parts = placement.dim, t.shape[placement.dim], len(ranks)
    chunk = -(-size // parts)
    local = t.to_local()
    padded = torch.zeros((*local.shape[:dim], chunk, *local.shape[dim + 1:]), dtype=local.dtype)
    padded.narrow(dim, 0, local.shape[dim]).copy_(local)
    pieces = [torch.empty_like(padded) for _ in ranks] if rank == owner else None
    dist.gather(padded, pieces, dst=owner_global, group=mesh.get_group())
    if pieces is None:
        return None
    sizes = [max(0, min(chunk, size - i * chunk)) for i in range(parts)]
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(pieces, sizes, strict=True)], dim=dim)


class GatheredSource(Source):
    """A DTensor state dict as a source: global shapes; bytes from :class:`Gatherer` on demand.

    Args:
        tensors: name → DTensor or tensor.
        order: the names in write order, tied names left out (rank 0's, broadcast).
        aliases: dropped tied name → written name (rank 0's).
        naming: the output file naming.
    """

    shard_rule = "huggingface_hub"

    def __init__(self, tensors: Mapping[str, torch.Tensor], *, order: list[str], aliases: dict[str, str],
                 naming: Naming = Naming(), description: str = "distributed state dict") -> None:
        from ..formats.dtypes import from_torch

        check_all_tensors(tensors, where=description)
        self.description = description
        self.naming = naming
        self._tensors = dict(tensors)
        self._aliases = aliases
        self._entries = [TensorEntry(n, from_torch(self._tensors[n].dtype), tuple(self._tensors[n].shape),
                                     tensor_nbytes(from_torch(self._tensors[n].dtype), tuple(self._tensors[n].shape)))
                         for n in order]
        self.gatherer = Gatherer(self._tensors, [e.name for e in self._entries if e.nbytes])
        self._cached: tuple[str, memoryview] | None = None

    def entries(self) -> list[TensorEntry]:
        return list(self._entries)

    def aliases(self) -> dict[str, str]:
        return dict(self._aliases)

    def read(self, entry: TensorEntry, begin: int, end: int) -> bytes | memoryview:
        if self._cached is None or self._cached[0] != entry.name:
            self._cached = None  # drop the previous full tensor before gathering the next
            self._cached = (entry.name, host_bytes(self.gatherer.take(entry.name)))
        return self._cached[1][begin:end]

    def close(self) -> None:
        self._cached = None
        super().close()
