"""Tensors read straight onto a device: one ring run per device over every file that holds them.

Destinations are allocated once on the device in the stored dtype; the bytes go through the pinned
ring (:mod:`shardkit.loading.pipeline_copy`); a cast to another dtype happens on the device after
the copy. Each file is read through its shard's own reader (``pread``, ``direct`` when cold, ranged
for a store object) or, for a memory-mapped shard, ``pread`` through the descriptor its header was
read from: never by path again, never by DMA from mapped pages.

moved = read_devices(ckpt, {"w": Want("w", "cuda:0", torch.bfloat16)}, default_stage)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ..devices import DeviceKey
from ..formats.header import TensorEntry
from ..reading.readers import REMOTE_THREADS, Reader, open_reader
from .pipeline_copy import LOCAL, REMOTE, CopyStage, RingReport, RingTuning, run_ring
from .ring_plan import CopyJob, byte_view

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Want:
    """One tensor to read: its checkpoint name, where it goes and its final dtype."""

    src: str
    device: DeviceKey       # "cpu" or a torch device / index
    dtype: torch.dtype


class RingSource(Protocol):
    """What a device read needs of a checkpoint (a :class:`~shardkit.loading.lazy.LazyCheckpoint`)."""

    def __iter__(self) -> Iterator[str]: ...

    def entry(self, name: str) -> TensorEntry: ...

    def dtype_of(self, name: str) -> torch.dtype: ...

    def reader_of(self, name: str) -> Reader | None: ...

    def descriptor_of(self, name: str) -> int: ...


@dataclass
class DeviceReads:
    """The tensors read (model name → tensor on its device, final dtype) and the ring's byte counts."""

    values: dict[str, torch.Tensor] = field(default_factory=dict)
    copied_bytes: int = 0
    read_bytes: int = 0


def read_devices(checkpoint: RingSource, wants: dict[str, Want],
                 stage_for: Callable[[DeviceKey], CopyStage]) -> DeviceReads:
    """Per device: destinations allocated once there, every file's bytes for it through one ring run."""
    import torch

    out = DeviceReads()
    by_device: dict[DeviceKey, list[tuple[str, Want]]] = defaultdict(list)
    for name, want in wants.items():
        by_device[want.device].append((name, want))
    for device, items in by_device.items():
        target = torch.device(device)
        stored: dict[str, torch.Tensor] = {}
        jobs: dict[str, list[CopyJob]] = defaultdict(list)   # source name -> copies, in checkpoint order
        for name, want in items:
            entry = checkpoint.entry(want.src)
            stored[name] = dest = torch.empty(entry.shape, dtype=checkpoint.dtype_of(want.src), device=target)
            if entry.nbytes:
                jobs[want.src].append(CopyJob(byte_view(dest), 0, entry.offset, entry.nbytes,
                                              f"{entry.file}: tensor {want.src!r}"))
        report = run_device_ring(checkpoint, jobs, stage_for(device))
        out.copied_bytes += report.copied_bytes
        out.read_bytes += report.read_bytes
        for name, want in items:
            value = stored.pop(name)
            out.values[name] = value if value.dtype == want.dtype else value.to(want.dtype)  # cast on the device
    return out


def run_device_ring(checkpoint: RingSource, jobs_by_src: dict[str, list[CopyJob]], stage: CopyStage) -> RingReport:
    """One ring run over every file holding these copies (keyed by the tensor they come from)."""
    with ExitStack() as stack:
        readers = FileReaders(checkpoint, stack)
        by_file: dict[int, list[CopyJob]] = defaultdict(list)
        for src, jobs in jobs_by_src.items():
            by_file[readers.index_of(src)].extend(jobs)
        return run_ring([(readers.readers[i], jobs) for i, jobs in by_file.items()], stage=stage, tuning=readers.tuning())


class FileReaders:
    """The readers of the files a set of tensors lives in, indexed in first-use order; those opened
    here (for memory-mapped shards) are closed with ``stack``."""

    def __init__(self, checkpoint: RingSource, stack: ExitStack) -> None:
        self._checkpoint = checkpoint
        self._stack = stack
        self._index: dict[str, int] = {}
        self.readers: list[Reader] = []

    def index_of(self, src: str) -> int:
        """The index in :attr:`readers` of the file holding tensor ``src`` (opening its reader)."""
        path = self._checkpoint.entry(src).file or ""
        if path not in self._index:
            reader = self._checkpoint.reader_of(src)
            if reader is None:  # a memory-mapped shard: pread through the descriptor its header came from
                reader = self._stack.enter_context(open_reader(path, "pread", fd=self._checkpoint.descriptor_of(src)))
            self._index[path] = len(self.readers)
            self.readers.append(reader)
        return self._index[path]

    def tuning(self) -> RingTuning:
        """The remote tuning (more reads in flight) when any file is a store object or a slow mount."""
        remote = any(r.backend == "range" or r.threads >= REMOTE_THREADS for r in self.readers)
        return REMOTE if remote else LOCAL
