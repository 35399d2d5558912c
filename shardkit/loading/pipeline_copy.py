"""Read → copy pipeline through a small ring of (pinned) host buffers, for loads onto a device.

Reads fill ring buffers on reader threads while earlier buffers are copied to the device; the
copy stage is pluggable: :class:`CudaCopyStage` issues ``non_blocking`` host→device copies on its
own CUDA stream and records an event per buffer (the buffer is reused once its event has
completed), :class:`HostCopyStage` copies into CPU tensors synchronously so the same pipeline
runs in CPU tests. Destination tensors are allocated once by the caller; host memory is the ring
alone (e.g. 4 × 64 MiB pinned), whatever the model's size. On any error every in-flight read and
copy is waited for and every buffer goes back to the ring before the error propagates.

stage = CudaCopyStage(torch.device("cuda:0"))
run_pipeline(reader, copies, stage=stage)
"""

from __future__ import annotations

import collections
import queue
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeAlias

from ..reading.readers import Reader, ReadJob

if TYPE_CHECKING:
    import torch

CopyToken: TypeAlias = "torch.cuda.Event | None"  # what a stage's wait() waits on (None: copied already)

RING_BUFFERS = 4
RING_BUFFER_BYTES = 64 << 20


@dataclass(frozen=True)
class CopyJob:
    """``nbytes`` of the file at ``offset`` into ``dest`` (any device) starting at its byte ``dest_offset``."""

    dest: torch.Tensor   # flat uint8 view of the destination tensor
    dest_offset: int
    offset: int
    nbytes: int
    where: str


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous tensor of any dtype (fp8, bool, scalars included)."""
    import torch

    return tensor.reshape(-1).view(torch.uint8)


def split_copies(jobs: list[CopyJob], chunk_bytes: int) -> list[CopyJob]:
    """Jobs cut to fit one ring buffer each."""
    out = []
    for job in jobs:
        for start in range(0, job.nbytes, chunk_bytes):
            out.append(CopyJob(job.dest, job.dest_offset + start, job.offset + start,
                               min(chunk_bytes, job.nbytes - start), job.where))
    return out


class CopyStage(Protocol):
    """Moves a filled host buffer into its destination; ``wait(token)`` returns once the buffer is free."""

    def allocate(self, nbytes: int) -> torch.Tensor: ...

    def submit(self, buffer: torch.Tensor, job: CopyJob) -> CopyToken: ...

    def wait(self, token: CopyToken) -> None: ...

    def finish(self) -> None: ...


class HostCopyStage:
    """Synchronous copies into CPU tensors: the pipeline's CPU stand-in for tests and CPU loads."""

    def allocate(self, nbytes: int) -> torch.Tensor:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8)

    def submit(self, buffer: torch.Tensor, job: CopyJob) -> CopyToken:
        job.dest[job.dest_offset:job.dest_offset + job.nbytes].copy_(buffer[:job.nbytes])
        return None

    def wait(self, token: CopyToken) -> None:
        return None

    def finish(self) -> None:
        return None


class CudaCopyStage:
    """Pinned ring buffers; ``non_blocking`` copies on a side stream; one event per buffer use."""

    def __init__(self, device: torch.device) -> None:
        import torch

        self.device = device
        self.stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    def allocate(self, nbytes: int) -> torch.Tensor:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def submit(self, buffer: torch.Tensor, job: CopyJob) -> CopyToken:
        import torch

        with torch.cuda.stream(self.stream):
            job.dest[job.dest_offset:job.dest_offset + job.nbytes].copy_(buffer[:job.nbytes], non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.stream)
        return event

    def wait(self, token: CopyToken) -> None:
        if token is not None:
            token.synchronize()

    def finish(self) -> None:
        import torch

        self.stream.synchronize()
        # Later work on the default stream must see the copies.
        torch.cuda.current_stream(self.device).wait_stream(self.stream)


class BufferRing:
    """A fixed set of host buffers; ``in_use`` counts those handed out (0 after every run)."""

    def __init__(self, stage: CopyStage, *, count: int, nbytes: int) -> None:
        self.nbytes = nbytes
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        for _ in range(count):
            self._free.put(stage.allocate(nbytes))
        self.count = count
        self.in_use = 0

    def acquire(self) -> torch.Tensor:
        self.in_use += 1
        return self._free.get_nowait()

    def release(self, buffer: torch.Tensor) -> None:
        self.in_use -= 1
        self._free.put(buffer)


def _read_into(reader: Reader, buffer: torch.Tensor, job: CopyJob) -> None:
    reader.read_one(ReadJob(buffer.data_ptr(), job.offset, job.nbytes, job.where))


def run_pipeline(reader: Reader, jobs: list[CopyJob], *, stage: CopyStage, ring: BufferRing | None = None,
                 threads: int = 2) -> BufferRing:
    """Read every job through the ring and copy it into place, reads overlapping copies.

    Args:
        reader: the open file (``pread`` or ``direct``).
        jobs: what goes where; destinations are allocated by the caller.
        stage: the copy stage (CUDA or host).
        ring: the buffers; None makes ``RING_BUFFERS × RING_BUFFER_BYTES`` with ``stage.allocate``.
        threads: reader threads filling buffers ahead of the copies.

    Returns:
        The ring (every buffer back in it).

    Raises:
        HeaderError: the file ended early; OSError: a read failed. Buffers are all released first.

    run_pipeline(reader, [CopyJob(byte_view(t), 0, offset, t.nbytes, "f: tensor 'w'")],
                 stage=HostCopyStage())
    """
    ring = ring or BufferRing(stage, count=RING_BUFFERS, nbytes=RING_BUFFER_BYTES)
    chunks = collections.deque(split_copies(jobs, ring.nbytes))
    reading: collections.deque[tuple[Future[None], torch.Tensor, CopyJob]] = collections.deque()
    copying: collections.deque[tuple[CopyToken, torch.Tensor]] = collections.deque()
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="shardkit-ring") as pool:
        try:
            while chunks or reading:
                while chunks and ring.in_use < ring.count:
                    buffer, job = ring.acquire(), chunks.popleft()
                    reading.append((pool.submit(_read_into, reader, buffer, job), buffer, job))
                if not reading:  # every buffer is being copied: wait for the oldest
                    _retire(stage, ring, copying)
                    continue
                future, buffer, job = reading.popleft()
                try:
                    future.result()
                    token = stage.submit(buffer, job)
                except BaseException:
                    ring.release(buffer)
                    raise
                copying.append((token, buffer))
                if chunks and ring.in_use >= ring.count:
                    _retire(stage, ring, copying)
        finally:
            _drain(stage, ring, reading, copying)
    return ring


def _retire(stage: CopyStage, ring: BufferRing, copying: collections.deque[tuple[CopyToken, torch.Tensor]]) -> None:
    token, buffer = copying.popleft()
    stage.wait(token)
    ring.release(buffer)


def _drain(stage: CopyStage, ring: BufferRing, reading: collections.deque[tuple[Future[None], torch.Tensor, CopyJob]],
           copying: collections.deque[tuple[CopyToken, torch.Tensor]]) -> None:
    """Wait for every read and copy still in flight, then hand their buffers back."""
    while reading:
        future, buffer, _ = reading.popleft()
        future.cancel() or future.exception()
        ring.release(buffer)
    while copying:
        _retire(stage, ring, copying)
    stage.finish()
