"""Reads that keep the pipe full: parallel ranges, read-ahead, one plan over all shards, row slices.

Counted by the latency mount (tests/latency_mount.py): requests in flight, bytes, distinct bytes.
No timings are asserted.
"""

from __future__ import annotations

import gc
import json
import os
import threading
import weakref

import pytest
import safetensors.torch
import torch
from conftest import make_state_dict, tensor_bytes
from helpers_latency import mount_or_skip
from safetensors import safe_open

import shardkit
from shardkit.errors import HeaderError, InvalidInputError, ShardkitError
from shardkit.reading import readers, residency

ALL_SHAPES = [(), (0,), (7,), (5, 3), (64, 33)]


def _shard_headers(folder) -> int:
    """Bytes of the shards' length prefixes and headers."""
    total = 0
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            with open(os.path.join(folder, name), "rb") as f:
                total += 8 + int.from_bytes(f.read(8), "little")
    return total


def _model(src, *, tensors: int = 24, nbytes: int = 1 << 20, max_shard_size: str = "8MB") -> dict[str, torch.Tensor]:
    state = {f"blocks.{i:02d}.weight": torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
             .view(torch.float16).reshape(64, -1) for i in range(tensors)}
    state["norm.bias"] = torch.randn(7)  # a small tensor between the big ones
    shardkit.save_sharded(state, src, max_shard_size=max_shard_size)
    return state


@pytest.fixture
def slow_mount(tmp_path, monkeypatch):
    """A 10 ms latency mount without page cache (every read reaches it), unmounted afterwards; range
    reads of 512 KiB so that a model of a few MiB makes as many ranges as a real one makes of 4 MiB.
    (At 10 ms the server's own CPU time per request, on 2 busy cores, is small beside the latency:
    the requests in flight are the reader's doing.)"""
    yield from _latency_mount(tmp_path, monkeypatch, latency_ms=10)


@pytest.fixture
def slower_mount(tmp_path, monkeypatch):
    """The same at 40 ms, for counting requests in flight: at 10 ms, on 2 cores busy with other
    work, the reader's threads (and the FUSE server's) were sometimes not all started within one
    request's latency, so fewer than 8 overlapped (about 1 run in 10)."""
    yield from _latency_mount(tmp_path, monkeypatch, latency_ms=40)


def _latency_mount(tmp_path, monkeypatch, *, latency_ms: int):
    monkeypatch.setattr(readers, "REMOTE_CHUNK_BYTES", 512 << 10)
    mount = mount_or_skip(tmp_path, latency_ms=latency_ms, direct_io=True)
    try:
        yield mount
    finally:
        mount.stop()


def _assert_read_once(stats: dict, state: dict, src, *, boundary_pages: int) -> None:
    """Every byte of every shard read, none twice; ``direct`` reads whole 4 KiB pages, so a page
    shared by two separately read ranges (a tensor boundary, the header's end) may come twice."""
    shard_bytes = sum(n for f, n in stats["files"].items() if f.endswith(".safetensors"))
    assert shard_bytes == sum(t.nbytes for t in state.values()) + _shard_headers(src), "every byte read"
    assert 0 <= stats["bytes"] - stats["distinct_bytes"] <= 4096 * boundary_pages, stats


@pytest.mark.parametrize("read", ["pread", "auto"])
def test_iterating_keeps_many_reads_in_flight_and_reads_every_byte_once(slow_mount, read) -> None:
    state = _model(slow_mount.source)
    with shardkit.open(slow_mount.mountpoint, read=read) as ckpt:
        slow_mount.reset()
        for name in ckpt:
            assert tensor_bytes(ckpt[name]) == tensor_bytes(state[name]), name
        backends = {r["backend"] for r in ckpt.read_report()}
    assert backends == {read} if read != "auto" else backends <= {"direct", "pread"}, backends
    stats = slow_mount.stats()
    assert stats["peak_in_flight"] >= 8, stats
    _assert_read_once(stats, state, slow_mount.source, boundary_pages=0 if backends == {"pread"} else 2 * len(state))


@pytest.mark.parametrize("read", ["pread", "auto"])
@pytest.mark.parametrize("how", ["to_state_dict", "load_model"])
def test_one_plan_over_all_shards_reads_each_byte_once_with_many_in_flight(slower_mount, how, read) -> None:
    state = _model(slower_mount.source, max_shard_size="6MB")
    shards = len([n for n in os.listdir(slower_mount.source) if n.endswith(".safetensors")])
    assert shards >= 3
    if how == "to_state_dict":
        with shardkit.open(slower_mount.mountpoint, read=read) as ckpt:
            got = ckpt.to_state_dict()
    else:
        model = shardkit.load_model(lambda: _Blocks(state), slower_mount.mountpoint, read=read)
        got = model.state_dict()
        assert model.shardkit_load_report["host_batch_bytes"] == sum(t.nbytes for t in state.values())
    assert all(tensor_bytes(got[n]) == tensor_bytes(state[n]) for n in state)
    stats = slower_mount.stats()
    assert stats["peak_in_flight"] >= 8, stats
    # auto also times LATENCY_PROBES one-page requests per shard (residency.request_latency_s): read twice
    _assert_read_once(stats, state, slower_mount.source,
                      boundary_pages=0 if read == "pread" else (2 + residency.LATENCY_PROBES) * shards)


class _Blocks(torch.nn.Module):
    """A module whose parameters are exactly ``state``'s names and shapes."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in state.items():
            module = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            module.register_parameter(leaf, torch.nn.Parameter(torch.empty_like(tensor),
                                                               requires_grad=False))


@pytest.mark.parametrize("read", ["pread", "auto"])
def test_get_slice_reads_only_the_rows_asked_for(slow_mount, read) -> None:
    big = torch.randint(0, 256, (256, 1024), dtype=torch.uint8)
    safetensors.torch.save_file({"big": big, "other": torch.randn(10)}, os.path.join(slow_mount.source, "w.safetensors"))
    with shardkit.open(os.path.join(slow_mount.mountpoint, "w.safetensors"), read=read, read_ahead_bytes=0) as ckpt:
        direct = ckpt.read_report()[0]["backend"] == "direct"
        slow_mount.reset()
        part = ckpt.get_slice("big")
        assert torch.equal(part[10:14], big[10:14])
        assert torch.equal(part[-1], big[-1]) and torch.equal(part[3:9:2, 5:7], big[3:9:2, 5:7])
        assert part[5:5].shape == (0, 1024)
        with pytest.raises(IndexError):
            part[256]
    stats = slow_mount.stats()
    rows_bytes = (4 + 1 + 5) * 1024  # 10:14, -1, 3:8
    if direct:  # whole pages: at most two more per slice
        assert rows_bytes <= stats["bytes"] <= rows_bytes + 3 * 2 * 4096, stats
    else:
        assert stats["bytes"] == rows_bytes, "only the rows' bytes"


def test_close_mid_iteration_leaves_no_thread_and_no_buffer(tmp_path) -> None:
    mount = mount_or_skip(tmp_path, latency_ms=20, direct_io=True)
    try:
        _model(mount.source, tensors=24, nbytes=1 << 20)
        ckpt = shardkit.open(mount.mountpoint)
        names = list(ckpt)
        ckpt[names[0]]  # read-ahead of the next tensors is in flight now
        pending = [weakref.ref(p.tensor) for p in ckpt._fresh.ahead.pending.values()]
        assert pending, "the first read must start the read-ahead"
        ckpt.close()
        gc.collect()
        assert not [t.name for t in threading.enumerate() if t.name.startswith("shardkit-read")]
        assert all(ref() is None for ref in pending), "read-ahead buffers are released on close"
        assert ckpt._fresh.ahead.pending_bytes == 0
        with pytest.raises(InvalidInputError, match="closed"):
            ckpt[names[1]]
    finally:
        mount.stop()


def test_a_checkpoint_dropped_without_close_leaves_no_reader_thread(tmp_path) -> None:
    path = tmp_path / "w.safetensors"
    safetensors.torch.save_file({f"w{i}": torch.randn(1000) for i in range(8)}, path)
    ckpt = shardkit.open(path, read="pread")
    for name in ckpt:
        ckpt[name]
    assert any(t.name.startswith("shardkit-read") for t in threading.enumerate())
    del ckpt, name
    gc.collect()
    for thread in [t for t in threading.enumerate() if t.name.startswith("shardkit-read")]:
        thread.join(timeout=10)
        assert not thread.is_alive()


def test_read_ahead_stays_within_its_budget(slow_mount) -> None:
    _model(slow_mount.source, tensors=16, nbytes=1 << 20)
    with shardkit.open(slow_mount.mountpoint, read_ahead_bytes=3 << 20) as ckpt:
        names = list(ckpt)
        ckpt[names[0]]
        ahead = ckpt._fresh.ahead
        assert 0 < ahead.pending_bytes <= 3 << 20 and len(ahead.pending) == 3
    with shardkit.open(slow_mount.mountpoint, read_ahead_bytes=0) as ckpt:
        ckpt[next(iter(ckpt))]
        assert not ckpt._fresh.ahead.pending


def test_file_truncated_during_read_ahead_is_the_one_line_error(tmp_path) -> None:
    mount = mount_or_skip(tmp_path, latency_ms=20, direct_io=True)
    try:
        _model(mount.source, tensors=8, nbytes=1 << 20, max_shard_size="1GB")
        (path,) = [os.path.join(mount.source, n) for n in os.listdir(mount.source) if n.endswith(".safetensors")]
        with shardkit.open(mount.mountpoint) as ckpt:
            names = list(ckpt)
            ckpt[names[0]]
            os.truncate(path, os.path.getsize(path) // 2)
            with pytest.raises((HeaderError, InvalidInputError)) as err:
                for name in names[1:]:
                    ckpt[name]
    finally:
        mount.stop()
    message = str(err.value)
    assert "\n" not in message and "model.safetensors" in message
    assert "file ended" in message or "changed on disk" in message


def test_file_rewritten_in_place_during_read_ahead_is_refused(tmp_path) -> None:
    _model(tmp_path / "ckpt", tensors=6, nbytes=64 << 10, max_shard_size="1GB")
    path = tmp_path / "ckpt" / "model.safetensors"
    with shardkit.open(path, read="pread") as ckpt:
        names = list(ckpt)
        ckpt[names[0]]
        assert ckpt._fresh.ahead.pending
        data = bytearray(path.read_bytes())
        data[-10:] = bytes(10)
        with open(path, "r+b") as f:  # same inode, same size, new bytes and mtime
            f.write(data)
        os.utime(path, ns=(1, 1))
        with pytest.raises(InvalidInputError, match="changed on disk while open") as err:
            for name in names[1:]:
                ckpt[name]
    assert str(path) in str(err.value)


@pytest.mark.parametrize("read", ["mmap", "pread", "direct"])
def test_every_dtype_byte_exact_against_safe_open_through_each_path(tmp_path, read, monkeypatch) -> None:
    monkeypatch.setattr(readers, "CHUNK_BYTES", 1000)  # many ranges per tensor, odd boundaries
    tensors = make_state_dict(shapes=ALL_SHAPES)
    out = tmp_path / "ckpt"
    shardkit.save_sharded(tensors, out, max_shard_size="4KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    with shardkit.open(out, read=read, read_ahead_bytes=20_000) as ckpt:
        iterated = {name: ckpt[name] for name in ckpt}
    with shardkit.open(out, read=read) as ckpt:
        planned = ckpt.to_state_dict()
        sliced = {n: ckpt.get_slice(n)[1:4] for n in ckpt if len(ckpt.shape_of(n)) >= 1}
    for name, want_shard in index.items():
        with safe_open(out / want_shard, framework="pt") as ref:
            want = ref.get_tensor(name)
            for got in (iterated[name], planned[name]):
                assert got.dtype == want.dtype and got.shape == want.shape, name
                assert tensor_bytes(got) == tensor_bytes(want), name
            if name in sliced:
                assert tensor_bytes(sliced[name]) == tensor_bytes(ref.get_slice(name)[1:4]), name


@pytest.mark.parametrize("read", ["mmap", "pread"])
@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_header_and_bytes_come_from_the_same_file_when_it_is_replaced(tmp_path, read, layout) -> None:
    """Issue 21 item 5: a reshard that replaces a file after its header was read must not pair
    the old header's offsets with the new file's bytes."""
    old = {"a": torch.arange(1000, dtype=torch.int32), "b": torch.arange(500, dtype=torch.float64)}
    new = {"b": torch.full((3000,), 7, dtype=torch.int32), "a": torch.zeros(10, dtype=torch.int64)}
    if layout == "single":
        path = tmp_path / "w.safetensors"
        safetensors.torch.save_file(old, path)
        target = victim = path
    else:
        target = tmp_path / "ckpt"
        shardkit.save_sharded(old, target, max_shard_size="1GB")
        victim = target / "model.safetensors"
    with shardkit.open(target, read=read) as ckpt:
        assert ckpt.shape_of("a") == (1000,)  # the header is read now
        staged = tmp_path / "staged.safetensors"
        safetensors.torch.save_file(new, staged)
        os.replace(staged, victim)  # an in-place reshard renames the new file over the old
        got_a, got_b = ckpt["a"], ckpt["b"]
    assert torch.equal(got_a, old["a"]) and torch.equal(got_b, old["b"])


def test_device_pipeline_reads_the_file_whose_header_it_has(tmp_path) -> None:
    """The ring pipeline (the GPU path, run here with host stages) reads through the descriptor
    the header came from, not the path, which a reshard may have replaced."""
    from shardkit.loading.bulk import Want, read_batch

    old = {"a": torch.arange(1000, dtype=torch.int32), "b": torch.arange(500, dtype=torch.float64)}
    path = tmp_path / "w.safetensors"
    safetensors.torch.save_file(old, path)
    with shardkit.open(path, read="pread") as ckpt:
        staged = tmp_path / "staged.safetensors"
        safetensors.torch.save_file({"b": torch.full((3000,), 7, dtype=torch.int32)}, staged)
        os.replace(staged, path)
        values, _ = read_batch(ckpt, {n: Want(n, "cpu", t.dtype) for n, t in old.items()}, pipe_host=True)
    assert torch.equal(values["a"], old["a"]) and torch.equal(values["b"], old["b"])


def test_errors_from_reads_keep_their_type(tmp_path) -> None:
    path = tmp_path / "w.safetensors"
    safetensors.torch.save_file({"w": torch.randn(4096)}, path)
    with shardkit.open(path, read="pread") as ckpt:
        os.truncate(path, 100)
        with pytest.raises(ShardkitError) as err:
            ckpt["w"]
    assert isinstance(err.value, (HeaderError, InvalidInputError)) and str(path) in str(err.value)


def test_direct_reads_of_one_tensor_land_in_place_without_the_bounce_buffer(tmp_path, monkeypatch) -> None:
    """``ck[k]`` with ``direct``: a tensor of at least IN_PLACE_BYTES is read straight into its
    page-padded memory (no bounce-buffer copy), byte-exact, through the read-ahead and without it."""
    from shardkit.loading import fresh_reads

    state = _model(tmp_path / "ckpt", tensors=6, nbytes=fresh_reads.IN_PLACE_BYTES * 2, max_shard_size="1GB")
    bounced: list[int] = []
    real = readers.DirectReader._read_bounced
    monkeypatch.setattr(readers.DirectReader, "_read_bounced",
                        lambda self, job: (bounced.append(job.nbytes), real(self, job))[1])
    for ahead in (0, 64 << 20):
        with shardkit.open(tmp_path / "ckpt", read="direct", read_ahead_bytes=ahead) as ckpt:
            if ckpt.reader_of("norm.bias") is None or ckpt.reader_of("norm.bias").backend != "direct":
                pytest.skip("O_DIRECT is refused on this filesystem")
            got = {name: ckpt[name] for name in ckpt}
        assert all(tensor_bytes(got[n]) == tensor_bytes(t) for n, t in state.items())
    assert all(n < fresh_reads.IN_PLACE_BYTES for n in bounced), bounced  # only the small tensor bounced
