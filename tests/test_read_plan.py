"""The batch read plan: page-padded blocks that ``direct`` reads land in without a bounce buffer."""

from __future__ import annotations

import json
import os
import struct

import pytest
import safetensors.torch
import torch
from conftest import tensor_bytes
from safetensors import safe_open

from shardkit.errors import HeaderError
from shardkit.formats.dtypes import to_torch
from shardkit.formats.header import TensorEntry, read_header
from shardkit.reading import readers
from shardkit.reading.read_plan import Run, block_pad, plan_runs, read_runs
from shardkit.workers import ReadPool

PAGE = 4096


def _direct(path, chunk_bytes: int) -> readers.DirectReader:
    try:
        return readers.DirectReader(str(path), chunk_bytes=chunk_bytes, bounce_bytes=chunk_bytes)
    except OSError as e:
        pytest.skip(f"O_DIRECT unsupported on {path.parent}: {e}")


def _read_plan(path, reader: readers.Reader) -> dict[str, torch.Tensor]:
    entries = read_header(path).entries
    dtypes = {e.name: to_torch(e.dtype) for e in entries}
    pool = ReadPool(threads=3)
    try:
        return read_runs(plan_runs(entries, dtypes), {str(path): reader}, pool, dtypes=dtypes)
    finally:
        assert pool.close()


def _count_bounced(monkeypatch) -> list[readers.ReadJob]:
    bounced: list[readers.ReadJob] = []
    original = readers.DirectReader._read_bounced

    def spy(self, job):
        bounced.append(job)
        original(self, job)

    monkeypatch.setattr(readers.DirectReader, "_read_bounced", spy)
    return bounced


def test_direct_batch_reads_land_in_place_byte_exact(tmp_path, monkeypatch) -> None:
    # Several chunks per run, a data section starting mid-page and a file ending mid-page.
    tensors = {"a": torch.randn(3000), "b": torch.randn(5001).half(), "c": torch.randint(0, 9, (77,), dtype=torch.int64)}
    path = tmp_path / "w.safetensors"
    safetensors.torch.save_file(tensors, path)
    assert os.path.getsize(path) % PAGE and read_header(path).data_start % PAGE
    bounced = _count_bounced(monkeypatch)
    with _direct(path, chunk_bytes=2 * PAGE) as reader:
        state = _read_plan(path, reader)
    assert bounced == [], "page-padded blocks are read in place, not through the bounce buffer"
    with safe_open(path, framework="pt") as ref:
        for name in tensors:
            assert tensor_bytes(state[name]) == tensor_bytes(ref.get_tensor(name)), name
            assert state[name].data_ptr() % state[name].element_size() == 0, name


def _misaligned_file(path) -> dict[str, bytes]:
    """A valid safetensors file whose F32/F16 tensors start at odd offsets (writers other than
    safetensors' own may do that)."""
    raw = {"a_odd": os.urandom(3), "b": os.urandom(4000 * 4), "c": os.urandom(999 * 2)}
    spec, start = {}, 0
    for name, dtype, size in (("a_odd", "U8", 3), ("b", "F32", 4000), ("c", "F16", 999)):
        spec[name] = {"dtype": dtype, "shape": [size], "data_offsets": [start, start + len(raw[name])]}
        start += len(raw[name])
    header = json.dumps(spec).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"".join(raw.values()))
    return raw


def test_a_file_with_misaligned_tensors_is_read_through_the_bounce_buffer(tmp_path, monkeypatch) -> None:
    path = tmp_path / "odd.safetensors"
    raw = _misaligned_file(path)
    assert read_header(path).data_start % 8 == 0
    bounced = _count_bounced(monkeypatch)
    with _direct(path, chunk_bytes=2 * PAGE) as reader:
        state = _read_plan(path, reader)
    assert bounced, "a pad that would misalign a tensor is not used"
    for name, want in raw.items():
        assert tensor_bytes(state[name]) == want, name
        assert state[name].data_ptr() % state[name].element_size() == 0, name


def test_block_pad_keeps_file_pages_on_block_pages_unless_a_tensor_would_misalign() -> None:
    f32 = {"x": torch.float32, "y": torch.float32}
    aligned = Run("f", (TensorEntry("x", "F32", (4,), 16, "f", 3 * PAGE + 136),
                        TensorEntry("y", "F32", (4,), 16, "f", 3 * PAGE + 152)))
    assert block_pad(aligned, f32) == 136
    odd = Run("f", (TensorEntry("x", "F32", (4,), 16, "f", 3 * PAGE + 137),
                    TensorEntry("y", "F32", (4,), 16, "f", 3 * PAGE + 153)))
    assert block_pad(odd, f32) == 0
    assert block_pad(Run("f", (TensorEntry("x", "F32", (4,), 16, "f", 2 * PAGE),)), f32) == 0


@pytest.mark.parametrize("file_bytes", [3 * PAGE + 100, 3 * PAGE])  # ends mid-page, on a page
def test_in_place_read_of_a_truncated_file_is_a_one_line_error(tmp_path, file_bytes) -> None:
    path = tmp_path / "short.bin"
    data = os.urandom(file_bytes)
    path.write_bytes(data)
    block = torch.zeros(6 * PAGE, dtype=torch.uint8)
    skip = (-block.data_ptr()) % PAGE  # block[skip:] starts on a page
    with _direct(path, chunk_bytes=PAGE) as reader:
        reader.read_one(readers.ReadJob(block.data_ptr() + skip + 10, 10, file_bytes - 10, "short.bin", padded=True))
        assert block[skip + 10: skip + file_bytes].numpy().tobytes() == data[10:]
        with pytest.raises(HeaderError, match="short.bin: file ended at byte"):
            reader.read_one(readers.ReadJob(block.data_ptr() + skip + 10, 10, 4 * PAGE, "short.bin", padded=True))
