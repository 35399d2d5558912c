"""``shardkit.save_sharded``: the single-process save, or with ``process_group`` a collective one."""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, TypeAlias

from ..sharding.job import SplitResult
from ..sharding.options import WriteOptions
from ..sharding.split import save_state
from .group import DistributedError, agree, check_world_size, rank_and_world, status_of

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup
    from typing_extensions import Unpack

    from ..sharding.native import NativeModel
    from ..sharding.options import SaveKeywords

# A state dict (tensors on any device, DTensors too) or a module (plain, diffusers or transformers).
StateDictOrModule: TypeAlias = "Mapping[str, torch.Tensor] | torch.nn.Module"

__all__ = ["save_sharded"]


def save_sharded(obj: StateDictOrModule, output: str | os.PathLike[str], *, options: WriteOptions | None = None,
                 process_group: ProcessGroup | None = None, **shorthands: Unpack[SaveKeywords]) -> SplitResult:
    """Save a state dict or ``nn.Module`` (tensors on any device) as sharded safetensors; collectively
    over ``process_group``.

    Tensors are moved to the host one at a time; tied tensors are written once and their other
    names recorded as aliases in the shard metadata. A diffusers ``ModelMixin`` or transformers
    ``PreTrainedModel`` is saved in its library's layout, so its ``from_pretrained(output)`` loads
    it: that library's file names (``diffusion_pytorch_model*`` / ``model*``) and its
    ``config.json`` (plus transformers' ``generation_config.json`` when the model generates),
    published with the shards in one transaction.

    Without DTensors and without ``process_group`` one process writes everything
    (:func:`shardkit.sharding.split.save_state`). With them, every rank of the group must call
    it (an FSDP2 ``fully_shard`` model, or a state dict of ``DTensor`` s): rank 0 plans from the
    global shapes (the plan a single process gives for the full state dict), the shards are
    divided among the ranks by bytes, each rank gathers the full tensors of its own shards one
    at a time and writes them, and rank 0 publishes the index and manifest atomically once every
    rank has succeeded. Any rank's failure raises on every rank and publishes nothing. The
    output must be one folder on a filesystem every rank sees.

    Args:
        obj: a ``{name: tensor}`` mapping, an ``nn.Module``, a diffusers or transformers model;
            its tensors may be DTensors.
        output: the output folder (the same folder on every rank).
        process_group: the ``torch.distributed`` group whose ranks all call this (None with
            DTensors: the default group).
        options: the :class:`~shardkit.sharding.options.WriteOptions` of the write (default: the defaults).
        **shorthands: :class:`~shardkit.sharding.options.SaveKeywords`, the fields by name
            (``max_shard_size="5GB"``, ``"2GiB"`` or an int for ``max_shard_bytes``), applied over ``options``.

    Returns:
        The :class:`~shardkit.sharding.job.SplitResult`, the same on every rank.

    fully_shard(model)
    shardkit.save_sharded(model, "out/", max_shard_size="5GB", process_group=dist.group.WORLD)
    """
    from ..sharding.native import native_model
    from ..sources.memory import module_state_dict
    from .gather import is_dtensor

    options = WriteOptions.build(options, shorthands, where="save_sharded()", save=True)
    with native_model(obj, cast_to=options.cast_to) as native:  # prepared once, whichever writer runs
        state = native.state_dict if native is not None else module_state_dict(obj)
        if process_group is None and not any(is_dtensor(t) for t in state.values()):
            return save_state(state, output, options=options, native=native,
                              description=f"in-memory {type(obj).__name__}")
        return _save_collective(obj, state, native, os.fspath(output), options=options, process_group=process_group)


def _save_collective(obj: object, state: Mapping[str, torch.Tensor], native: NativeModel | None, output: str, *,
                     options: WriteOptions, process_group: ProcessGroup | None) -> SplitResult:
    from ..formats.index import Naming
    from .collective import write_collective
    from .gather import GatheredSource, mesh_sizes

    order, aliases = _rank0_layout(state, keep=native.keep if native else (), process_group=process_group)
    source = GatheredSource(state, order=order, aliases=aliases, naming=native.naming if native else Naming(),
                            description=f"in-memory {type(obj).__name__} (distributed)")
    with source:
        return write_collective(source, output, options=options, process_group=process_group,
                                side_files=native.side_files if native else (), gather=source.gatherer,
                                mesh_sizes=mesh_sizes(state))


def _rank0_layout(state: Mapping[str, torch.Tensor], *, keep: Collection[str], process_group: ProcessGroup | None
                  ) -> tuple[list[str], dict[str, str]]:
    """Rank 0's write order and ties (huggingface_hub's rules, on its local shards), on every rank.

    Ties come from storage sharing, which only a rank's local tensors show; rank 0 decides so that
    every rank writes the same plan. Every rank's tensors (names, dtypes, global shapes) and
    world size are compared first, so a rank with another model fails here on every rank.
    """
    from ..sources.memory import MemorySource, check_all_tensors
    from .assign import plan_signature
    from .gather import local_view, mesh_sizes

    rank, _ = rank_and_world(process_group)
    status = check_world_size(process_group, sizes=mesh_sizes(state))
    try:
        check_all_tensors(state, where="distributed state dict")
        rows = sorted([n, str(t.dtype), list(t.shape)] for n, t in state.items())
        layout = None
        if rank == 0:  # the single-process writer's order and ties, on rank 0's local tensors
            local = MemorySource(local_view(state), description="rank 0's local tensors", keep=keep)
            layout = ([e.name for e in local.entries()], local.aliases())
        status.payload = (plan_signature(rows), layout)
    except Exception as e:  # every rank must hear of it
        agree(process_group, status_of(rank, e), what="planning the collective save")  # raises on every rank
        raise
    statuses = agree(process_group, status, what="planning the collective save")
    differ = [s.rank for s in statuses if s.payload[0] != statuses[0].payload[0]]
    if differ:
        raise DistributedError(f"rank(s) {', '.join(map(str, differ))} planned different shards than rank 0 "
                               "(other tensor names, dtypes or shapes): call save_sharded with the same model on "
                               "every rank; nothing was published")
    agreed: tuple[list[str], dict[str, str]] = statuses[0].payload[1]
    return agreed
