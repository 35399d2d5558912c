"""Sources read through the shared readers: parallel range reads, read-ahead in file order, RangeFile readers."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from shardkit.errors import HeaderError, ShardkitError
from shardkit.formats.ranges import RangeFile
from shardkit.reading import readers
from shardkit.reading.readers import RangeReader, ReadJob, memory_at, open_reader
from shardkit.reading.sequential import RangeReads
from shardkit.sources import open_source
from shardkit.workers import ReadPool


class BytesFile:
    """A RangeFile over bytes in memory that records every range asked for and the threads asking."""

    def __init__(self, data: bytes, name: str = "mem://blob") -> None:
        self.data, self._name = data, name
        self.calls: list[tuple[int, int]] = []
        self.threads: set[str] = set()
        self.closed = 0
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self._name

    @property
    def size_bytes(self) -> int:
        return len(self.data)

    def read_into(self, offset: int, out: memoryview) -> None:
        if offset + len(out) > len(self.data):
            raise ShardkitError(f"{self.name}: bytes {offset}-{offset + len(out)} past the end")
        with self._lock:
            self.calls.append((offset, len(out)))
            self.threads.add(threading.current_thread().name)
        out[:] = self.data[offset:offset + len(out)]

    def close(self) -> None:
        self.closed += 1


def test_a_range_file_is_a_range_file_and_gets_a_range_reader_filling_jobs_in_parallel() -> None:
    data = os.urandom(1 << 20)
    blob = BytesFile(data)
    assert isinstance(blob, RangeFile)
    reader = open_reader(blob, "direct", threads=4)
    assert isinstance(reader, RangeReader) and reader.backend == "range" and reader.path == "mem://blob"
    reader.chunk_bytes = 64 << 10
    out = bytearray(len(data) - 100)
    anchor = (memoryview(out))
    import ctypes

    address = ctypes.addressof(ctypes.c_char.from_buffer(out))
    reader.read_all([ReadJob(address, 100, len(out), "mem://blob: tensor 'w'")])
    del anchor
    assert bytes(out) == data[100:]
    assert len(blob.calls) == 16 and len(blob.threads) > 1, "chunks of one job run on several threads"
    reader.close()
    assert blob.closed == 1


def test_memory_at_views_memory_writably() -> None:
    import ctypes

    buf = bytearray(8)
    view = memory_at(ctypes.addressof(ctypes.c_char.from_buffer(buf)), 8)
    view[:3] = b"abc"
    assert bytes(buf[:3]) == b"abc" and len(memory_at(0, 0)) == 0


def test_range_reads_read_ahead_in_file_order_and_read_each_byte_once() -> None:
    data = os.urandom(3 << 20)
    blob = BytesFile(data)
    pool = ReadPool(4)
    reads = RangeReads(RangeReader(blob, chunk_bytes=256 << 10), pool, size_bytes=len(data), ahead_bytes=1 << 20)
    try:
        first = reads.read(0, 100_000, where="w")  # first request: exactly its bytes
        assert bytes(first) == data[:100_000] and blob.calls == [(0, 100_000)]
        got = [bytes(reads.read(at, 100_000, where="w")) for at in range(100_000, 3_000_000, 100_000)]
        assert b"".join(got) == data[100_000:3_000_000]
        pieces = sorted(c for c in blob.calls[1:])
        assert all(n <= 256 << 10 for _, n in pieces)
        assert pieces[0][0] == 100_000, "the window starts where the sequential reads began: nothing before is refetched"
        assert all(a + n == b for (a, n), (b, _) in zip(pieces, pieces[1:], strict=False)), "no byte is read twice, none skipped"
        assert max(off + n for off, n in pieces) <= len(data)
        # the read-ahead window was ahead of the reader: pieces past what was asked for are in flight or done
        assert max(off for off, _ in pieces) >= 3_000_000 - (256 << 10)
        # a jump back is a plain exact read; a range past the end is refused with the file's size
        assert bytes(reads.read(5, 10, where="w")) == data[5:15]
        with pytest.raises(HeaderError, match="past the end"):
            reads.read(len(data) - 5, 10, where="w")
    finally:
        reads.close()
        assert pool.close()
    assert blob.closed == 1


def _checkpoint(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    tensors = {f"layer{i}.weight": torch.randn(300, 257) for i in range(6)}
    tensors["tiny"] = torch.arange(3, dtype=torch.int8)
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    return path, tensors


def test_a_safetensors_source_reads_through_the_parallel_readers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """open_source's reads of a file that read="auto" would not map (cold, or on a network mount) go
    through shardkit.reading (the readers of shardkit.open): reads run on the reader pool, sequential
    reads come from the read-ahead, bytes are exact. (Which pool thread takes each of its few reads is
    timing: the read-ahead here is three reads one after another, so no count of threads is asserted.)"""
    from shardkit.reading.residency import BackendChoice
    from shardkit.sources import safetensors as st

    path, tensors = _checkpoint(tmp_path)
    monkeypatch.setattr(st, "choose_backend", lambda p, read, fd=None: BackendChoice("pread", "cold (test)"))
    monkeypatch.setattr(readers, "CHUNK_BYTES", 64 << 10)
    seen: list[str] = []
    real = readers.Reader.read_one

    def spy(self: readers.Reader, job: ReadJob) -> None:
        seen.append(threading.current_thread().name)
        real(self, job)

    monkeypatch.setattr(readers.Reader, "read_one", spy)
    with open_source(path) as src:
        by_name = {e.name: e for e in src.entries()}
        for name, tensor in tensors.items():
            entry = by_name[name]
            assert bytes(src.read(entry, 0, entry.nbytes)) == tensor.numpy().tobytes()
            chunked = b"".join(bytes(c) for c in src.chunks(entry, 10_000))
            assert chunked == tensor.numpy().tobytes()
    assert seen and all(t.startswith("shardkit-read") for t in seen), "reads run on the reader pool"


def test_a_source_file_that_shrinks_is_refused_with_the_tensor_named(tmp_path: Path) -> None:
    path, _ = _checkpoint(tmp_path)
    with open_source(path) as src:
        entry = max((e for e in src.entries() if e.nbytes > 100), key=lambda e: e.offset)
        os.truncate(path, entry.offset + 10)
        with pytest.raises(HeaderError, match=rf"{entry.name}.*truncated"):
            src.read(entry, 0, entry.nbytes)


def test_split_with_a_cast_reads_through_the_readers_and_matches_the_reference(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    import shardkit

    path, tensors = _checkpoint(tmp_path)
    shardkit.split(path, tmp_path / "out", max_shard_size="200KB", dtype="bf16", allow_lossy=True)
    with shardkit.open(tmp_path / "out") as out:
        for name, tensor in tensors.items():
            want = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
            assert torch.equal(out[name], want)
    assert load_file(str(next((tmp_path / "out").glob("*00001*.safetensors"))))


def test_a_warm_local_file_is_read_with_one_pread_per_request_as_auto_would_map_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where read="auto" maps a file (its pages cached on a local disk), a source copies from the page cache
    on the caller's thread: no reader threads, no read-ahead."""
    from shardkit.reading.residency import BackendChoice
    from shardkit.reading.sequential import CachedReads
    from shardkit.sources import safetensors as st

    path, tensors = _checkpoint(tmp_path)
    monkeypatch.setattr(st, "choose_backend", lambda p, read, fd=None: BackendChoice("mmap", "warm (test)"))
    monkeypatch.setattr(readers.Reader, "read_one", lambda self, job: pytest.fail("no reader thread for a warm file"))
    with open_source(path) as src:
        for entry in src.entries():
            assert bytes(src.read(entry, 0, entry.nbytes)) == tensors[entry.name].numpy().tobytes()
        assert all(isinstance(r, CachedReads) for r in src._reads.values())


def test_a_cold_file_on_a_passthrough_mount_is_copied_by_parallel_reads_not_through_the_map(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` maps a cold file on a mount answering like a local disk (for tensors handed to callers);
    a source copies every byte anyway, so it reads that file in parallel (O_DIRECT where taken)."""
    from shardkit.reading.residency import BackendChoice
    from shardkit.reading.sequential import RangeReads
    from shardkit.sources import safetensors as st

    path, tensors = _checkpoint(tmp_path)
    choice = BackendChoice("mmap", "passthrough (test)", None, "passthrough")
    monkeypatch.setattr(st, "choose_backend", lambda p, read, fd=None: choice)
    with open_source(path) as src:
        for entry in src.entries():
            assert bytes(src.read(entry, 0, entry.nbytes)) == tensors[entry.name].numpy().tobytes()
        assert all(isinstance(r, RangeReads) for r in src._reads.values())
        assert {r.reader.chunk_bytes for r in src._reads.values()} == {readers.PASSTHROUGH_CHUNK_BYTES}
