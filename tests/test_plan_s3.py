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


def test_a_one_shard_plan_without_an_index_and_a_rerun_after_publish(s3_env: Any, s3_source: str) -> None:
    bucket = f"s3://{s3_env.bucket}"
    shardkit.convert(s3_source, f"{bucket}/one-ref", dtype="bf16")
    plan = shardkit.write_plan(s3_source, f"{bucket}/one", dtype="bf16")
    assert len(plan.tasks) == 1 and plan.index is None
    assert shardkit.run_plan(plan).published
    assert prefix_bytes(s3_env, "one") == prefix_bytes(s3_env, "one-ref")
    with pytest.raises(shardkit.OutputExistsError):  # done and cleaned up: the same plan again is a new write
        shardkit.write_plan(s3_source, f"{bucket}/one", dtype="bf16")


@pytest.mark.parametrize("manifest", [True, False])
def test_a_one_shard_plan_finalized_again_after_its_publish_only_cleans_up(s3_env: Any, s3_source: str,
                                                                           manifest: bool) -> None:
    # scripts/bench_distributed.py: a worker given no task ran the whole plan and published it; the --finalize
    # after it refused the complete checkpoint ("1 task(s) not done (0)"): no index told it the plan was published
    bucket = f"s3://{s3_env.bucket}"
    shardkit.convert(s3_source, f"{bucket}/one-ref", dtype="bf16", manifest=manifest)
    plan = shardkit.write_plan(s3_source, f"{bucket}/one", dtype="bf16", manifest=manifest)
    assert len(plan.tasks) == 1 and plan.index is None
    assert shardkit.run_plan(plan).published
    assert shardkit.run_plan(plan, finalize=True).published
    assert prefix_bytes(s3_env, "one") == prefix_bytes(s3_env, "one-ref") and s3_env.uploads() == []
    # a shard uploaded whose record is gone is never taken for a published plan
    other = shardkit.write_plan(s3_source, f"{bucket}/two", dtype="bf16", manifest=manifest)
    shardkit.run_plan(other, task=0)
    client = s3_env.client()
    client.delete_object(Bucket=s3_env.bucket, Key=f"two/{work_prefix(other)}/done/00000.json")
    client.close()
    with pytest.raises(shardkit.InvalidInputError, match=r"1 task\(s\) not done \(0\)"):
        shardkit.run_plan(other, finalize=True)
    assert f"two/{journal_name(other)}" in s3_env.keys("two/")  # recover still knows the plan


def test_a_task_that_ends_after_another_process_published_the_plan_says_so_and_records_nothing(
        s3_env: Any, s3_source: str, tmp_path: Path) -> None:
    # a worker given no task runs the whole plan and publishes it while another still runs its task: the late task
    # used to record itself done in the published prefix (an object no finalize removes); it now says what happened
    from helpers_s3 import paused_cli

    shardkit.write_plan(s3_source, f"s3://{s3_env.bucket}/out", tmp_path / "plan.json", **OPTIONS)
    worker = paused_cli(s3_env, "plan:shard-uploaded", ["run", str(tmp_path / "plan.json"), "--task", "0", "-q"],
                        tmp_path / "go")
    assert shardkit.run_plan(tmp_path / "plan.json").published  # every task (0 too), then publish
    (tmp_path / "go").touch()
    _, err = worker.communicate(timeout=300)
    assert worker.returncode == 2 and "was published (or removed by recover) by another process while task 0 ran" \
        in err.decode(), err.decode()
    assert prefix_bytes(s3_env, "out") == prefix_bytes(s3_env, "ref") and s3_env.uploads() == []


def test_local_to_s3_and_s3_to_local_equal_one_process(s3_env: Any, s3_source: str, tmp_path: Path) -> None:
    src = make_source(tmp_path / "local-src")
    up = shardkit.write_plan(src, f"s3://{s3_env.bucket}/up", **OPTIONS)
    assert shardkit.run_plan(up).published
    assert prefix_bytes(s3_env, "up") == prefix_bytes(s3_env, "ref")
    down = shardkit.write_plan(s3_source, tmp_path / "down", **OPTIONS)
    assert shardkit.run_plan(down).published
    shardkit.convert(src, tmp_path / "local-ref", **OPTIONS)
    assert folder_bytes(tmp_path / "down") == folder_bytes(tmp_path / "local-ref")


def test_slurm_array_processes_into_a_bucket_one_task_twice_at_once_equal_one_process(
        s3_env: Any, s3_source: str, tmp_path: Path) -> None:
    import os

    shardkit.write_plan(s3_source, f"s3://{s3_env.bucket}/out", tmp_path / "plan.json", **OPTIONS)
    shardkit.run_plan(tmp_path / "plan.json", task=[1, 3, 4, 5])
    tasks = [0, 2, 2]  # task 2 runs in two processes at once: both upload it, the same bytes
    procs = [subprocess.Popen([sys.executable, "-m", "shardkit", "run", str(tmp_path / "plan.json"), "-q"],
                              env={**os.environ, "SLURM_ARRAY_TASK_ID": str(i)}, stderr=subprocess.PIPE, text=True)
             for i in tasks]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    assert not [k for k in s3_env.keys("out/") if k.endswith(".index.json")]  # array tasks never publish
    result = subprocess.run([sys.executable, "-m", "shardkit", "run", str(tmp_path / "plan.json"), "--finalize", "-q"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert prefix_bytes(s3_env, "out") == prefix_bytes(s3_env, "ref")
    assert s3_env.uploads() == []


@pytest.mark.slow
def test_torchrun_convert_resume_s3_to_s3_is_the_plan_run_over_ranks(s3_env: Any, s3_source: str) -> None:
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "shardkit", "convert", s3_source, f"s3://{s3_env.bucket}/out", "--max-shard-size", "20KB",
                          "--dtype", "bf16", "--resume"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "terminate called" not in run.stderr, run.stderr[-3000:]
    assert "wrote 3 shard task(s); published" in run.stdout  # rank 0 reports its share
    assert prefix_bytes(s3_env, "out") == prefix_bytes(s3_env, "ref") and s3_env.uploads() == []


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
    with pytest.warns(shardkit.ShardkitWarning, match="needs overwrite=True"):  # a dry run warns only
        shardkit.write_plan(s3_source, f"s3://{s3_env.bucket}/ref", **OPTIONS, dry_run=True)
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


# ----------------------------------------------------------------------------- killed, then run again

BIG = ["--max-shard-size", "20MB", "--dtype", "bf16"]  # shards of 16.8 MB: each a multipart upload of 2 parts


def big_source(s3_env: Any, tmp_path: Path) -> str:
    """Six float32 tensors of 16 MiB in the bucket: 3 bf16 shards past one 16 MiB part each."""
    import torch
    from safetensors.torch import save_file

    folder = tmp_path / "big"
    folder.mkdir()
    torch.manual_seed(1)
    save_file({f"layers.{i}.weight": torch.randn(2048, 2048) for i in range(6)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text('{"model_type": "toy"}\n')
    s3_env.put_folder(folder, "big")
    return f"s3://{s3_env.bucket}/big"


def _shardkit(args: list[str], trace: Path, **env: str) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-m", "shardkit", *args, "-q"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "SHARDKIT_FAULT_TRACE": str(trace), **env})


def _trace(path: Path) -> list[tuple[str, int]]:
    """``(label, bytes written so far)`` for every fault point a run passed."""
    rows = [line.split() for line in path.read_text().splitlines()] if path.exists() else []
    return [(label, int(b)) for _, label, b in rows]


def _kill_then_rerun(s3_env: Any, tmp_path: Path, args: Any, points: Any) -> list[tuple[str, int, int]]:
    """Run ``args(out)`` uninterrupted, then for each kill point a run SIGKILLed there and the same run again:
    the objects equal the uninterrupted run's, no upload is left open, at most one shard is written twice."""
    src = big_source(s3_env, tmp_path)
    plan = shardkit.write_plan(src, f"s3://{s3_env.bucket}/x", max_shard_size="20MB", dtype="bf16")
    shard_bytes = max(t.size_bytes for t in plan.tasks)
    assert len(plan.tasks) == 3 and shard_bytes > 16 << 20
    ref_run = _shardkit(args(src, "ref", tmp_path), tmp_path / "ref.trace")
    assert ref_run.returncode == 0, ref_run.stderr
    ref = _trace(tmp_path / "ref.trace")
    reference = prefix_bytes(s3_env, "ref")
    report = []
    for k in points([label for label, _ in ref]):
        out = f"out{k}"
        killed = _shardkit(args(src, out, tmp_path), tmp_path / f"kill{k}.trace", SHARDKIT_FAULT_KILL_AT=str(k))
        assert killed.returncode == -9, f"point {k}: {killed.returncode} {killed.stderr[-2000:]}"
        left_open = len(s3_env.uploads())
        rerun = _shardkit(args(src, out, tmp_path), tmp_path / f"rerun{k}.trace")
        assert rerun.returncode == 0, f"point {k}: {rerun.stderr[-2000:]}"
        assert prefix_bytes(s3_env, out) == reference, f"point {k}: the objects differ"
        assert s3_env.uploads() == [], f"point {k}: a multipart upload is left open"
        killed_trace, rerun_trace = _trace(tmp_path / f"kill{k}.trace"), _trace(tmp_path / f"rerun{k}.trace")
        twice = killed_trace[-1][1] + (rerun_trace[-1][1] if rerun_trace else 0) - ref[-1][1]
        assert 0 <= twice <= shard_bytes, f"point {k} ({killed_trace[-1][0]}): {twice} bytes written twice"
        report.append((killed_trace[-1][0], twice, left_open))
    return report


def _run_args(src: str, out: str, tmp_path: Path) -> list[str]:
    """A worker running every task of the plan, then publishing (the plan written once per output)."""
    plan = tmp_path / f"{out}.json"
    if not plan.exists():
        shardkit.write_plan(src, f"s3://{Path(src).parts[1]}/{out}", plan, max_shard_size="20MB", dtype="bf16")
    return ["run", str(plan)]


def test_a_worker_killed_mid_upload_then_run_again_ends_identical_with_at_most_one_shard_rewritten(
        s3_env: Any, tmp_path: Path) -> None:
    def mid_second_upload(labels: list[str]) -> list[int]:  # its first 16 MiB part sent, the rest not
        return [labels.index(f"store:sent:model-00002-of-00003.safetensors:{(8 << 20) * 2 + 216}") + 1]

    [(label, twice, left_open)] = _kill_then_rerun(s3_env, tmp_path, _run_args, mid_second_upload)
    assert label.startswith("store:sent:model-00002") and left_open == 1  # the killed upload, aborted by the rerun
    assert 16 << 20 < twice < 17 << 20  # that one shard only


def _resume_args(src: str, out: str, tmp_path: Path) -> list[str]:
    return ["convert", src, f"s3://{Path(src).parts[1]}/{out}", *BIG, "--resume"]


@pytest.mark.slow
def test_an_s3_to_s3_convert_resume_killed_at_ten_points_ends_identical_with_at_most_one_shard_rewritten(
        s3_env: Any, tmp_path: Path) -> None:
    def ten(labels: list[str]) -> list[int]:  # spread over the run, its first and last points included
        return sorted({1 + round(i * (len(labels) - 1) / 9) for i in range(10)})

    report = _kill_then_rerun(s3_env, tmp_path, _resume_args, ten)
    kinds = {":".join(label.split(":")[:2]) for label, _, _ in report}
    assert len(report) == 10 and {"store:sent", "plan:shard-uploaded", "plan:task-done", "store:put",
                                  "plan:published"} <= kinds
    assert any(left_open for _, _, left_open in report)  # killed mid-upload at least once
