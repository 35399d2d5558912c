"""Parallel read-ahead of a mapped shard (``shardkit.reading.map_ahead``): bounded by its window, advice
only, and stopped on every path (close, a refused advice, interpreter exit without close)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import safetensors.torch
import torch

import shardkit
from shardkit.reading import residency
from shardkit.reading.map_ahead import MapReadAhead

MiB = 1 << 20


def _ahead_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("shardkit-map-ahead")]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_asks_only_a_window_beyond_what_callers_asked_for(tmp_path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(bytes(10 * MiB))
    fd = os.open(path, os.O_RDONLY)
    try:
        ahead = MapReadAhead(fd, 10 * MiB, chunk_bytes=MiB, window_bytes=3 * MiB)
        ahead.advance(0)
        assert ahead.asked_bytes == 3 * MiB
        ahead.advance(MiB + 5)  # within a chunk: rounded up to whole chunks, never past the window
        assert ahead.asked_bytes == 5 * MiB
        ahead.advance(100 * MiB)
        assert ahead.asked_bytes == 10 * MiB  # never past the file
        assert ahead.close() and ahead.close()  # a second close is a no-op
        ahead.advance(0)
        assert ahead.asked_bytes == 10 * MiB and not _ahead_threads()
    finally:
        os.close(fd)


def test_close_joins_its_threads_and_closes_its_descriptor(tmp_path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(bytes(4 * MiB))
    fd = os.open(path, os.O_RDONLY)
    before = _open_fds()
    ahead = MapReadAhead(fd, 4 * MiB, chunk_bytes=MiB)
    assert _open_fds() == before + 1  # its own duplicate: the shard may close its descriptor first
    ahead.advance(4 * MiB)
    os.close(fd)
    assert ahead.close()
    assert _open_fds() == before - 1 and not _ahead_threads()


def test_the_pages_it_advises_end_up_in_the_page_cache(tmp_path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(16 * MiB))
    os.sync()
    if residency.evict(str(path)) is None or (residency.cached_fraction(str(path)) or 0) > 0.2:
        import pytest

        pytest.skip("this filesystem keeps the file cached after POSIX_FADV_DONTNEED")
    fd = os.open(path, os.O_RDONLY)
    try:
        ahead = MapReadAhead(fd, 16 * MiB, chunk_bytes=2 * MiB)
        ahead.advance(16 * MiB)
        deadline = time.monotonic() + 10  # advised in the background (close would cancel what is queued)
        while (residency.cached_fraction(str(path)) or 0) < 0.9 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (residency.cached_fraction(str(path)) or 0) >= 0.9
        assert ahead.close()
    finally:
        os.close(fd)


def test_a_refused_advice_stops_the_read_ahead_not_the_read() -> None:
    read_end, write_end = os.pipe()  # posix_fadvise on a pipe: ESPIPE
    try:
        ahead = MapReadAhead(read_end, 4 * MiB)
        ahead.advance(4 * MiB)
        assert ahead.asked_bytes == 0 and ahead.close()
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_checkpoint_on_a_passthrough_mount_is_mapped_read_ahead_and_closed(tmp_path, monkeypatch) -> None:
    tensors = {f"w{i}": torch.randn(64, 1024) for i in range(8)}
    safetensors.torch.save_file(tensors, tmp_path / "model.safetensors")
    residency.forget_mount_latencies()
    monkeypatch.setattr(residency, "remote_filesystem", lambda p: "fuse")
    monkeypatch.setattr(residency, "cached_fraction", lambda p, **kw: 0.0)
    monkeypatch.setattr(residency, "request_latency_s", lambda p, **kw: 0.00005)  # bindfs over a local disk
    try:
        with shardkit.open(tmp_path / "model.safetensors") as ckpt:
            assert all(torch.equal(ckpt[k], t) for k, t in tensors.items())
            (report,) = ckpt.read_report()
            assert report["backend"] == "mmap" and "read ahead" in report["reason"], report
            (shard,) = ckpt._shards.values()
            assert shard.ahead is not None and shard.ahead.asked_bytes == os.path.getsize(tmp_path / "model.safetensors")
        assert shard.ahead is None and not _ahead_threads()
    finally:
        residency.forget_mount_latencies()


EXIT_SCRIPT = textwrap.dedent("""
    import os, sys
    from shardkit.reading.map_ahead import MapReadAhead
    fd = os.open(sys.argv[1], os.O_RDONLY)
    ahead = MapReadAhead(fd, os.path.getsize(sys.argv[1]), chunk_bytes=1 << 20)
    ahead.advance(os.path.getsize(sys.argv[1]))
    # no close(): the interpreter exits with advice queued
""")


def test_an_unclosed_read_ahead_exits_clean(tmp_path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(bytes(64 * MiB))
    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT)
    for _ in range(5):
        done = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True, timeout=120)
        assert (done.returncode, done.stderr) == (0, "")
