"""The pinned ring (shardkit.loading.pipeline_copy): planning, slot recycling, ordering, errors, bounds.

A fake copy engine stands in for CUDA: its copies complete later, on its own thread, and a slot
refilled before its copy ran would corrupt the destination, so byte equality is the check.
"""

from __future__ import annotations

import mmap
import os
import queue
import random
import threading
import time

import pytest
import torch

from shardkit.errors import HeaderError
from shardkit.loading.pipeline_copy import (
    MAX_RING_BYTES,
    PAGE_BYTES,
    BufferRing,
    CopyJob,
    HostCopyStage,
    RingTuning,
    SlotCopy,
    byte_view,
    plan_pieces,
    plan_strided,
    run_pieces,
    run_ring,
)
from shardkit.reading import readers


def _blob(tmp_path, nbytes=300_000, name="blob.bin"):
    path = tmp_path / name
    data = os.urandom(nbytes)
    path.write_bytes(data)
    return str(path), data


def _jobs(dests, *, start=0, gap=3):
    jobs, offset = [], start
    for dest in dests:
        n = dest.numel() * dest.element_size()
        jobs.append(CopyJob(byte_view(dest), 0, offset, n, f"blob: tensor {offset}"))
        offset += n + gap  # odd gaps: reads start at odd offsets
    return jobs


def _dests():
    return [torch.empty(40_097, dtype=torch.uint8), torch.empty(0, dtype=torch.float32), torch.empty(3000, dtype=torch.float16),
            torch.empty((), dtype=torch.float64), torch.empty(1000, dtype=torch.float8_e4m3fn), torch.empty(11, dtype=torch.bool),
            torch.empty(30_000, dtype=torch.bfloat16)]


def _assert_copied(jobs, data):
    for job in jobs:
        assert job.dest.numpy().tobytes()[job.dest_offset:job.dest_offset + job.nbytes] == \
            data[job.offset:job.offset + job.nbytes], job.where


class FakeEngine:
    """A copy stage whose copies run later on an engine thread, in submission order, as a GPU's would;
    ``allocate`` gives page-aligned memory (so O_DIRECT reads land in place) and is counted."""

    def __init__(self, delay_s: float = 0.002) -> None:
        self.delay_s = delay_s
        self.allocated: list[int] = []
        self.submitted = self.completed = 0
        self.outstanding_max = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._maps: list[mmap.mmap] = []
        self._engine = threading.Thread(target=self._run, daemon=True)
        self._engine.start()

    def allocate(self, nbytes):
        self.allocated.append(nbytes)
        block = mmap.mmap(-1, nbytes)
        self._maps.append(block)
        return torch.frombuffer(block, dtype=torch.uint8)

    def submit(self, slot, copies):
        done = threading.Event()
        with self._lock:
            self.submitted += 1
            self.outstanding_max = max(self.outstanding_max, self.submitted - self.completed)
        self._queue.put((slot, list(copies), done))
        return done

    def _run(self):
        while (item := self._queue.get()) is not None:
            slot, copies, done = item
            time.sleep(self.delay_s)  # the copy is still reading the slot: refilling it now would corrupt it
            HostCopyStage().submit(slot, copies)
            with self._lock:
                self.completed += 1
            done.set()

    def wait(self, token):
        if token is not None:
            assert token.wait(10), "a copy never completed"

    def finish(self):
        pass

    def close(self):
        self._queue.put(None)
        self._engine.join(10)


@pytest.fixture
def engine():
    e = FakeEngine()
    yield e
    e.close()


def _ring_threads():
    return [t for t in threading.enumerate() if t.name.startswith("shardkit-ring")]


# ----------------------------------------------------------------------------- planning


def test_plan_pieces_covers_every_byte_once_with_page_aligned_reads_inside_slots() -> None:
    rng = random.Random(7)
    dest = torch.empty(1 << 20, dtype=torch.uint8)
    for _ in range(40):
        jobs, offset, at = [], rng.randrange(0, 9000), 0
        for _ in range(rng.randrange(1, 30)):
            n = rng.choice([0, 1, 3, 4096, rng.randrange(1, 40_000)])
            jobs.append(CopyJob(dest, at, offset, n, "t"))
            offset += n + rng.choice([0, 0, 1, 5000, 70_000])
            at += n
        slot = rng.choice([4096, 8192, 65536])
        pieces = plan_pieces(jobs, source=0, slot_bytes=slot, gap_bytes=rng.choice([0, 4096, 1 << 20]))
        covered = []
        for piece in pieces:
            (read,) = piece.reads
            assert read.offset % PAGE_BYTES == 0 and read.padded
            assert -(-(read.offset + read.nbytes) // PAGE_BYTES) * PAGE_BYTES - read.offset <= slot  # O_DIRECT end fits
            for c in piece.copies:
                assert 0 <= c.slot_offset and c.slot_offset + c.nbytes <= read.nbytes
                covered += range(c.dest_offset, c.dest_offset + c.nbytes)
        assert sorted(covered) == list(range(at))


def test_plan_pieces_merges_small_gaps_and_splits_at_large_ones() -> None:
    dest = torch.empty(300, dtype=torch.uint8)
    jobs = [CopyJob(dest, 0, 0, 100, "a"), CopyJob(dest, 100, 150, 100, "b"), CopyJob(dest, 200, 100_000, 100, "c")]
    merged = plan_pieces(jobs, source=0, slot_bytes=1 << 20, gap_bytes=4096)
    assert [(r.offset, r.nbytes) for p in merged for r in p.reads] == [(0, 250), (98_304, 1796)]
    exact = plan_pieces(jobs, source=0, slot_bytes=1 << 20, gap_bytes=0)
    assert len(exact) == 3


def test_plan_strided_packs_rows_and_reads_only_them() -> None:
    dest = torch.empty(12_000, dtype=torch.uint8)
    pieces = plan_strided(dest, [(10_000 * i + 7, 3000) for i in range(4)], source=0, slot_bytes=8192, where="w")
    assert sum(p.read_bytes for p in pieces) == 12_000
    assert all(not r.padded for p in pieces for r in p.reads)  # packed reads must not spill to whole pages
    assert [p.spans for p in pieces] == [[(7, 3000, 0), (10_007, 3000, 3000), (20_007, 2192, 6000)],
                                         [(22_199, 808, 0), (30_007, 3000, 808)]]
    assert [[(c.dest_offset, c.slot_offset, c.nbytes) for c in p.copies] for p in pieces] == \
        [[(0, 0, 8192)], [(8192, 0, 3808)]]


def test_ring_tuning_is_bounded() -> None:
    with pytest.raises(ValueError, match="over the"):
        RingTuning(slots=128, slot_bytes=16 << 20, threads=8)
    with pytest.raises(ValueError, match="one slot per reader"):
        RingTuning(slots=2, slot_bytes=1 << 20, threads=4)
    with pytest.raises(ValueError, match="multiple of"):
        RingTuning(slots=2, slot_bytes=1000, threads=1)
    assert RingTuning(slots=64, slot_bytes=16 << 20, threads=8).ring_bytes == MAX_RING_BYTES


# ----------------------------------------------------------------------------- running


@pytest.mark.parametrize("backend", ["pread", "direct"])
def test_ring_is_byte_exact_across_files_with_one_allocation_and_every_slot_back(tmp_path, backend, engine) -> None:
    (p1, d1), (p2, d2) = _blob(tmp_path, name="a.bin"), _blob(tmp_path, name="b.bin")
    jobs1, jobs2 = _jobs(_dests(), start=1), _jobs(_dests(), start=5000)
    tuning = RingTuning(slots=4, slot_bytes=8192, threads=3, gap_bytes=4096)  # many pieces per tensor, gaps merged
    ring = BufferRing.for_tuning(engine, tuning)
    with readers.open_reader(p1, backend) as r1, readers.open_reader(p2, backend) as r2:
        report = run_ring([(r1, jobs1), (r2, jobs2)], stage=engine, tuning=tuning, ring=ring)
    _assert_copied(jobs1, d1)
    _assert_copied(jobs2, d2)
    assert ring.in_use == 0 and 1 <= len(engine.allocated) <= 4 and set(engine.allocated) == {8192}  # slots as needed
    assert report.copied_bytes == sum(j.nbytes for j in jobs1 + jobs2)
    assert report.copied_bytes <= report.read_bytes < report.copied_bytes + 2 * 4096 * 7 * 2  # gaps only
    assert engine.outstanding_max <= 4  # never more copies in flight than slots
    assert not _ring_threads()


def test_ring_moves_much_more_than_its_memory(tmp_path, engine) -> None:
    path, data = _blob(tmp_path, nbytes=3 << 20)
    dest = torch.empty(3 << 20, dtype=torch.uint8)
    jobs = [CopyJob(dest, 0, 0, 3 << 20, "big")]
    tuning = RingTuning(slots=2, slot_bytes=64 << 10, threads=2)
    with readers.Reader(path) as reader:
        report = run_ring([(reader, jobs)], stage=engine, tuning=tuning)
    assert dest.numpy().tobytes() == data
    assert engine.allocated == [64 << 10] * 2 and report.pieces == 48 and report.ring_bytes == 128 << 10


def test_a_ring_pinned_up_front_is_one_allocation(tmp_path, engine) -> None:
    path, data = _blob(tmp_path, nbytes=1 << 20)
    dest = torch.empty(1 << 20, dtype=torch.uint8)
    tuning = RingTuning(slots=4, slot_bytes=64 << 10, threads=2, grow=False)
    with readers.Reader(path) as reader:
        run_ring([(reader, [CopyJob(dest, 0, 0, 1 << 20, "big")])], stage=engine, tuning=tuning)
    assert dest.numpy().tobytes() == data and engine.allocated == [256 << 10]


def test_a_growing_ring_never_holds_more_slots_than_it_may(tmp_path) -> None:
    class Slow(FakeEngine):  # slow copies: readers find no free slot and grow the ring, up to its bound
        def allocate(self, nbytes):
            time.sleep(0.01)
            return super().allocate(nbytes)

    path, data = _blob(tmp_path, nbytes=2 << 20)
    dest = torch.empty(2 << 20, dtype=torch.uint8)
    stage = Slow(delay_s=0.005)
    ring = BufferRing.for_tuning(stage, RingTuning(slots=5, slot_bytes=32 << 10, threads=5))
    try:
        with readers.Reader(path) as reader:
            run_ring([(reader, [CopyJob(dest, 0, 0, 2 << 20, "big")])], stage=stage,
                     tuning=RingTuning(slots=5, slot_bytes=32 << 10, threads=5), ring=ring)
    finally:
        stage.close()
    assert dest.numpy().tobytes() == data
    assert len(stage.allocated) == ring.allocated <= 5 and ring.in_use == 0
    assert stage.outstanding_max <= 5


def test_a_slot_that_cannot_be_pinned_fails_the_run_with_every_slot_back(tmp_path) -> None:
    class Exhausted(HostCopyStage):
        def allocate(self, nbytes):
            raise MemoryError("pinned memory exhausted (injected)")

    path, _ = _blob(tmp_path, nbytes=1 << 20)
    stage = Exhausted()
    ring = BufferRing(stage, count=4, nbytes=8192, grow=True)
    with readers.Reader(path) as reader, pytest.raises(MemoryError, match="injected"):
        run_ring([(reader, [CopyJob(torch.empty(1 << 20, dtype=torch.uint8), 0, 0, 1 << 20, "blob")])], stage=stage,
                 tuning=RingTuning(slots=4, slot_bytes=8192, threads=4), ring=ring)
    assert ring.in_use == 0 and ring.allocated == 0 and not _ring_threads()


class _Recorder(readers.Reader):
    def __init__(self, path, fail_at=None):
        super().__init__(path)
        self.offsets: list[int] = []
        self.fail_at = fail_at
        self._lock = threading.Lock()

    def read_one(self, job):
        with self._lock:
            self.offsets.append(job.offset)
            if self.fail_at is not None and len(self.offsets) == self.fail_at:
                raise OSError(5, "Input/output error (injected)")
        super().read_one(job)


def test_one_thread_reads_in_file_order_and_many_read_each_piece_once(tmp_path, engine) -> None:
    path, data = _blob(tmp_path)
    dests = _dests()
    jobs = list(reversed(_jobs(dests)))  # given out of order: read in file order all the same
    for threads, slots in ((1, 1), (4, 8)):
        with _Recorder(path) as reader:
            run_ring([(reader, jobs)], stage=engine, tuning=RingTuning(slots=slots, slot_bytes=8192, threads=threads))
        _assert_copied(jobs, data)
        if threads == 1:
            assert reader.offsets == sorted(reader.offsets)
        assert len(reader.offsets) == len(set(reader.offsets))


def test_a_failed_read_stops_the_ring_waits_for_copies_and_returns_every_slot(tmp_path, engine) -> None:
    path, _ = _blob(tmp_path, nbytes=2 << 20)
    dest = torch.empty(2 << 20, dtype=torch.uint8)
    tuning = RingTuning(slots=4, slot_bytes=16 << 10, threads=3)
    ring = BufferRing.for_tuning(engine, tuning)
    with _Recorder(path, fail_at=10) as reader, pytest.raises(OSError, match="injected"):
        run_ring([(reader, [CopyJob(dest, 0, 0, 2 << 20, "blob")])], stage=engine, tuning=tuning, ring=ring)
    assert ring.in_use == 0
    assert engine.completed == engine.submitted  # nothing still reading a slot after the error
    assert len(reader.offsets) < 20  # the others stopped taking pieces
    assert not _ring_threads()


def test_a_failed_copy_is_raised_after_every_slot_is_back(tmp_path) -> None:
    class Failing(HostCopyStage):
        calls = 0

        def submit(self, slot, copies):
            Failing.calls += 1
            if Failing.calls == 3:
                raise RuntimeError("copy failed")
            return super().submit(slot, copies)

    path, _ = _blob(tmp_path)
    stage = Failing()
    ring = BufferRing(stage, count=2, nbytes=8192)
    with readers.Reader(path) as reader, pytest.raises(RuntimeError, match="copy failed"):
        run_ring([(reader, [CopyJob(torch.empty(100_000, dtype=torch.uint8), 0, 0, 100_000, "blob")])], stage=stage,
                 tuning=RingTuning(slots=2, slot_bytes=8192, threads=2), ring=ring)
    assert ring.in_use == 0 and not _ring_threads()


def test_a_truncated_file_names_the_tensor_and_file(tmp_path) -> None:
    path, data = _blob(tmp_path, nbytes=50_000)
    job = CopyJob(torch.empty(20_000, dtype=torch.uint8), 0, len(data) - 5_000, 20_000, f"{path}: tensor 'w'")
    with readers.Reader(path) as reader, pytest.raises(HeaderError, match="file ended") as err:
        run_ring([(reader, [job])], stage=HostCopyStage(), tuning=RingTuning(slots=2, slot_bytes=8192, threads=2))
    assert path in str(err.value) and "'w'" in str(err.value)


def test_pieces_planned_for_bigger_slots_are_refused(tmp_path) -> None:
    path, _ = _blob(tmp_path)
    dest = torch.empty(10_000, dtype=torch.uint8)
    pieces = plan_pieces([CopyJob(dest, 0, 0, 10_000, "w")], source=0, slot_bytes=16384, gap_bytes=0)
    ring = BufferRing(HostCopyStage(), count=1, nbytes=8192)
    with readers.Reader(path) as reader, pytest.raises(ValueError, match="larger than this ring"):
        run_pieces([reader], pieces, stage=HostCopyStage(), tuning=RingTuning(slots=1, slot_bytes=8192, threads=1), ring=ring)


def test_strided_pieces_through_the_ring_with_direct_reads_stay_exact(tmp_path, engine) -> None:
    path, data = _blob(tmp_path)
    dest = torch.empty(64 * 100, dtype=torch.uint8)
    rows = [(4000 * i + 13, 100) for i in range(64)]
    with readers.open_reader(path, "direct") as reader:
        run_pieces([reader], plan_strided(byte_view(dest), rows, source=0, slot_bytes=4096, where="w"), stage=engine,
                   tuning=RingTuning(slots=3, slot_bytes=4096, threads=3))
    assert dest.numpy().tobytes() == b"".join(data[4000 * i + 13:4000 * i + 113] for i in range(64))


def test_host_copy_stage_copies_each_slot_copy() -> None:
    slot = torch.arange(16, dtype=torch.uint8)
    dest = torch.zeros(8, dtype=torch.uint8)
    HostCopyStage().submit(slot, [SlotCopy(dest, 2, 10, 4)])
    assert dest.tolist() == [0, 0, 10, 11, 12, 13, 0, 0]


# ----------------------------------------------------------------------------- real CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("read", ["mmap", "pread", "direct"])
def test_to_cuda_through_the_pinned_ring_equals_safetensors(tmp_path, read) -> None:
    import safetensors.torch
    from conftest import make_state_dict, tensor_bytes

    import shardkit

    tensors = {"big": torch.randn(3 << 20), **make_state_dict(shapes=[(), (0,), (7,), (5, 3)])}
    path = tmp_path / "w.safetensors"
    safetensors.torch.save_file(tensors, path)
    want = safetensors.torch.load_file(path, device="cuda:0")
    with shardkit.open(path, read=read) as ckpt:
        got = ckpt.to("cuda:0")
        cast = ckpt.to("cuda:0", dtype=torch.bfloat16, names=["big"])
    assert sorted(got) == sorted(want)
    for name, tensor in got.items():
        assert tensor.device.type == "cuda" and tensor.dtype == want[name].dtype
        assert tensor_bytes(tensor) == tensor_bytes(want[name]), name
    assert torch.equal(cast["big"], want["big"].to(torch.bfloat16))


@pytest.mark.gpu
def test_cuda_stage_slots_are_pinned_and_a_slice_lands_on_the_gpu(tmp_path) -> None:
    import safetensors.torch

    import shardkit
    from shardkit.loading.pipeline_copy import CudaCopyStage

    ring = BufferRing(CudaCopyStage(torch.device("cuda:0")), count=2, nbytes=1 << 20, grow=True)
    slots = [ring.acquire(threading.Event()) for _ in range(2)]
    assert all(s is not None and s.memory.is_pinned() and s.memory.numel() == 1 << 20 for s in slots)
    assert ring.allocated == 2
    w = torch.randn(64, 256, dtype=torch.bfloat16)
    path = tmp_path / "w.safetensors"
    safetensors.torch.save_file({"w": w}, path)
    with shardkit.open(path) as ckpt:
        part = ckpt.slice("w", 1, 3, 4, device="cuda:0")
    assert part.device.type == "cuda" and torch.equal(part.cpu(), w.chunk(4, dim=1)[3])


def test_a_ring_made_directly_grows_as_one_made_from_a_tuning_does() -> None:
    """One default: a BufferRing built without grow= pins its slots on first need, as RingTuning's default says."""
    class Counting(HostCopyStage):
        allocations = 0

        def allocate(self, nbytes):
            Counting.allocations += 1
            return super().allocate(nbytes)

    tuning = RingTuning(slots=4, slot_bytes=8192, threads=1)
    direct = BufferRing(Counting(), count=4, nbytes=8192)
    from_tuning = BufferRing.for_tuning(Counting(), tuning)
    assert tuning.grow and direct.allocated == from_tuning.allocated == 0 and Counting.allocations == 0
    stop = threading.Event()
    slot = direct.acquire(stop)
    assert slot is not None and direct.allocated == 1 and Counting.allocations == 1  # one slot, pinned when needed
    direct.release(slot)
