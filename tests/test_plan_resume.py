"""`convert --resume` killed (SIGKILL) anywhere, then run again: the output is byte-identical to an
uninterrupted run and the bytes written twice are at most one shard (counted from the fault traces:
every write call's bytes, shards and small files, see shardkit/_faults.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_plan_file import make_source
from test_plan_run import folder_bytes

import shardkit

ARGS = ["--max-shard-size", "20KB", "--dtype", "bf16", "--resume"]


def _convert(src: Path, out: Path, trace: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shardkit", "convert", str(src), str(out), *ARGS, "-q"],
                          env={**os.environ, "SHARDKIT_FAULT_TRACE": str(trace), **env}, capture_output=True,
                          text=True, timeout=300)


def _trace(path: Path) -> list[tuple[int, str, int]]:
    """``(point, label, bytes written so far)`` for every fault point a run passed."""
    rows = [line.split() for line in path.read_text().splitlines()] if path.exists() else []
    return [(int(n), label, int(b)) for n, label, b in rows]


def _kill_points(labels: list[str], count: int) -> list[int]:
    """``count`` points (1-based): spread evenly over the run (its first and last included), plus the
    two sides of the publish's commit, and a shard renamed but not yet recorded done."""
    special = [i + 1 for i, label in enumerate(labels) if label.startswith("commit:")][-2:]
    special.append(labels.index("plan:shard-renamed", len(labels) // 2) + 1)
    spread = count - len(special)
    points = {1 + round(i * (len(labels) - 1) / (spread - 1)) for i in range(spread)} | set(special)
    assert len(points) == count, points
    return sorted(points)


def _kill_then_rerun(tmp_path: Path, count: int) -> list[tuple[int, str, int]]:
    src = make_source(tmp_path / "src")
    plan = shardkit.write_plan(src, tmp_path / "out", max_shard_size="20KB", dtype="bf16")
    shard_bytes = max(t.size_bytes for t in plan.tasks)
    ref_run = _convert(src, tmp_path / "ref", tmp_path / "ref.trace")
    assert ref_run.returncode == 0, ref_run.stderr
    ref = _trace(tmp_path / "ref.trace")
    ref_bytes, reference = ref[-1][2], folder_bytes(tmp_path / "ref")
    report = []
    for k in _kill_points([label for _, label, _ in ref], count):
        out = tmp_path / f"out{k}"
        killed = _convert(src, out, tmp_path / f"kill{k}.trace", SHARDKIT_FAULT_KILL_AT=str(k))
        assert killed.returncode == -9, f"point {k}: {killed.returncode} {killed.stderr[-2000:]}"
        rerun = _convert(src, out, tmp_path / f"rerun{k}.trace")
        assert rerun.returncode == 0, f"point {k}: {rerun.stderr[-2000:]}"
        assert folder_bytes(out) == reference, f"point {k}: output differs"
        assert not [n for n in os.listdir(tmp_path) if n.startswith(f".out{k}.")], f"point {k}: leftovers"
        killed_trace, rerun_trace = _trace(tmp_path / f"kill{k}.trace"), _trace(tmp_path / f"rerun{k}.trace")
        twice = killed_trace[-1][2] + (rerun_trace[-1][2] if rerun_trace else 0) - ref_bytes
        assert 0 <= twice <= shard_bytes, f"point {k} ({killed_trace[-1][1]}): {twice} bytes written twice"
        report.append((k, killed_trace[-1][1], twice))
    return report


def test_convert_resume_killed_at_points_ends_identical_with_at_most_one_shard_rewritten(tmp_path: Path) -> None:
    report = _kill_then_rerun(tmp_path, 5)
    assert len(report) == 5


@pytest.mark.slow
def test_convert_resume_killed_at_ten_points_ends_identical_with_at_most_one_shard_rewritten(tmp_path: Path) -> None:
    report = _kill_then_rerun(tmp_path, 10)
    assert len(report) == 10
    labels = [label for _, label, _ in report]
    assert "write" in labels and "plan:shard-renamed" in labels  # inside a shard; renamed, not recorded
    assert {"commit:before-staging-rename", "commit:after-staging-rename", "plan:published"} <= set(labels)
