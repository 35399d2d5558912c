"""The streaming writer: kernel copies, chunked reads and casts, bounded memory, error mapping."""

from __future__ import annotations

import errno
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import SHARDKIT_BIN, assert_bit_equal, float_state_dict, load_folder, make_state_dict, tensor_bytes

from shardkit.errors import HeaderError, InvalidInputError, ShardkitWriteError
from shardkit.formats.header import TensorEntry, read_header
from shardkit.sharding import writer
from shardkit.sharding.writer import TensorWrite, tensor_write, write_safetensors
from shardkit.sources.memory import MemorySource
from shardkit.sources.safetensors import open_safetensors_file
from shardkit.units import DTYPE_BITS


class RecordingSource:
    """Wraps a source and records every read range, to prove reads are bounded."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.reads: list[int] = []

    def read(self, entry: Any, begin: int, end: int) -> Any:
        self.reads.append(end - begin)
        return self.inner.read(entry, begin, end)

    def chunks(self, entry: Any, chunk_bytes: int) -> Any:
        from shardkit.sources.base import Source

        return Source.chunks(self, entry, chunk_bytes)  # type: ignore[arg-type]  # through self.read

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _load(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def _writes(source: Any, cast_to: str | None = None) -> list[TensorWrite]:
    return [tensor_write(e, cast_to) for e in source.entries()]


def test_file_source_is_copied_kernel_side_as_one_coalesced_head_middle_tail(
        safetensors_file: Path, state_dict: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int, int]] = []
    real = os.copy_file_range

    def counting(src: int, dst: int, count: int, offset_src: int | None = None, *a: Any) -> int:
        calls.append((offset_src, a[0], count))
        return real(src, dst, count, offset_src, *a)

    monkeypatch.setattr(os, "copy_file_range", counting)
    with open_safetensors_file(str(safetensors_file)) as src:
        recording = RecordingSource(src)
        out = tmp_path / "out.safetensors"
        write_safetensors(str(out), _writes(src), recording, metadata={"format": "pt"})
    assert recording.reads == [], "bytes in a file must never go through Python"
    # One run, issued as head (to the next block boundary), block-aligned middle, tail: the
    # middle is what copy-on-write filesystems clone, so its offsets are aligned on both sides.
    assert sum(c[2] for c in calls) == sum(e.nbytes for e in src.entries()) and len(calls) == 3
    (h_src, h_dst, head), (_, _, tail), (m_src, m_dst, middle) = calls  # the middle goes last (clones after copies)
    assert h_dst + head == m_dst
    assert (h_src + head) % 4096 == 0 and head < 4096 and tail < 4096
    assert m_src % 4096 == m_dst % 4096 == 0 and middle % 4096 == 0 and middle > 0
    assert_bit_equal(_load(out), state_dict)
    assert out.read_bytes() == safetensors_file.read_bytes(), "same order + metadata → same bytes as the reference"


def test_non_adjacent_order_still_copies_exactly(safetensors_file: Path, state_dict: dict, tmp_path: Path) -> None:
    with open_safetensors_file(str(safetensors_file)) as src:
        placements = list(reversed(_writes(src)))
        out = tmp_path / "rev.safetensors"
        write_safetensors(str(out), placements, src)
    assert_bit_equal(_load(out), state_dict)
    assert [e.name for e in read_header(out).entries] == [p.out.name for p in placements]


@pytest.mark.parametrize("err", [errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP])
def test_falls_back_to_chunked_copy_when_kernel_copy_is_unsupported(
        safetensors_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int) -> None:
    with open_safetensors_file(str(safetensors_file)) as src:
        fast = tmp_path / "fast.safetensors"
        write_safetensors(str(fast), _writes(src), src)

        def unsupported(*a: Any) -> int:
            raise OSError(err, os.strerror(err))

        monkeypatch.setattr(os, "copy_file_range", unsupported)
        monkeypatch.setattr(writer, "CHUNK_BYTES", 5)
        slow = tmp_path / "slow.safetensors"
        write_safetensors(str(slow), _writes(src), src)
    assert slow.read_bytes() == fast.read_bytes()


def test_a_chunked_copy_write_that_writes_nothing_is_an_error_naming_the_shard(
        safetensors_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback copy writes through the one checked loop: a pwrite of 0 bytes is a ShardkitWriteError naming the
    shard (it spun forever)."""
    calls = [0]

    def nothing(*a: Any) -> int:
        calls[0] += 1
        assert calls[0] < 100, "the copy kept calling pwrite after a write that wrote nothing"
        return 0

    def unsupported(*a: Any) -> int:
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

    monkeypatch.setattr(os, "copy_file_range", unsupported)
    monkeypatch.setattr(os, "pwrite", nothing)
    out = tmp_path / "out.safetensors"
    with open_safetensors_file(str(safetensors_file)) as src, \
            pytest.raises(ShardkitWriteError, match=f"writing {out} failed: I/O error"):
        write_safetensors(str(out), _writes(src), src)
    assert calls[0] == 1


def test_memory_source_goes_through_bounded_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer, "CHUNK_BYTES", 7)
    tensors = make_state_dict(shapes=[(), (0,), (5, 3), (33,)])
    with MemorySource(tensors) as src:
        recording = RecordingSource(src)
        out = tmp_path / "mem.safetensors"
        write_safetensors(str(out), _writes(src), recording)
    assert recording.reads and max(recording.reads) <= 7
    assert_bit_equal(_load(out), tensors)


CAST_TARGETS = ["BF16", "F16", "F32", "F8_E4M3", "F8_E5M2"]


@pytest.mark.parametrize("target", CAST_TARGETS)
def test_chunked_cast_matches_torch_to(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str) -> None:
    import torch

    from shardkit.formats.dtypes import to_torch

    monkeypatch.setattr(writer, "CAST_CHUNK_BYTES", 24)  # many chunks per tensor, not a multiple of 8
    monkeypatch.setattr(writer, "CHUNK_BYTES", 24)
    tensors = float_state_dict()
    tensors["nan"] = torch.tensor([float("nan"), 1.0, -float("nan")])
    with MemorySource(tensors) as src:
        recording = RecordingSource(src)
        out = tmp_path / "cast.safetensors"
        seen: list[int] = []
        placements = _writes(src, target)
        write_safetensors(str(out), placements, recording, progress=seen.append)
    assert max(recording.reads) <= 24
    assert sum(seen) == sum(p.out.nbytes for p in placements), "progress counts output bytes"
    loaded = _load(out)
    for name, tensor in tensors.items():
        if tensor.is_floating_point():
            want = tensor.to(to_torch(target))
        else:
            want = tensor
        assert loaded[name].dtype == want.dtype, name
        assert tensor_bytes(loaded[name]) == tensor_bytes(want), name


def test_cast_from_a_file_source_matches_torch(safetensors_file: Path, state_dict: dict, tmp_path: Path) -> None:
    import torch

    out = tmp_path / "bf16.safetensors"
    with open_safetensors_file(str(safetensors_file)) as src:
        write_safetensors(str(out), _writes(src, "BF16"), src)
    loaded = _load(out)
    for name, tensor in state_dict.items():
        castable = tensor.dtype in (torch.float32, torch.float16, torch.float64, torch.bfloat16)
        want = tensor.to(torch.bfloat16) if castable else tensor
        assert tensor_bytes(loaded[name]) == tensor_bytes(want), name
        assert loaded[name].dtype == want.dtype


def test_tensor_write_casts_only_wide_floats() -> None:
    from shardkit.formats.header import TensorEntry

    keep = ["BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64", "C64", "F8_E4M3", "F8_E5M2", "F4"]
    for dtype in keep:
        entry = TensorEntry("x", dtype, (2,), 2)
        assert tensor_write(entry, "BF16").out == TensorEntry("x", dtype, (2,), 2)
    p = tensor_write(TensorEntry("x", "F32", (3,), 12, "/f", 100), "BF16")
    assert p.out == TensorEntry("x", "BF16", (3,), 6)  # the output entry has no source file
    assert tensor_write(TensorEntry("x", "F32", (3,), 12), None).out.dtype == "F32"


def test_header_is_aligned_and_metadata_sorted(tmp_path: Path) -> None:
    tensors = make_state_dict(["F32", "U8"], shapes=[(3,)])
    out = tmp_path / "m.safetensors"
    with MemorySource(tensors) as src:
        write_safetensors(str(out), _writes(src), src, metadata={"z": "1", "a": "2", "format": "pt"})
    header = read_header(out)
    assert header.data_start % 8 == 0
    (n,) = struct.unpack("<Q", out.read_bytes()[:8])
    assert list(json.loads(out.read_bytes()[8:8 + n])["__metadata__"]) == ["a", "format", "z"]


def test_refuses_an_existing_file(tmp_path: Path) -> None:
    out = tmp_path / "exists.safetensors"
    out.write_bytes(b"keep me")
    with MemorySource(make_state_dict(["F32"])) as src, pytest.raises(ShardkitWriteError, match=str(out)):
        write_safetensors(str(out), _writes(src), src)
    assert out.read_bytes() == b"keep me"


@pytest.mark.parametrize("err, fragment", [(errno.ENOSPC, "no space left"), (errno.EFBIG, "too large"),
                                           (errno.EIO, "I/O error")])
def test_write_errors_become_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int,
                                             fragment: str) -> None:
    def failing_write(fd: int, data: Any) -> int:
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(os, "write", failing_write)
    with MemorySource(make_state_dict(["F32"])) as src, pytest.raises(ShardkitWriteError) as info:
        write_safetensors(str(tmp_path / "x.safetensors"), _writes(src), src)
    assert fragment in str(info.value) and isinstance(info.value, OSError)


def test_source_truncated_after_opening_is_detected(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "f32.safetensors"
    save_file(make_state_dict(["F32", "F64"], shapes=[(40,), (7,)]), str(path))
    with open_safetensors_file(str(path)) as src:
        os.truncate(path, path.stat().st_size - 10)
        with pytest.raises(InvalidInputError, match="truncated"):
            write_safetensors(str(tmp_path / "a.safetensors"), _writes(src), src)
        with pytest.raises(HeaderError, match="truncated"):
            write_safetensors(str(tmp_path / "b.safetensors"), _writes(src, "BF16"), src)


# ------------------------------------------------------------------ memory, measured

def _sparse_safetensors(path: Path, tensors: dict[str, int]) -> Path:
    """A big F32 file without writing its bytes: the data buffer is a hole (reads as zeros)."""
    doc, cursor = {}, 0
    for name, numel in tensors.items():
        doc[name] = {"dtype": "F32", "shape": [numel], "data_offsets": [cursor, cursor + 4 * numel]}
        cursor += 4 * numel
    raw = json.dumps(doc).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + cursor)
    return path


def _peak_rss_mib(args: list[str]) -> int:
    """Peak RSS of one child process, measured by a fresh wrapper (so no other child counts)."""
    code = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
            "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024)")
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    returncode, rss = map(int, done.stdout.split())
    assert returncode == 0, done.stderr
    return rss


def test_copy_memory_does_not_depend_on_tensor_size(tmp_path: Path) -> None:
    """Two 96 MiB tensors: a Python copy would need ≥ 96 MiB; the kernel copy stays small."""
    src = _sparse_safetensors(tmp_path / "big.safetensors", {"a": 24 * 2**20, "b": 24 * 2**20})
    rss = _peak_rss_mib([SHARDKIT_BIN, "split", str(src), str(tmp_path / "out"), "--max-shard-size", "100MB", "-q"])
    assert rss < 80, f"peak RSS {rss} MiB"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
        "shardkit.manifest.json"]


@pytest.mark.slow
def test_cast_memory_does_not_depend_on_tensor_size(tmp_path: Path) -> None:
    """A 640 MiB F32 tensor cast to bf16 costs a bounded amount above importing torch."""
    baseline = _peak_rss_mib([sys.executable, "-c", "import torch, shardkit.cli"])
    src = _sparse_safetensors(tmp_path / "big.safetensors", {"a": 160 * 2**20})
    rss = _peak_rss_mib([SHARDKIT_BIN, "split", str(src), str(tmp_path / "out"), "--dtype", "bf16", "-q"])
    assert rss - baseline < 250, f"peak RSS {rss} MiB vs {baseline} MiB for importing torch"


def test_kernel_copy_reads_the_file_the_source_opened_even_if_replaced(tmp_path: Path) -> None:
    """Another process renaming a new file onto the path must not change what we copy."""
    from safetensors.torch import save_file

    original = make_state_dict(["F32", "I64"], shapes=[(50,)], seed=1)
    path = tmp_path / "model.safetensors"
    save_file(original, str(path))
    with open_safetensors_file(str(path)) as src:
        save_file(make_state_dict(["F32", "I64"], shapes=[(50,)], seed=2), str(tmp_path / "new.safetensors"))
        os.replace(tmp_path / "new.safetensors", path)
        out = tmp_path / "out.safetensors"
        write_safetensors(str(out), _writes(src), src)
    assert_bit_equal(_load(out), original)


def test_every_split_shard_keeps_its_source_block_offset(tmp_path: Path) -> None:
    """Copy-on-write padding on any filesystem: each shard's first tensor sits at its source offset mod 4096."""
    from safetensors.torch import save_file

    import shardkit

    tensors = make_state_dict(["F32", "BF16", "I64", "BOOL"], shapes=[(37,), (1500,), (3, 700)])
    src = tmp_path / "model.safetensors"
    save_file(tensors, str(src))
    by_name = read_header(src).by_name()
    result = shardkit.split(src, tmp_path / "out", max_shard_size="9KB")
    assert len(result.plan.shards) > 2 and result.cloned_bytes == 0  # tmp is not a cloning filesystem
    assert result.to_dict()["copied_bytes"] == result.plan.total_bytes
    for shard in (tmp_path / "out").glob("*.safetensors"):
        header = read_header(shard)
        first = header.entries[0]
        big_enough = sum(e.nbytes for e in header.entries) >= 4096
        if big_enough:
            assert header.data_start % 4096 == by_name[first.name].offset % 4096
        for entry in header.entries:  # never less aligned than the source
            item = max(1, DTYPE_BITS[entry.dtype] // 8)
            assert entry.offset % item == 0 or by_name[entry.name].offset % item != 0
    assert_bit_equal(load_folder(tmp_path / "out"), tensors)


def test_clone_alignment_picks_the_class_with_the_most_bytes() -> None:
    def w(name: str, nbytes: int, file: str | None, offset: int) -> TensorWrite:
        entry = TensorEntry(name, "U8", (nbytes,), nbytes, file, offset)
        return TensorWrite(entry, TensorEntry(name, "U8", (nbytes,), nbytes))

    small, large = w("a", 5000, "x", 100), w("b", 9000, "y", 7 * 4096 + 24)
    assert writer.clone_alignment([small, large]) == (7 * 4096 + 24 - 5000) % 4096
    assert writer.clone_alignment([small]) == 100
    assert writer.clone_alignment([w("m", 9000, None, 0)]) is None, "bytes in memory cannot be cloned"
    assert writer.clone_alignment([w("t", 100, "x", 0)]) is None, "under a block: nothing to clone"


def test_a_zip_pickle_that_shrinks_after_opening_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    """The cast path reads a zip pickle's tensors by pread: a short read is an error, never a short tensor."""
    import torch

    import shardkit
    from shardkit.sources import open_source

    path = tmp_path / "model.pt"
    torch.save({"a": torch.randn(1000), "b": torch.randn(1000)}, path)
    with open_source(path) as src:
        os.truncate(path, os.path.getsize(path) - 3000)  # the zip's tail and b's bytes are gone
        with pytest.raises(HeaderError, match=r"tensor '\w' is truncated \(got \d+ of \d+ bytes"):
            shardkit.split(src, tmp_path / "out", dtype="bf16", allow_lossy=True)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]


class _ShrinkingSource(MemorySource):
    """A source whose tensor ``b`` yields fewer bytes than its size (a file rewritten under it)."""

    kernel_copy = False

    def chunks(self, entry: Any, chunk_bytes: int) -> Any:
        for chunk in super().chunks(entry, chunk_bytes):
            yield chunk[: len(chunk) // 2] if entry.name == "b" else chunk


@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_the_writer_refuses_a_tensor_whose_source_gave_too_few_bytes(tmp_path: Path, dtype: str | None) -> None:
    import torch

    import shardkit

    src = _ShrinkingSource({"a": torch.randn(64), "b": torch.randn(64)})
    if dtype:  # the cast path reads by range: half of each range arrives
        src.read = lambda entry, begin, end: MemorySource.read(src, entry, begin, (begin + end) // 2)  # type: ignore[method-assign]
    with pytest.raises(HeaderError, match=r"tensor '[ab]' gave \d+ of its 256 bytes"):
        shardkit.split(src, tmp_path / "out", dtype=dtype, allow_lossy=True)
    assert list(tmp_path.iterdir()) == []
