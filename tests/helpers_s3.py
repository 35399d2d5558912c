"""SeaweedFS and the delay proxy (tests/s3_server.py) for tests; skips with the reason where ``weed`` cannot run.

The fixtures in conftest.py: ``s3_server`` (one SeaweedFS per session, stopped at its end),
``s3_env`` (a fresh bucket, and the standard AWS_* variables pointing at the server with
``~/.aws`` files hidden, so the user's own configuration never leaks into a test).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from s3_server import ACCESS_KEY, SECRET_KEY, DelayProxy, SeaweedS3, weed_unavailable

__all__ = ["ACCESS_KEY", "SECRET_KEY", "DelayProxy", "S3Env", "SeaweedS3", "new_bucket", "paused_cli",
           "sharded_checkpoint", "start_or_skip"]


def sharded_checkpoint(tmp_path: Path, run_cli) -> Path:  # noqa: ANN001 - the conftest fixture
    """A 3-shard checkpoint of ~12 MB (random bytes) with an index and a manifest, at ``tmp_path/ckpt``."""
    from conftest import make_state_dict
    from safetensors.torch import save_file

    state = make_state_dict(["F32", "BF16", "I64"], shapes=[(1000, 1000), (7, 3)])
    save_file(state, tmp_path / "one.safetensors")
    out = tmp_path / "ckpt"
    result = run_cli("split", tmp_path / "one.safetensors", out, "--max-shard-size", "5MB")
    assert result.exit_code == 0, result.stderr
    assert len(list(out.glob("*.safetensors"))) == 3
    return out


def multipart_source(tmp_path: Path) -> Path:
    """One ~40 MB safetensors file (random bytes): shards of 20 MB go to the store by multipart upload."""
    from conftest import make_state_dict
    from safetensors.torch import save_file

    path = tmp_path / "src" / "model.safetensors"
    path.parent.mkdir()
    save_file(make_state_dict(["F32", "BF16"], shapes=[(2500, 2000), (7, 3)]), path)
    return path


def paused_cli(s3_env: S3Env, point: str, args: list[str], wait: Path) -> subprocess.Popen[bytes]:
    """``shardkit ARGS`` in a subprocess with ``s3_env``'s variables, paused at the fault ``point``
    (``shardkit._faults``: it waits for ``wait`` and marks it ``.ready.*``); the test fails if it never gets there."""
    from conftest import SHARDKIT_BIN

    env = {**os.environ, **s3_env.env, "SHARDKIT_FAULT_WAIT_AT": point, "SHARDKIT_FAULT_WAIT_FILE": str(wait),
           "PYTHONFAULTHANDLER": "1"}  # a test that finds it stuck sends SIGABRT: every thread's stack on stderr
    # SIGINT reset to its default: a test runner started in the background (a CI job, `cmd &`) ignores SIGINT, the
    # child would inherit that, and Python then installs no KeyboardInterrupt handler (Ctrl-C tests would hang)
    proc = subprocess.Popen([SHARDKIT_BIN, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not list(wait.parent.glob(wait.name + ".ready.*")):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            _, err = proc.communicate(timeout=30)
            pytest.fail(f"shardkit {' '.join(args)} never reached {point}: {err.decode()}")
        time.sleep(0.05)
    return proc


def start_or_skip(data_dir: str | os.PathLike[str]) -> SeaweedS3:
    """A started SeaweedFS (stop it), or a skip saying why the binary cannot run."""
    reason = weed_unavailable()
    if reason:
        pytest.skip(reason)
    return SeaweedS3(data_dir).start()


def new_bucket(server: SeaweedS3) -> str:
    """A new, empty bucket with a unique name."""
    name = f"t-{uuid.uuid4().hex[:12]}"
    client = server.client()
    try:
        client.create_bucket(Bucket=name)  # type: ignore[attr-defined]
    finally:
        client.close()  # type: ignore[attr-defined]
    return name


@dataclass
class S3Env:
    """One test's view of the server: its bucket, the environment set, a boto3 client for setup."""

    server: SeaweedS3
    bucket: str
    env: dict[str, str] = field(default_factory=dict)

    def client(self, *, port: int | None = None):  # noqa: ANN201 - a boto3 client
        return self.server.client(port=port)

    def put(self, key: str, data: bytes) -> None:
        client = self.client()
        try:
            client.put_object(Bucket=self.bucket, Key=key, Body=data)
        finally:
            client.close()

    def put_folder(self, folder: Path, prefix: str) -> int:
        """Upload every file under ``folder`` to ``prefix/<relative path>``; the bytes uploaded."""
        total = 0
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                data = path.read_bytes()
                self.put(f"{prefix}/{path.relative_to(folder).as_posix()}", data)
                total += len(data)
        return total

    def get(self, key: str) -> bytes:
        client = self.client()
        try:
            return client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        finally:
            client.close()

    def keys(self, prefix: str = "") -> list[str]:
        client = self.client()
        try:
            pages = client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
            return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))
        finally:
            client.close()

    def uploads(self) -> list[str]:
        """Keys of multipart uploads still open in the bucket."""
        client = self.client()
        try:
            return sorted(u["Key"] for u in client.list_multipart_uploads(Bucket=self.bucket).get("Uploads", []))
        finally:
            client.close()
