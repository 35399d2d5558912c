"""Reads onto a device through a ring of pinned host slots filled in parallel, copied on side streams.

The bytes a device needs are cut into *pieces* in file order (:func:`plan_pieces`): each piece is at
most one slot of file bytes, read with one ``pread`` (or ``O_DIRECT`` straight into the page-aligned
slot) or, for strided slices, a few, and holds the copies out of that slot into the destination
tensors. Several reader threads take the next piece in file order, take a free slot (waiting for the
copy that last used it), fill it and queue its copies with ``non_blocking=True`` on their own CUDA
stream, recording one event per use. Host memory is the ring alone (``slots × slot_bytes``, at most
:data:`MAX_RING_BYTES`), whatever the model's size; its slots are pinned as the readers first need
them, so pinning overlaps the first reads instead of preceding them (``RingTuning.grow``); destinations
are allocated once by the caller. On any error the other threads stop taking pieces, every copy in flight is waited for and
every slot is back in the ring before the first error propagates.

The copy stage is pluggable: :class:`CudaCopyStage` on a GPU, :class:`HostCopyStage` (synchronous
copies into CPU tensors) so the same ring runs in CPU tests and ``pipe_host`` reads.

stage = CudaCopyStage(torch.device("cuda:0"))
run_ring([(reader, copies)], stage=stage)
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeAlias

from ..devices import DeviceKey
from ..reading.readers import Reader, ReadJob, memory_at
from .ring_plan import PAGE_BYTES, CopyJob, Piece, SlotCopy, SlotRead, byte_view, plan_pieces, plan_strided

__all__ = ["LOCAL", "MAX_RING_BYTES", "PAGE_BYTES", "REMOTE", "BufferRing", "CopyJob", "CopyStage", "CudaCopyStage",
           "HostCopyStage", "Piece", "RingReport", "RingTuning", "SlotCopy", "SlotRead", "byte_view", "default_stage",
           "plan_pieces", "plan_strided", "run_pieces", "run_ring"]

if TYPE_CHECKING:
    import torch

CopyToken: TypeAlias = "torch.cuda.Event | None"  # what a stage's wait() waits on (None: copied already)

MAX_RING_BYTES = 1 << 30   # pinned host memory per device, whatever the tuning asks for
WAIT_TIMEOUT_S = 0.5       # how often a thread waiting for a free slot checks whether another failed
JOIN_TIMEOUT_S = 30.0      # after an interrupt: how long to wait for each reader thread's read in flight
GROW_SLOTS = True          # the default of RingTuning.grow and BufferRing(grow=...): pin each slot on first need


@dataclass(frozen=True)
class RingTuning:
    """How the ring is cut: ``slots × slot_bytes`` of host memory, ``threads`` readers filling it, reads
    of one file closer than ``gap_bytes`` merged into one (the gap read and dropped).

    Measured on an H200 host (docs/benchmarks.md): see ``LOCAL`` for the default.
    """

    slots: int
    slot_bytes: int
    threads: int
    gap_bytes: int = 1 << 20
    grow: bool = GROW_SLOTS   # pin each slot when a reader first needs one (False: one block before the first read)

    def __post_init__(self) -> None:
        if self.slots < self.threads or self.threads < 1:
            raise ValueError(f"a ring needs at least one slot per reader thread (slots={self.slots}, "
                             f"threads={self.threads})")
        if self.slot_bytes % PAGE_BYTES or self.slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be a positive multiple of {PAGE_BYTES}, got {self.slot_bytes}")
        if self.ring_bytes > MAX_RING_BYTES:
            raise ValueError(f"a ring of {self.ring_bytes:,} bytes is over the {MAX_RING_BYTES:,}-byte bound "
                             "on pinned memory per device: use fewer or smaller slots")

    @property
    def ring_bytes(self) -> int:
        """Host memory the ring holds (a power of two keeps torch's pinned-memory cache from rounding it up)."""
        return self.slots * self.slot_bytes


LOCAL = RingTuning(slots=16, slot_bytes=16 << 20, threads=8)
REMOTE = RingTuning(slots=32, slot_bytes=16 << 20, threads=16)   # ranged GETs: many in flight


class CopyStage(Protocol):
    """Moves a filled slot into its destinations; ``wait(token)`` returns once the slot is free again."""

    def allocate(self, nbytes: int) -> torch.Tensor: ...

    def submit(self, slot: torch.Tensor, copies: list[SlotCopy]) -> CopyToken: ...

    def wait(self, token: CopyToken) -> None: ...

    def finish(self) -> None: ...


class HostCopyStage:
    """Synchronous copies into CPU tensors: the ring's CPU stand-in for tests and ``pipe_host`` reads."""

    def allocate(self, nbytes: int) -> torch.Tensor:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8)

    def submit(self, slot: torch.Tensor, copies: list[SlotCopy]) -> CopyToken:
        for c in copies:
            c.dest[c.dest_offset:c.dest_offset + c.nbytes].copy_(slot[c.slot_offset:c.slot_offset + c.nbytes])
        return None

    def wait(self, token: CopyToken) -> None:
        return None

    def finish(self) -> None:
        return None


class CudaCopyStage:
    """One pinned block cut into slots; each reader thread queues its copies on its own CUDA stream
    (``non_blocking``) and records one event per slot use."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._local = threading.local()
        self._streams: list[torch.cuda.Stream] = []
        self._lock = threading.Lock()

    def allocate(self, nbytes: int) -> torch.Tensor:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def _stream(self) -> torch.cuda.Stream:
        import torch

        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
            with self._lock:
                self._streams.append(stream)
        return stream

    def submit(self, slot: torch.Tensor, copies: list[SlotCopy]) -> CopyToken:
        import torch

        stream = self._stream()
        with torch.cuda.stream(stream):
            for c in copies:
                c.dest[c.dest_offset:c.dest_offset + c.nbytes].copy_(slot[c.slot_offset:c.slot_offset + c.nbytes],
                                                                     non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        return event

    def wait(self, token: CopyToken) -> None:
        if token is not None:
            token.synchronize()

    def finish(self) -> None:
        import torch

        current = torch.cuda.current_stream(self.device)
        with self._lock:
            for stream in self._streams:
                stream.synchronize()
                current.wait_stream(stream)  # later work on the default stream sees the copies


def default_stage(device: DeviceKey) -> CopyStage:
    """A CUDA stage (pinned ring, side streams) for GPUs, a host stage for the CPU."""
    import torch

    target = torch.device(device)
    return HostCopyStage() if target.type == "cpu" else CudaCopyStage(target)


class Slot:
    """One slot of the ring: its memory and the token of the last copy out of it."""

    def __init__(self, memory: torch.Tensor) -> None:
        self.memory = memory
        self.token: CopyToken = None


class BufferRing:
    """``count`` slots of ``nbytes`` of ``stage``'s memory; ``in_use`` counts the slots handed out (0
    after every run).

    With ``grow`` (the default) a slot is allocated when a reader finds none free and fewer than
    ``count`` exist: pinning a 256 MiB ring takes ~0.12 s in a fresh process, which then overlaps the
    first reads and copies instead of preceding them (torch's pinned-memory cache keeps each slot for
    the next load). Without it, one block is allocated up front and cut into slots.
    """

    def __init__(self, stage: CopyStage, *, count: int, nbytes: int, grow: bool = GROW_SLOTS) -> None:
        self.nbytes = nbytes
        self.count = count
        self._stage = stage
        self._free: queue.Queue[Slot] = queue.Queue()
        self._lock = threading.Lock()
        self.in_use = 0
        self.allocated = 0
        if not grow:
            block = stage.allocate(count * nbytes)
            for i in range(count):
                self._free.put(Slot(block[i * nbytes:(i + 1) * nbytes]))
            self.allocated = count

    @classmethod
    def for_tuning(cls, stage: CopyStage, tuning: RingTuning) -> BufferRing:
        return cls(stage, count=tuning.slots, nbytes=tuning.slot_bytes, grow=tuning.grow)

    def acquire(self, stop: threading.Event) -> Slot | None:
        """A free slot (a new one while fewer than ``count`` exist), or None once ``stop`` is set."""
        while not stop.is_set():
            slot: Slot | None
            try:
                slot = self._free.get_nowait() if self._may_grow() else self._free.get(timeout=WAIT_TIMEOUT_S)
            except queue.Empty:
                slot = self._grow()
            if slot is None:
                continue
            with self._lock:
                self.in_use += 1
            return slot
        return None

    def _may_grow(self) -> bool:
        with self._lock:
            return self.allocated < self.count

    def _grow(self) -> Slot | None:
        """A newly allocated slot, or None when the ring is full (another reader took the last one)."""
        with self._lock:
            if self.allocated >= self.count:
                return None
            self.allocated += 1
        try:
            return Slot(self._stage.allocate(self.nbytes))
        except BaseException:
            with self._lock:
                self.allocated -= 1
            raise

    def release(self, slot: Slot) -> None:
        with self._lock:
            self.in_use -= 1
        self._free.put(slot)

    def drain(self, stage: CopyStage) -> None:
        """Wait for every copy still reading from a slot (every slot must be back in the ring)."""
        slots = [self._free.get_nowait() for _ in range(self._free.qsize())]
        try:
            for slot in slots:
                stage.wait(slot.token)
                slot.token = None
        finally:
            for slot in slots:
                self._free.put(slot)


@dataclass
class RingReport:
    """What one run did: bytes read from the files (merged gaps included), bytes copied out, pieces."""

    read_bytes: int = 0
    copied_bytes: int = 0
    pieces: int = 0
    ring_bytes: int = 0


def run_ring(sources: Sequence[tuple[Reader, Sequence[CopyJob]]], *, stage: CopyStage, tuning: RingTuning = LOCAL,
             ring: BufferRing | None = None) -> RingReport:
    """Read every job through the ring and copy it into place: files in order, each in file order.

    Args:
        sources: each file's open reader (``pread``, ``direct`` or ranged) and what to copy out of it.
        stage: the copy stage (CUDA or host).
        tuning: slots, slot size, reader threads and the gap merged into one read.
        ring: the slots; None cuts ``tuning``'s from one ``stage.allocate``.

    Raises:
        HeaderError: a file ended early; OSError: a read failed; whatever a copy raised. Every
        copy in flight is waited for and every slot is back in the ring first.

    run_ring([(reader, [CopyJob(byte_view(t), 0, offset, t.nbytes, "f: tensor 'w'")])], stage=HostCopyStage())
    """
    pieces = [p for i, (_, jobs) in enumerate(sources)
              for p in plan_pieces(jobs, source=i, slot_bytes=tuning.slot_bytes, gap_bytes=tuning.gap_bytes)]
    return run_pieces([reader for reader, _ in sources], pieces, stage=stage, tuning=tuning, ring=ring)


def run_pieces(readers: Sequence[Reader], pieces: Sequence[Piece], *, stage: CopyStage, tuning: RingTuning = LOCAL,
               ring: BufferRing | None = None) -> RingReport:
    """Run planned pieces (:func:`plan_pieces`, :func:`plan_strided`) through the ring; see :func:`run_ring`."""
    report = RingReport(pieces=len(pieces))
    if not pieces:
        return report
    ring = ring or BufferRing.for_tuning(stage, tuning)
    if any(_slot_end(p) > ring.nbytes for p in pieces):
        raise ValueError(f"pieces planned for slots larger than this ring's {ring.nbytes:,} bytes")
    report.ring_bytes = ring.count * ring.nbytes
    run = _Run(readers, pieces, stage, ring)
    workers = [threading.Thread(target=run.work, name=f"shardkit-ring-{i}", daemon=True)
               for i in range(min(tuning.threads, ring.count, len(pieces)))]
    try:
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        run.stop.set()  # an interrupt while joining: the others stop taking pieces
        for worker in workers:
            if worker.ident is not None:
                worker.join(JOIN_TIMEOUT_S)
        ring.drain(stage)
        stage.finish()
    if run.errors:
        raise run.errors[0]
    report.read_bytes = sum(p.read_bytes for p in pieces)
    report.copied_bytes = sum(c.nbytes for p in pieces for c in p.copies)
    return report


def _slot_end(piece: Piece) -> int:
    if piece.spans is not None:
        return max(at + n for _, n, at in piece.spans)
    return max(r.slot_offset + r.nbytes for r in piece.reads)


class _Run:
    """The shared state of one run: the next piece to take, the first errors, the stop flag."""

    def __init__(self, readers: Sequence[Reader], pieces: Sequence[Piece], stage: CopyStage, ring: BufferRing) -> None:
        self.readers, self.pieces, self.stage, self.ring = readers, pieces, stage, ring
        self.next = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.errors: list[BaseException] = []

    def take(self) -> Piece | None:
        with self.lock:
            if self.stop.is_set() or self.next >= len(self.pieces):
                return None
            self.next += 1
            return self.pieces[self.next - 1]

    def work(self) -> None:
        while (piece := self.take()) is not None:
            try:
                slot = self.ring.acquire(self.stop)  # may pin a new slot: that can fail too
            except BaseException as e:
                self.fail(e)
                return
            if slot is None:
                return
            try:
                self.stage.wait(slot.token)
                slot.token = None
                self.fill(slot, piece)
                slot.token = self.stage.submit(slot.memory, piece.copies)
            except BaseException as e:
                self.fail(e)
            finally:
                self.ring.release(slot)

    def fail(self, error: BaseException) -> None:
        """Keep ``error`` for the caller's thread (raised there after every slot is back) and stop the others."""
        with self.lock:
            self.errors.append(error)
        self.stop.set()

    def fill(self, slot: Slot, piece: Piece) -> None:
        reader = self.readers[piece.source]
        if piece.spans is not None:  # many small reads (a strided slice): one pread each, no objects
            reader.read_spans(memory_at(slot.memory.data_ptr(), slot.memory.numel()), piece.spans,
                              where=piece.reads[0].where)
            return
        base = slot.memory.data_ptr()
        for r in piece.reads:
            reader.read_one(ReadJob(base + r.slot_offset, r.offset, r.nbytes, r.where, r.padded))
