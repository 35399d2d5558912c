"""The latency mount itself: a read-only passthrough that costs a round trip per request and counts them."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from helpers_latency import mount_or_skip


def _blob(folder, nbytes: int = 3 << 20) -> bytes:
    data = os.urandom(nbytes)
    (folder / "blob.bin").write_bytes(data)
    return data


@pytest.fixture
def latency_mount(tmp_path):
    """A 2 ms latency mount over ``tmp_path/src`` (page-cache mode), unmounted afterwards."""
    mount = mount_or_skip(tmp_path, latency_ms=2)
    try:
        yield mount
    finally:
        mount.stop()


def test_serves_the_bytes_counts_requests_and_refuses_writes(latency_mount) -> None:
    mount = latency_mount
    data = _blob(Path(mount.source))
    path = os.path.join(mount.mountpoint, "blob.bin")
    assert os.listdir(mount.mountpoint) == ["blob.bin"]
    with open(path, "rb") as f:
        assert f.read() == data
    stats = mount.reset()
    assert stats["bytes"] == stats["distinct_bytes"] == len(data) == stats["files"]["/blob.bin"]
    assert stats["requests"] >= len(data) // stats["largest_request_bytes"]
    assert mount.stats()["requests"] == 0, "reset zeroes the counters"
    with pytest.raises(OSError):
        open(path, "r+b")
    with pytest.raises(OSError):
        open(os.path.join(mount.mountpoint, "new.bin"), "wb")
    assert mount.stats()["requests"] == 0, "refused writes and the stats files are not counted"


def test_concurrent_reads_are_in_flight_together_and_a_byte_read_twice_shows(tmp_path) -> None:
    mount = mount_or_skip(tmp_path, latency_ms=20, direct_io=True, max_threads=8)
    try:
        data = _blob(tmp_path / "src", 8 * 64 << 10)
        fd = os.open(os.path.join(mount.mountpoint, "blob.bin"), os.O_RDONLY)
        try:
            barrier = threading.Barrier(8)

            def read(i: int) -> None:
                barrier.wait(timeout=10)
                assert os.pread(fd, 64 << 10, i * (64 << 10)) == data[i * (64 << 10):(i + 1) * (64 << 10)]

            threads = [threading.Thread(target=read, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=30)
            once = mount.stats()
            os.pread(fd, 4096, 0)  # direct_io: no page cache, the mount sees the repeat
            twice = mount.stats()
        finally:
            os.close(fd)
    finally:
        mount.stop()
    assert once["peak_in_flight"] >= 4, once  # each request sleeps 20 ms: they overlap
    assert once["bytes"] == once["distinct_bytes"] == len(data)
    assert twice["bytes"] == len(data) + 4096 and twice["distinct_bytes"] == len(data)
    assert not os.path.ismount(tmp_path / "mnt")


def test_limit_is_requests_in_flight_times_request_size_over_latency(tmp_path) -> None:
    from helpers_latency import LatencyMount

    mount = LatencyMount(tmp_path, tmp_path / "mnt", latency_ms=2, max_threads=16)
    assert mount.limit_bytes_per_s() == 16 * (128 << 10) / 0.002
