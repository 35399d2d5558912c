"""shardkit.distributed.ray: a plan's tasks as Ray tasks on a local 2-CPU cluster give the single-process bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_plan_file import make_source
from test_plan_run import folder_bytes

import shardkit

ray = pytest.importorskip("ray")


@pytest.mark.slow
def test_ray_runs_the_plan_to_the_single_process_bytes(tmp_path: Path) -> None:
    src = make_source(tmp_path / "src")
    shardkit.convert(src, tmp_path / "ref", max_shard_size="20KB", dtype="bf16")
    plan = shardkit.write_plan(src, tmp_path / "out", tmp_path / "plan.json", max_shard_size="20KB", dtype="bf16")
    shardkit.run_plan(plan, task=2)  # done before: skipped, not sent to Ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        run = shardkit.run_plan(tmp_path / "plan.json", engine="ray")
    finally:
        ray.shutdown()
    assert (run.written, run.skipped, run.published) == ([0, 1, 3, 4, 5], [2], True)
    assert folder_bytes(tmp_path / "out") == folder_bytes(tmp_path / "ref")


def test_ray_takes_no_task_or_finalize(tmp_path: Path) -> None:
    plan = shardkit.write_plan(make_source(tmp_path / "src"), tmp_path / "out", max_shard_size="20KB")
    with pytest.raises(shardkit.InvalidInputError, match="engine='ray' runs every task left"):
        shardkit.run_plan(plan, task=0, engine="ray")


@pytest.mark.slow
def test_ray_runs_an_s3_to_s3_plan_to_the_single_process_objects(s3_env: Any, tmp_path: Path) -> None:
    from test_plan_s3 import prefix_bytes

    s3_env.put_folder(make_source(tmp_path / "src"), "src")
    source, bucket = f"s3://{s3_env.bucket}/src", f"s3://{s3_env.bucket}"
    shardkit.convert(source, f"{bucket}/ref", max_shard_size="20KB", dtype="bf16")
    shardkit.write_plan(source, f"{bucket}/out", tmp_path / "plan.json", max_shard_size="20KB", dtype="bf16")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)  # its workers inherit the AWS_* variables
    try:
        run = shardkit.run_plan(tmp_path / "plan.json", engine="ray")
    finally:
        ray.shutdown()
    assert (run.written, run.published) == ([0, 1, 2, 3, 4, 5], True)
    assert prefix_bytes(s3_env, "out") == prefix_bytes(s3_env, "ref") and s3_env.uploads() == []
