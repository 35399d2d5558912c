#!/usr/bin/env python3
"""A read-only FUSE passthrough that costs a round trip per read request (tests and benchmarks).

On a network mount (NFS, Lustre, CephFS, gcsfuse, s3fs...) every read request pays a round trip,
so speed is requests in flight × request size ÷ latency, whatever the disk behind it. This mount
makes that measurable and noise-free on any machine: it serves a folder read-only, sleeps
``latency_ms`` in every read request, serves requests concurrently (``max_threads`` FUSE
threads), and counts requests, bytes (and the distinct bytes: a byte read twice shows), the
largest request and the peak number of requests in flight. Keep the backing files in the page
cache and the only cost left is the access pattern.

The counters are read through two virtual files at the mount's root (never counted themselves):
``.latency-stats`` (a JSON snapshot) and ``.latency-reset`` (the snapshot, then zeroed).

    with LatencyMount(src_folder, mnt_folder, latency_ms=2) as mount:
        ...read files under mnt_folder...
        print(mount.stats())       # {"requests": ..., "bytes": ..., "peak_in_flight": ..., ...}

Run alone: ``python tests/latency_mount.py SRC MNT --latency-ms 2`` (foreground; unmount with
``fusermount3 -u MNT``). Needs ``/dev/fuse``, ``fusermount3`` (Debian: ``fuse3``) and the
``mfusepy`` package (dev extras); :func:`fuse_unavailable` says which is missing.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
import typing
from dataclasses import dataclass, field

STATS_FILE = ".latency-stats"
RESET_FILE = ".latency-reset"
_VIRTUAL = {"/" + STATS_FILE, "/" + RESET_FILE}
_VIRTUAL_BYTES = 1 << 20   # the size the virtual files report (reads stop at the JSON's end)
FUSE_REQUEST_BYTES = 128 << 10  # the kernel's default largest FUSE read request (32 pages)


def fusermount() -> str | None:
    """The ``fusermount3`` (or ``fusermount``) binary, or None."""
    return shutil.which("fusermount3") or shutil.which("fusermount")


def fuse_unavailable() -> str | None:
    """Why a latency mount cannot run here (for a test's skip reason), or None when it can."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse: FUSE is unavailable in this container"
    if fusermount() is None:
        return "fusermount3 is not installed (Debian package fuse3)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as e:  # OSError: the package is there, libfuse is not
        return f"mfusepy cannot load libfuse ({e}); pip install mfusepy, apt-get install fuse3"
    return None


@dataclass
class Counters:
    """What the mount saw: requests, bytes, distinct bytes per file, peak requests in flight."""

    requests: int = 0
    bytes: int = 0
    in_flight: int = 0
    peak_in_flight: int = 0
    largest_request_bytes: int = 0
    ranges: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    def snapshot(self) -> dict:
        return {"requests": self.requests, "bytes": self.bytes, "peak_in_flight": self.peak_in_flight,
                "largest_request_bytes": self.largest_request_bytes, "in_flight": self.in_flight,
                "distinct_bytes": sum(_union_bytes(r) for r in self.ranges.values()),
                "files": {p: _union_bytes(r) for p, r in self.ranges.items()}}


def _union_bytes(ranges: list[tuple[int, int]]) -> int:
    total, end = 0, -1
    for start, stop in sorted(ranges):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def _operations(source: str, latency_s: float, direct_io: bool):
    """The mfusepy operations: a read-only passthrough of ``source`` with a sleep per read."""
    import mfusepy

    class LatencyPassthrough(mfusepy.Operations):
        use_ns = True

        def __init__(self) -> None:
            self.counters = Counters()
            self.mutex = threading.Lock()  # not "lock": that name is the FUSE file-lock operation

        def _real(self, path: str) -> str:
            return os.path.join(source, path.lstrip("/"))

        def init_with_config(self, conn, config) -> None:
            if conn is not None:  # let the kernel keep more readahead requests in flight (default 12)
                conn.max_background = 64
                conn.congestion_threshold = 48

        def getattr(self, path: str, fh=None) -> dict:
            if path in _VIRTUAL:
                return {"st_mode": stat.S_IFREG | 0o444, "st_nlink": 1, "st_size": _VIRTUAL_BYTES}
            try:
                st = os.lstat(self._real(path))
            except OSError as e:
                raise mfusepy.FuseOSError(e.errno) from None
            keys = ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid", "st_atime_ns", "st_mtime_ns", "st_ctime_ns")
            out = {k: getattr(st, k) for k in keys}
            out["st_mode"] &= ~0o222  # read-only
            return out

        def readdir(self, path: str, fh: int):
            return [".", "..", *os.listdir(self._real(path))]

        def open(self, path: str, fi) -> int:
            if fi.flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND):
                raise mfusepy.FuseOSError(errno.EROFS)
            virtual = path in _VIRTUAL
            fi.fh = 0 if virtual else os.open(self._real(path), os.O_RDONLY)
            fi.direct_io = 1 if virtual or direct_io else 0
            fi.keep_cache = 0  # each open drops the file's page cache: every process starts cold
            return 0

        def read(self, path: str, size: int, offset: int, fi) -> bytes:
            if path in _VIRTUAL:
                return self._stats(reset=path.endswith(RESET_FILE))[offset:offset + size]
            with self.mutex:
                c = self.counters
                c.in_flight += 1
                c.peak_in_flight = max(c.peak_in_flight, c.in_flight)
            try:
                time.sleep(latency_s)
                data = os.pread(fi.fh, size, offset)
            finally:
                with self.mutex:
                    self.counters.in_flight -= 1
            with self.mutex:
                c = self.counters
                c.requests += 1
                c.bytes += len(data)
                c.largest_request_bytes = max(c.largest_request_bytes, len(data))
                c.ranges.setdefault(path, []).append((offset, offset + len(data)))
            return data

        def _stats(self, *, reset: bool) -> bytes:
            with self.mutex:
                snap = self.counters.snapshot()
                if reset:
                    in_flight = self.counters.in_flight
                    self.counters = Counters(in_flight=in_flight, peak_in_flight=in_flight)
            return (json.dumps(snap) + "\n").encode()

        def release(self, path: str, fi) -> int:
            if path not in _VIRTUAL:
                os.close(fi.fh)
            return 0

        def statfs(self, path: str) -> dict:
            st = os.statvfs(source)
            return {k: getattr(st, k) for k in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail",
                                                "f_files", "f_ffree", "f_namemax")}

    return LatencyPassthrough()


def serve(source: str, mountpoint: str, *, latency_ms: float, max_threads: int, direct_io: bool) -> None:
    """Mount and serve in the foreground until unmounted."""
    _prefer_libfuse3()
    import mfusepy

    threads = {"max_threads": max_threads, "max_idle_threads": max_threads} if mfusepy.fuse_version_major == 3 else {}
    mfusepy.FUSE(_operations(os.path.abspath(source), latency_ms / 1000, direct_io), mountpoint, raw_fi=True,
                 foreground=True, ro=True, fsname="latencyfs", **threads)


def _prefer_libfuse3() -> None:
    """mfusepy loads libfuse 2 where both are installed; libfuse 3 bounds the server's threads."""
    from ctypes.util import find_library

    if "FUSE_LIBRARY_PATH" not in os.environ and find_library("fuse3"):
        os.environ["FUSE_LIBRARY_PATH"] = find_library("fuse3") or ""


class LatencyMount:
    """``source`` served read-only at ``mountpoint`` by a child process, ``latency_ms`` per read request.

    The limit of the mount: ``max_threads`` requests in flight × 128 KiB (the kernel's largest
    FUSE read) ÷ latency (:meth:`limit_bytes_per_s`).
    """

    def __init__(self, source: str | os.PathLike[str], mountpoint: str | os.PathLike[str], *, latency_ms: float = 2.0,
                 max_threads: int = 16, direct_io: bool = False, start_timeout_s: float = 20.0) -> None:
        self.source, self.mountpoint = os.fspath(source), os.fspath(mountpoint)
        self.latency_ms, self.max_threads, self.direct_io = latency_ms, max_threads, direct_io
        self._start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen | None = None
        self._log: typing.IO[str] | None = None

    def limit_bytes_per_s(self, request_bytes: int = FUSE_REQUEST_BYTES) -> float:
        """The mount's physical limit: requests in flight × request size ÷ latency."""
        return self.max_threads * request_bytes / (self.latency_ms / 1000)

    def start(self) -> LatencyMount:
        os.makedirs(self.mountpoint, exist_ok=True)
        args = [sys.executable, os.path.abspath(__file__), self.source, self.mountpoint,
                "--latency-ms", str(self.latency_ms), "--max-threads", str(self.max_threads)]
        # The server's log goes to a file, never a pipe: a full pipe nobody drains blocks the server
        # (every thread, the GIL held) the next time libfuse or mfusepy logs a line.
        self._log = tempfile.TemporaryFile("w+")
        self._proc = subprocess.Popen([*args, *(["--direct-io"] if self.direct_io else [])],
                                      stdout=subprocess.DEVNULL, stderr=self._log, text=True)
        deadline = time.monotonic() + self._start_timeout_s
        while not os.path.ismount(self.mountpoint):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self._log.seek(0)
                err = self._log.read() if self._proc.poll() is not None else "timed out"
                self.stop()
                raise RuntimeError(f"latency mount at {self.mountpoint} failed to start: {err.strip()[-500:]}")
            time.sleep(0.05)
        return self

    def stats(self, *, reset: bool = False) -> dict:
        """The counters (``requests``, ``bytes``, ``distinct_bytes``, ``peak_in_flight``, ``files``...)."""
        # One read request, its first line: each request of the virtual file is a fresh snapshot, so a
        # second request (at the offset where the first ended) could return the tail of a newer one.
        fd = os.open(os.path.join(self.mountpoint, RESET_FILE if reset else STATS_FILE), os.O_RDONLY)
        try:
            return json.loads(os.read(fd, _VIRTUAL_BYTES).split(b"\n", 1)[0])
        finally:
            os.close(fd)

    def reset(self) -> dict:
        """The counters so far, then zeroed."""
        return self.stats(reset=True)

    def stop(self) -> None:
        """Unmount and wait for the server (bounded); lazy-unmount if it hangs."""
        if os.path.ismount(self.mountpoint):
            done = subprocess.run([fusermount() or "fusermount3", "-u", self.mountpoint], capture_output=True)
            if done.returncode != 0:
                subprocess.run(["umount", "-l", self.mountpoint], capture_output=True)
        if self._proc is not None:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
            self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> LatencyMount:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source")
    parser.add_argument("mountpoint")
    parser.add_argument("--latency-ms", type=float, default=2.0, help="sleep in every read request")
    parser.add_argument("--max-threads", type=int, default=16, help="requests served at once")
    parser.add_argument("--direct-io", action="store_true", help="no page cache: every read() reaches the mount")
    args = parser.parse_args()
    serve(args.source, args.mountpoint, latency_ms=args.latency_ms, max_threads=args.max_threads,
          direct_io=args.direct_io)
    return 0


if __name__ == "__main__":
    sys.exit(main())
