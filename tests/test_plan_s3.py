"""Plans into and out of ``s3://`` (shardkit/distributed/plan_store.py, api/plans.open_plan_source), against SeaweedFS:
each task its own multipart upload, done-ness recorded in the store, finalize checks and publishes the index last,
the objects equal to a single-process write; a changed source is refused; recover removes an abandoned plan."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_one_line_error
from test_plan_file import make_source
from test_plan_run import folder_bytes

import shardkit
from shardkit.distributed.plan_store import journal_name, work_prefix

OPTIONS = {"max_shard_size": "20KB", "dtype": "bf16"}


def prefix_bytes(s3_env: Any, prefix: str) -> dict[str, bytes]:
    """Every object under ``prefix``, by name relative to it."""
    return {k[len(prefix) + 1:]: s3_env.get(k) for k in s3_env.keys(prefix + "/")}


@pytest.fixture
def s3_source(s3_env: Any, tmp_path: Path) -> str:
    """The 6-shard test source in the bucket, and the single-process S3 → S3 convert of it at ``ref``."""
    s3_env.put_folder(make_source(tmp_path / "src"), "src")
    shardkit.convert(f"s3://{s3_env.bucket}/src", f"s3://{s3_env.bucket}/ref", **OPTIONS)
    return f"s3://{s3_env.bucket}/src"


def test_s3_to_s3_tasks_in_any_order_then_finalize_equal_one_process(s3_env: Any, s3_source: str, tmp_path: Path) -> None:
    out = f"s3://{s3_env.bucket}/out"
    plan = shardkit.write_plan(s3_source, out, tmp_path / "plan.json", **OPTIONS)
    assert plan.sources[0].path.startswith(f"{s3_source}/") and all(s.etag for s in plan.sources)
    assert [r[0] for t in plan.tasks for r in t.reads][0] == f"{s3_source}/model.safetensors"
    again = shardkit.write_plan(s3_source, out, tmp_path / "again.json", **OPTIONS)  # another mirror folder
    assert (tmp_path / "plan.json").read_bytes() == (tmp_path / "again.json").read_bytes()
    for i in (5, 0, 3):
        assert shardkit.run_plan(tmp_path / "plan.json", task=i).written == [i]
    assert shardkit.run_plan(tmp_path / "plan.json", task=3).skipped == [3]
    with pytest.raises(shardkit.InvalidInputError, match=r"3 task\(s\) not done \(1, 2, 4\)"):
        shardkit.run_plan(tmp_path / "plan.json", finalize=True)
    assert not [k for k in s3_env.keys("out/") if k.endswith(".index.json")]  # nothing published yet
    assert f"out/{journal_name(plan)}" in s3_env.keys("out/")  # recover knows the plan from its first task
    run = shardkit.run_plan(tmp_path / "plan.json")
    assert (run.written, run.skipped, run.published) == ([1, 2, 4], [0, 3, 5], True)
    assert prefix_bytes(s3_env, "out") == prefix_bytes(s3_env, "ref")  # no record, journal or marker left
    assert s3_env.uploads() == []
    assert again.plan_id == plan.plan_id


def test_local_to_s3_and_s3_to_local_equal_one_process(s3_env: Any, s3_source: str, tmp_path: Path) -> None:
    src = make_source(tmp_path / "local-src")
    up = shardkit.write_plan(src, f"s3://{s3_env.bucket}/up", **OPTIONS)
    assert shardkit.run_plan(up).published
    assert prefix_bytes(s3_env, "up") == prefix_bytes(s3_env, "ref")
    down = shardkit.write_plan(s3_source, tmp_path / "down", **OPTIONS)
    assert shardkit.run_plan(down).published
    shardkit.convert(src, tmp_path / "local-ref", **OPTIONS)
    assert folder_bytes(tmp_path / "down") == folder_bytes(tmp_path / "local-ref")


def test_a_task_refuses_a_changed_source_object_in_one_line(s3_env: Any, s3_source: str, tmp_path: Path) -> None:
    shardkit.write_plan(s3_source, f"s3://{s3_env.bucket}/out", tmp_path / "plan.json", **OPTIONS)
    s3_env.put("src/config.json", b'{"model_type": "yot"}\n')  # the same size, another version
    result = subprocess.run([sys.executable, "-m", "shardkit", "run", str(tmp_path / "plan.json"), "--task", "0"],
                            capture_output=True, text=True, timeout=300)
    assert_one_line_error(result, code=2, contains="the source changed since the plan was written (ETag")
    assert s3_env.keys("out/") == []  # nothing written, not even the journal


def test_a_prefix_with_objects_is_refused_unless_the_plan_ran_there(s3_env: Any, s3_source: str) -> None:
    with pytest.raises(shardkit.OutputExistsError, match="already holds"):
        shardkit.write_plan(s3_source, f"s3://{s3_env.bucket}/ref", **OPTIONS)
    with pytest.raises(shardkit.InvalidInputError, match="cannot replace it atomically"):
        shardkit.write_plan(s3_source, f"s3://{s3_env.bucket}/ref", **OPTIONS, overwrite=True)
    plan = shardkit.write_plan(s3_source, f"s3://{s3_env.bucket}/out", **OPTIONS)
    shardkit.run_plan(plan, task=0)
    assert shardkit.write_plan(s3_source, f"s3://{s3_env.bucket}/out", **OPTIONS).plan_id == plan.plan_id  # a resume


def test_recover_removes_an_abandoned_plan_and_its_open_upload(s3_env: Any, s3_source: str) -> None:
    out = f"s3://{s3_env.bucket}/out"
    plan = shardkit.write_plan(s3_source, out, **OPTIONS)
    shardkit.run_plan(plan, task=[0, 1])
    client = s3_env.client()
    try:  # a task killed mid-upload leaves its multipart upload open
        client.create_multipart_upload(Bucket=s3_env.bucket, Key=f"out/{plan.tasks[2].output}")
    finally:
        client.close()
    assert s3_env.uploads() and any(work_prefix(plan) in k for k in s3_env.keys("out/"))
    removed = shardkit.recover(out).removed
    assert s3_env.keys("out/") == [] and s3_env.uploads() == []
    assert any("multipart upload aborted" in r for r in removed)
