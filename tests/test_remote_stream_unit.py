"""``StreamedFile`` alone: windows, prefetch, skipping, out-of-order reads and the digest check, over an
in-memory store (:class:`FakeStore`), so every path is exercised without a server."""

from __future__ import annotations

import hashlib
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from shardkit.errors import HubError
from shardkit.stores import ObjectInfo, StoreUrl
from shardkit.stores import streamed as remote_stream
from shardkit.stores.mirror import HeaderMirror
from shardkit.workers import ReadPool

WINDOW = 1000


class FakeStore:
    """One object in memory; ``read`` answers each range (by default from ``data``), the ranges are logged."""

    url = StoreUrl("hf", "alice/m", "")

    def __init__(self, data: bytes, read=None) -> None:
        self.data, self.ranges, self.read = data, [], read or (lambda begin, end: data[begin:end])

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self.ranges.append((offset, offset + len(out)))
        out[:] = self.read(offset, offset + len(out))


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch):
    """A 10,500-byte remote file; the requested ranges are logged."""
    data = random.Random(7).randbytes(10_500)
    monkeypatch.setattr(remote_stream, "WINDOW_BYTES", WINDOW)
    monkeypatch.setattr(remote_stream, "SKIP_GAP_BYTES", WINDOW)
    store = FakeStore(data)
    return data, store.ranges, store


def open_stream(served, *, sha256: str | None = None, head_bytes: int = 100):
    data, _, store = served
    info = ObjectInfo("model.safetensors", len(data), digest=("sha256", sha256 or hashlib.sha256(data).hexdigest()))
    pool = ReadPool(4, name="test-stream")
    stream = remote_stream.StreamedFile(store, info, data[:head_bytes], pool=pool, hasher=ThreadPoolExecutor(1))
    return stream, pool


def test_a_whole_sequential_read_fetches_each_byte_once_and_checks_the_hash(served):
    data, ranges, _ = served
    stream, pool = open_stream(served)
    got = b"".join(bytes(stream.read(b, min(b + 777, len(data)))) for b in range(100, len(data), 777))
    pool.close()
    assert got == data[100:]
    assert sorted(ranges)[0][0] == 100 and sum(e - b for b, e in ranges) == len(data) - 100
    assert stream.digested_bytes == len(data)


def test_a_hash_mismatch_fails_at_the_last_window(served):
    data, _, _ = served
    stream, pool = open_stream(served, sha256="0" * 64)
    with pytest.raises(HubError, match="do not match the sha256 listed for it"):
        for b in range(100, len(data), 500):
            stream.read(b, min(b + 500, len(data)))
    pool.close()


def test_a_far_jump_skips_the_gap_and_drops_the_hash_check(served):
    data, ranges, _ = served
    stream, pool = open_stream(served, sha256="0" * 64)  # would fail if it were still checked
    assert bytes(stream.read(100, 300)) == data[100:300]
    assert bytes(stream.read(8_000, 10_500)) == data[8_000:10_500]
    pool.close()
    assert stream.digest is None
    assert not any(b < 8_000 < e for b, e in ranges[-3:])  # fetched from the jump, not through the gap
    assert sum(e - b for b, e in ranges) < len(data) - 100


def test_an_out_of_order_read_is_served_and_drops_the_hash_check(served):
    data, _, _ = served
    stream, pool = open_stream(served, sha256="0" * 64)
    assert bytes(stream.read(100, 1_500)) == data[100:1_500]  # sequential: still digesting
    assert stream.digest is not None
    assert bytes(stream.read(200, 250)) == data[200:250]  # behind the current window
    assert stream.digest is None
    assert bytes(stream.read(1_500, 10_500)) == data[1_500:]
    pool.close()


def test_reading_past_the_listed_size_is_one_error(served):
    data, _, _ = served
    stream, pool = open_stream(served)
    with pytest.raises(HubError, match="read past the end of the 10500-byte file its store lists"):
        stream.read(10_400, 10_600)
    pool.close()


def test_views_cover_windows_without_copying(served):
    data, _, _ = served
    stream, pool = open_stream(served)
    views = list(stream.views(100, 2_600))
    pool.close()
    assert all(isinstance(v, memoryview) for v in views) and b"".join(views) == data[100:2_600]
    assert [len(v) for v in views] == [1000, 1000, 500]  # the windows themselves


def test_release_drops_the_prefetch_and_a_later_read_is_still_served(served):
    data, ranges, _ = served
    stream, pool = open_stream(served)
    assert bytes(stream.read(100, 1_500)) == data[100:1_500]
    stream.release()  # the reader went to another file
    assert not stream.queue and stream.window[1] == b""
    fetched = len(ranges)
    got = b"".join(bytes(stream.read(b, min(b + 900, len(data)))) for b in range(1_500, len(data), 900))
    pool.close()
    assert got == data[1_500:] and len(ranges) > fetched
    assert stream.digest is None  # resumed inside the dropped window: served again, not hash-checked


def test_close_mid_read_stops_the_requests_in_flight_and_leaves_no_thread(tmp_path, monkeypatch):
    """Requests still retrying when the streams close are told to stop and waited for (bounded)."""
    import threading
    import time

    from test_remote import write_safetensors

    from shardkit.formats.header import read_header
    from shardkit.sources import RangedCheckpoint, open_source

    path = write_safetensors(tmp_path / "m" / "model.safetensors", count=6)
    data, header = path.read_bytes(), read_header(str(path))
    released = threading.Event()

    stop = threading.Event()

    def read(begin, end):
        if begin == header.data_start:
            return data[begin:end]  # the first window arrives; the prefetched ones hang, retrying
        deadline = time.monotonic() + 5  # a request that keeps failing and retrying, bounded for the test
        while time.monotonic() < deadline and not stop.is_set():
            time.sleep(0.01)
        released.set()
        raise HubError("stopped")

    monkeypatch.setattr(remote_stream, "WINDOW_BYTES", 64 * 1024)
    store = FakeStore(data, read)
    info = ObjectInfo("model.safetensors", len(data), digest=("sha256", hashlib.sha256(data).hexdigest()))
    mirror = HeaderMirror(str(path.parent), {info.name: info}, prefix_bytes={info.name: header.data_start})
    streams = remote_stream.StreamedObjects(store, mirror, stop=stop.set)
    src = open_source(RangedCheckpoint(str(path), streams.open_file, name="hf://alice/m", read_ahead=False))
    first = src.entries()[0]
    assert bytes(src.read(first, 0, 1000)) == data[header.data_start:header.data_start + 1000]
    started = time.monotonic()
    src.close()
    streams.close()
    assert released.is_set() and time.monotonic() - started < 4
    assert not [t for t in threading.enumerate() if t.name.startswith(("shardkit-stream", "shardkit-hash"))]
