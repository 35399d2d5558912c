"""``scripts/demo --s3``: the tiny UNet through a local SeaweedFS, bucket prefix to bucket prefix, then
``load_model`` from it; the server is stopped (and its data removed) when the demo ends or is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # ~45 s: builds the UNet, starts SeaweedFS, loads the model


def _weeds_under(folder: Path) -> list[int]:
    """Processes whose command line names ``folder`` (the demo's SeaweedFS)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(folder) in cmdline and "weed" in cmdline:
            found.append(int(pid))
    return found


def _run_demo(tmp_path: Path, **kwargs) -> subprocess.Popen:
    from helpers_s3 import weed_unavailable

    reason = weed_unavailable()
    if reason:
        pytest.skip(reason)
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    env = {k: v for k, v in env.items() if not k.startswith("AWS_")}
    return subprocess.Popen(["bash", str(REPO / "scripts" / "demo"), "--s3", "--out", str(tmp_path / "out")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, **kwargs)


def test_demo_s3_splits_bucket_to_bucket_and_loads_the_model(tmp_path) -> None:
    proc = _run_demo(tmp_path)
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out
    assert "$ shardkit split s3://demo/unet s3://demo/unet-sharded --max-shard-size 1MB" in out
    assert "wrote 4 shard(s), 3.17 MB to s3://demo/unet-sharded" in out
    assert "all 208 tensors bit-identical" in out and "outputs match" in out
    assert _weeds_under(tmp_path) == [] and not [n for n in os.listdir(tmp_path / "tmp") if n.startswith("shardkit-")]


def test_demo_s3_killed_midway_stops_its_server(tmp_path) -> None:
    proc = _run_demo(tmp_path)
    assert proc.stdout is not None
    try:
        for line in proc.stdout:  # the server is up and serving once step 3 starts
            if line.startswith("=== 3."):
                break
        else:
            pytest.fail("the demo ended before step 3")
        assert _weeds_under(tmp_path)
        proc.send_signal(signal.SIGTERM)  # bash execs python: the demo itself gets it
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while _weeds_under(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _weeds_under(tmp_path) == [] and not [n for n in os.listdir(tmp_path / "tmp") if n.startswith("shardkit-")]
