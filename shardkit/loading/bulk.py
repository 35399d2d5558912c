"""Read many tensors at once for ``load_model``: parallel reads onto the host, a ring pipeline onto GPUs.

``pread``/``direct`` shards headed for the host are read in one parallel batch per shard into
tensors allocated once. Tensors headed for a CUDA device (any backend) go through
:func:`shardkit.loading.pipeline_copy.run_ring`, one run per device over every file: a ring of
pinned slots filled by parallel reads in file order, ``non_blocking`` copies on side streams,
destinations allocated once on the device, casts done there after the copy. Everything else (memory-mapped host
tensors, host casts) is left to ``LazyCheckpoint.get_tensor``, one tensor at a time.

When everything goes to the host, :func:`start_early_reads` starts that batch before the skeleton
exists (on one bounded worker thread, the reads themselves on the checkpoint's reader threads), so
the skeleton build and key matching run while the bytes arrive; :func:`take_early_reads` collects it.

values, report = read_batch(ckpt, {"w": Want("w", "cuda:0", torch.bfloat16)})
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

from ..devices import DeviceKey
from ..errors import ShardkitError
from ..workers import ReadPool
from .device_reads import Want as Want  # re-exported: callers build wants for read_batch
from .device_reads import read_devices
from .lazy import LazyCheckpoint
from .pipeline_copy import CopyStage, default_stage

if TYPE_CHECKING:
    import torch

log = logging.getLogger("shardkit")


@dataclass
class BatchReport:
    """What the batch did: per-file backends (from the checkpoint) and the bytes per path."""

    files: list[dict[str, str | None]] = field(default_factory=list)
    host_batch_bytes: int = 0
    pipelined_bytes: int = 0        # bytes copied onto devices through the ring


def _is_host(device: DeviceKey) -> bool:
    import torch

    return torch.device(device).type == "cpu" if not isinstance(device, int) else False


def read_batch(checkpoint: LazyCheckpoint, wants: dict[str, Want], *, pipe_host: bool = False,
               stage_for: Callable[[DeviceKey], CopyStage] | None = None) -> tuple[dict[str, torch.Tensor], BatchReport]:
    """Read what can be batched; the caller reads the rest with ``get_tensor``.

    Args:
        checkpoint: the open checkpoint.
        wants: model name → what to read.
        pipe_host: send host tensors through the ring pipeline too (how CPU tests run the GPU path).
        stage_for: device → copy stage; None uses :class:`CudaCopyStage` for GPUs and
            :class:`HostCopyStage` for the host.

    Returns:
        ``(values, report)``: model name → tensor for what was read here.

    values, report = read_batch(ckpt, wants)
    """
    report = BatchReport()
    values: dict[str, torch.Tensor] = {}
    piped = {n: w for n, w in wants.items() if pipe_host or not _is_host(w.device)}
    _read_host(checkpoint, {n: w for n, w in wants.items() if n not in piped}, values, report)
    if piped:
        moved = read_devices(checkpoint, piped, stage_for or default_stage)
        values.update(moved.values)
        report.pipelined_bytes += moved.copied_bytes
    report.files = checkpoint.read_report()
    return values, report


def _read_host(checkpoint: LazyCheckpoint, wants: dict[str, Want], values: dict[str, torch.Tensor],
               report: BatchReport) -> None:
    """pread/direct shards, no cast: one parallel batch per shard, straight into fresh memory."""
    batch = {name: want.src for name, want in wants.items()
             if checkpoint.reader_of(want.src) is not None and checkpoint.dtype_of(want.src) == want.dtype}
    read = checkpoint.read_many(list(dict.fromkeys(batch.values())))
    for name, src in batch.items():
        values[name] = read[src]
        report.host_batch_bytes += checkpoint.nbytes(src)


def start_early_reads(pool: ReadPool, checkpoint: LazyCheckpoint, *,
                      dtype: torch.dtype | None) -> Future[dict[str, torch.Tensor]]:
    """Start reading, on ``pool``'s thread, the host tensors a load onto the host keeps as stored: every
    tensor of a ``pread``/``direct`` shard (with ``dtype``: those stored in it and the non-floating
    ones), with one plan over all shards (``LazyCheckpoint.read_many``). Memory-mapped shards are
    left alone (their tensors are views, nothing to read ahead).

    Closing the checkpoint cancels the reads still queued; the caller then closes ``pool`` (bounded).

        future = start_early_reads(pool, ckpt, dtype=None)
        ready = take_early_reads(future)
    """
    return pool.submit(partial(_read_early, checkpoint, dtype))


def _read_early(checkpoint: LazyCheckpoint, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    checkpoint.open_shards()  # all at once: one by one they cost a few round trips each before any read
    names = [name for name in checkpoint if checkpoint.reader_of(name) is not None]
    if dtype is not None:
        names = [name for name in names if _stays(checkpoint.dtype_of(name), dtype)]
    return checkpoint.read_many(names)


def _stays(stored: torch.dtype, dtype: torch.dtype) -> bool:
    return stored == dtype or not stored.is_floating_point


def take_early_reads(future: Future[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Wait for :func:`start_early_reads`: checkpoint name → host tensor. A shardkit error there (a
    corrupt shard holding a tensor the model may not even use) gives ``{}``: the caller reads what
    the model needs itself and meets that error only if it matters."""
    try:
        return future.result()
    except ShardkitError as e:
        log.debug("reads started before the skeleton failed (%s); reading what the model needs now", e)
        return {}
