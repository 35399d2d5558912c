"""The few ``torch.distributed`` calls the collective jobs make, and how failures travel between ranks.

Every step that can fail on one rank ends in an exchange of :class:`RankStatus` records
(``all_gather_object``), so a failure on any rank raises the same one-line error on every rank
instead of leaving the others blocked in the next collective. torch is imported lazily.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import DistributedError as DistributedError  # re-exported: defined with every public error
from ..errors import InvalidInputError, ShardkitError, first_line

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["DistributedError", "RankStatus", "agree", "broadcast_from_zero", "check_world_size",
           "end_group", "group_from_env", "rank_and_world"]


@dataclass
class RankStatus:
    """One rank's outcome of a step: ``error`` is None on success; ``payload`` is what it sends along."""

    rank: int
    error: str | None = None
    payload: Any = None


def rank_and_world(process_group: ProcessGroup | None) -> tuple[int, int]:
    """This process's rank in ``process_group`` and the group's size."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise InvalidInputError("process_group was given but torch.distributed is not initialized; "
                                "call torch.distributed.init_process_group first (or run under torchrun)")
    return dist.get_rank(process_group), dist.get_world_size(process_group)


def agree(process_group: ProcessGroup | None, status: RankStatus, *, what: str) -> list[RankStatus]:
    """Exchange every rank's status of step ``what``; raise the same error on every rank if one failed.

    agree(pg, RankStatus(rank), what="writing shards")
    """
    import torch.distributed as dist

    statuses: list[Any] = [None] * dist.get_world_size(process_group)
    try:
        dist.all_gather_object(statuses, status, group=process_group)
    except RuntimeError as e:  # a peer died: its socket closed under the collective
        raise DistributedError(f"{what}: lost contact with another rank ({_first_line(e)}); "
                               "nothing was published") from e
    failed = [s for s in statuses if s.error is not None]
    if failed:
        raise DistributedError(f"{what} failed: " + "; ".join(f"rank {s.rank}: {s.error}" for s in failed)
                               + "; nothing was published")
    return statuses


def broadcast_from_zero(process_group: ProcessGroup | None, status: RankStatus | None, *, what: str) -> RankStatus:
    """Rank 0's ``status`` on every rank; raise on every rank if rank 0 failed."""
    import torch.distributed as dist

    box = [status]
    src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    try:
        dist.broadcast_object_list(box, src=src, group=process_group)
    except RuntimeError as e:
        raise DistributedError(f"{what}: lost contact with rank 0 ({_first_line(e)}); nothing was published") from e
    got = box[0]
    assert got is not None
    if got.error is not None:
        raise DistributedError(f"{what} failed on rank 0: {got.error}; nothing was published")
    return got


def tell_failure(process_group: ProcessGroup | None, status: RankStatus, *, what: str, from_zero: bool = False) -> None:
    """Send a failed ``status`` to the other ranks (each raises there), so that none blocks in the next
    collective; the caller then raises its own error. ``from_zero``: rank 0 broadcasts, else every rank agrees."""
    with contextlib.suppress(DistributedError):
        if from_zero:
            broadcast_from_zero(process_group, status, what=what)
        else:
            agree(process_group, status, what=what)


def status_of(rank: int, error: BaseException | None, payload: Any = None) -> RankStatus:
    """The status record of a step that raised ``error`` (or None)."""
    return RankStatus(rank, None if error is None else error_line(error), payload)


def error_line(error: BaseException) -> str:
    """One line naming ``error``: shardkit's own message, or the exception type and first line."""
    if isinstance(error, ShardkitError):
        return _first_line(error).removesuffix("; nothing was published")
    return f"{type(error).__name__}: {_first_line(error)}"


def _first_line(error: BaseException) -> str:
    return first_line(error, limit=10_000)


def check_world_size(process_group: ProcessGroup | None, *, sizes: Sequence[tuple[str, int]] = ()) -> RankStatus:
    """This rank's check that every world size it sees agrees with the group's.

    ``WORLD_SIZE`` (torchrun's) must equal the size of the default group (a rank started by
    another launch disagrees here); ``process_group`` may be any subgroup of it. Each DTensor
    mesh in ``sizes`` must not exceed ``process_group``.
    """
    import torch.distributed as dist

    rank, world = rank_and_world(process_group)
    env, everyone = os.environ.get("WORLD_SIZE", "").strip(), dist.get_world_size()
    if env.isdigit() and int(env) != everyone:
        return RankStatus(rank, f"WORLD_SIZE={env} but the default process group has {everyone} ranks: "
                                "start every rank with the same --nnodes/--nproc-per-node")
    for name, size in sizes:
        if size > world:
            return RankStatus(rank, f"tensor {name!r} is spread over {size} ranks but the process group has "
                                    f"{world}: pass the process group the model was sharded over")
    return RankStatus(rank)


@contextlib.contextmanager
def group_from_env(*, timeout_s: float = 300.0) -> Iterator[bool]:
    """A gloo process group from torchrun's environment for the ``with`` block; yields True when distributed.

    Yields False for a single process (no ``WORLD_SIZE`` or ``WORLD_SIZE=1``). A group this
    function starts is ended on every path: after success every rank waits for the others
    (a barrier bounded by ``timeout_s``), so none exits while another still publishes, then
    the group is destroyed, so no gloo thread outlives the interpreter (which aborts the
    process). A group someone else started is left as it is.

    with group_from_env() as distributed:
        run_the_job(collective=distributed)
    """
    env = os.environ.get("WORLD_SIZE", "").strip()
    if not env.isdigit() or int(env) <= 1:
        yield False
        return
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    succeeded = False
    try:
        yield True
        succeeded = True
    finally:
        if created:
            end_group(barrier=succeeded, timeout_s=timeout_s)


def end_group(*, barrier: bool, timeout_s: float) -> None:
    """Destroy the default group, after a bounded barrier when ``barrier`` (the job succeeded everywhere)."""
    import torch.distributed as dist

    try:
        if barrier:
            try:
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s))
            except RuntimeError as e:  # the output is published; a rank that died after it is worth saying
                raise DistributedError(f"waiting for the other ranks to finish: {_first_line(e)}") from e
    finally:
        gc.collect()  # objects in reference cycles may hold the group; its gloo threads must end before exit
        dist.destroy_process_group()


def is_rank_zero() -> bool:
    """Whether this process is rank 0 of the default group (or not distributed at all)."""
    import sys

    if "torch" not in sys.modules:
        return os.environ.get("RANK", "0").strip() in ("", "0")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0").strip() in ("", "0")
