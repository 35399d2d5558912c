"""Running a plan (shardkit/distributed/plan_run.py, shardkit.run_plan, `shardkit run`): tasks in any order and
any number of times, finalize checks and publishes, every engine gives the single-process bytes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_one_line_error, invoke_cli
from test_plan_file import make_source

import shardkit
from shardkit.api.plans import read_plan
from shardkit.distributed.plan_run import is_done, work_folder


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture
def planned(tmp_path: Path) -> tuple[Path, Path, dict[str, bytes]]:
    """A source, its plan file (6 tasks) and the single-process convert's bytes."""
    src = make_source(tmp_path / "src")
    shardkit.convert(src, tmp_path / "ref", max_shard_size="20KB", dtype="bf16")
    shardkit.write_plan(src, tmp_path / "out", tmp_path / "plan.json", max_shard_size="20KB", dtype="bf16")
    return src, tmp_path / "plan.json", folder_bytes(tmp_path / "ref")


def test_tasks_in_any_order_then_finalize_give_the_single_process_bytes(planned: tuple[Path, Path, dict]) -> None:
    src, plan_path, ref = planned
    plan = read_plan(plan_path)
    for i in (5, 0, 3):
        assert shardkit.run_plan(plan_path, task=i).written == [i]
    assert shardkit.run_plan(plan_path, task=3).skipped == [3]  # done: skipped
    with pytest.raises(shardkit.InvalidInputError, match=r"3 task\(s\) not done \(1, 2, 4\)"):
        shardkit.run_plan(plan_path, finalize=True)
    assert not Path(plan.spec.output).exists()  # nothing published before every shard is there
    shardkit.run_plan(plan_path, task=[1, 2, 4])
    assert shardkit.run_plan(plan_path, finalize=True).published
    assert folder_bytes(Path(plan.spec.output)) == ref
    assert not os.path.exists(work_folder(plan))


def test_run_with_no_task_runs_what_is_left_and_publishes(planned: tuple[Path, Path, dict]) -> None:
    _, plan_path, ref = planned
    shardkit.run_plan(plan_path, task=2)
    run = shardkit.run_plan(plan_path)
    assert (run.written, run.skipped, run.published) == ([0, 1, 3, 4, 5], [2], True)
    assert folder_bytes(Path(run.output)) == ref


def test_a_published_plan_run_again_does_nothing_and_another_plan_is_refused(planned: tuple[Path, Path, dict],
                                                                              tmp_path: Path) -> None:
    """A second finalize (another worker, a repeated Slurm job) used to refuse '6 task(s) not done' and leave an
    empty work folder; a task, a whole run and a resume of the same job now find it published and change nothing."""
    src, plan_path, ref = planned
    plan = read_plan(plan_path)
    assert shardkit.run_plan(plan_path).published
    beside = sorted(p.name for p in tmp_path.iterdir())
    for again in ({"finalize": True}, {}, {"task": 0}):
        run = shardkit.run_plan(plan_path, **again)
        assert run.written == [] and (run.published or again == {"task": 0}), again
    resumed = invoke_cli("convert", src, tmp_path / "out", "--max-shard-size", "20KB", "--dtype", "bf16", "--resume")
    assert resumed.exit_code == 0, resumed.stderr
    assert folder_bytes(Path(plan.spec.output)) == ref
    assert sorted(p.name for p in tmp_path.iterdir()) == beside  # no work folder made again
    # The same names and sizes from another job (fp16 instead of bf16) are not this plan's: refused as before.
    shardkit.write_plan(src, tmp_path / "out", tmp_path / "fp16.json", max_shard_size="20KB", dtype="fp16",
                        overwrite=True)
    with pytest.raises(shardkit.InvalidInputError, match=r"6 task\(s\) not done"):
        shardkit.run_plan(tmp_path / "fp16.json", finalize=True)
    assert_one_line_error(invoke_cli("convert", src, tmp_path / "out", "--max-shard-size", "20KB", "--dtype", "fp16",
                                     "--resume"), contains="exists and is not empty")
    assert folder_bytes(Path(plan.spec.output)) == ref


def test_a_half_written_shard_is_redone_and_a_damaged_one_is_caught_by_finalize(planned: tuple[Path, Path, dict]) -> None:
    _, plan_path, ref = planned
    plan = read_plan(plan_path)
    work = Path(work_folder(plan))
    shardkit.run_plan(plan_path, task=[0, 1, 2, 3, 4, 5])
    # a shard renamed but never recorded (killed between the two): not done, so redone
    (work / "done" / "00001.json").unlink()
    (work / plan.tasks[1].output).write_bytes(b"half")
    (work / f".shardkit-tmp-999999999-dead-{plan.tasks[1].output}").write_bytes(b"x" * 100)
    assert not is_done(plan, 1)
    assert shardkit.run_plan(plan_path, task=1).written == [1]
    assert not list(work.glob(".shardkit-tmp-*"))
    # a recorded shard that changed afterwards is refused by finalize, naming the fix
    good = (work / plan.tasks[4].output).read_bytes()
    (work / plan.tasks[4].output).write_bytes(good[:-1])
    with pytest.raises(shardkit.InvalidInputError, match="not the file task 4 recorded"):
        shardkit.run_plan(plan_path, finalize=True)
    (work / plan.tasks[4].output).write_bytes(good)
    shardkit.run_plan(plan_path, finalize=True)
    assert folder_bytes(Path(plan.spec.output)) == ref


def test_a_task_refuses_a_changed_source_in_one_line(planned: tuple[Path, Path, dict]) -> None:
    src, plan_path, _ = planned
    model = src / "model.safetensors"
    os.utime(model, ns=(model.stat().st_atime_ns, model.stat().st_mtime_ns + 10**9))
    result = invoke_cli("run", str(plan_path), "--task", "0")
    assert_one_line_error(result, code=2)
    assert "the source changed since the plan was written (modified)" in result.stderr
    with model.open("ab") as f:
        f.write(b"\0")
    with pytest.raises(shardkit.InvalidInputError, match=r"size 197617, planned 197616\)"):
        shardkit.run_plan(plan_path, task=0)


def test_finalize_killed_after_its_commit_only_cleans_up(planned: tuple[Path, Path, dict]) -> None:
    _, plan_path, ref = planned
    plan = read_plan(plan_path)
    shardkit.run_plan(plan_path, task=list(range(6)))
    work = Path(work_folder(plan))
    keep = work.parent / "keep"
    os.link(work / "done" / "00000.json", keep)  # the work folder as a kill after the commit leaves it:
    shardkit.run_plan(plan_path, finalize=True)
    work.mkdir()  # rebuilt: shards hard-linked from the published output, records back
    (work / "done").mkdir()
    for t in plan.tasks:
        os.link(Path(plan.spec.output) / t.output, work / t.output)
    os.replace(keep, work / "done" / "00000.json")
    assert shardkit.run_plan(plan_path, finalize=True).published
    assert not work.exists() and folder_bytes(Path(plan.spec.output)) == ref


def test_recover_removes_an_abandoned_plan(planned: tuple[Path, Path, dict]) -> None:
    _, plan_path, _ = planned
    plan = read_plan(plan_path)
    shardkit.run_plan(plan_path, task=[0, 1])
    report = shardkit.recover(plan.spec.output)
    assert report.removed == [work_folder(plan)] and report.removed_bytes > 2 * 16_000
    assert not os.path.exists(work_folder(plan))


def test_cli_run_reports_and_the_json_says_what_ran(planned: tuple[Path, Path, dict]) -> None:
    _, plan_path, ref = planned
    result = invoke_cli("run", str(plan_path), "--task", "0", "--task", "1")
    assert result.exit_code == 0 and "wrote 2 shard task(s)" in result.stdout
    result = invoke_cli("run", str(plan_path), "--dry-run")
    assert "task 5: model-00006-of-00006.safetensors" in result.stdout
    result = invoke_cli("run", str(plan_path), "--json")
    assert result.exit_code == 0, result.stderr
    assert '"skipped": [\n    0,\n    1\n  ]' in result.stdout and '"published": true' in result.stdout
    assert folder_bytes(Path(plan_path.parent / "out")) == ref


def test_resume_continues_from_the_done_shards(tmp_path: Path) -> None:
    src = make_source(tmp_path / "src")
    shardkit.convert(src, tmp_path / "ref", max_shard_size="20KB", dtype="bf16")
    plan = shardkit.write_plan(src, tmp_path / "out", max_shard_size="20KB", dtype="bf16")
    shardkit.run_plan(plan, task=[0, 1, 2])  # what a killed `convert --resume` left
    result = invoke_cli("convert", str(src), str(tmp_path / "out"), "--max-shard-size", "20KB", "--dtype", "bf16",
                        "--resume")
    assert result.exit_code == 0, result.stderr
    assert "wrote 3 shard task(s), 3 already done; published" in result.stdout
    assert folder_bytes(tmp_path / "out") == folder_bytes(tmp_path / "ref")


# ----------------------------------------------------------------------------- engines

def _shardkit(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "shardkit", *args], env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]


def test_a_slurm_array_of_processes_then_finalize_gives_the_single_process_bytes(planned: tuple[Path, Path, dict]) -> None:
    """What `sbatch --array=0-5 shardkit run plan.json` then a dependent `--finalize` job runs."""
    _, plan_path, ref = planned
    for ids in ((0, 1, 2, 1), (3, 4, 5)):  # three at a time; task 1 twice at once, as a requeued array task can be
        _wait([_shardkit("run", str(plan_path), env={"SLURM_ARRAY_TASK_ID": str(i)}) for i in ids])
    plan = read_plan(plan_path)
    assert all(is_done(plan, i) for i in range(6)) and not Path(plan.spec.output).exists()
    _wait([_shardkit("run", str(plan_path), "--finalize")])
    assert folder_bytes(Path(plan.spec.output)) == ref


def test_torchrun_two_ranks_run_the_same_plan_to_the_same_bytes(planned: tuple[Path, Path, dict]) -> None:
    _, plan_path, ref = planned
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "shardkit", "run", str(plan_path), "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "terminate called" not in run.stderr, run.stderr[-3000:]
    assert '"written": [\n    0,\n    2,\n    4\n  ]' in run.stdout  # rank 0's share; rank 1 prints nothing
    assert folder_bytes(plan_path.parent / "out") == ref


def test_torchrun_convert_resume_is_the_plan_run_over_ranks(tmp_path: Path) -> None:
    src = make_source(tmp_path / "src")
    shardkit.convert(src, tmp_path / "ref", max_shard_size="20KB", dtype="bf16")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "shardkit", "convert", str(src), str(tmp_path / "out"), "--max-shard-size", "20KB",
                          "--dtype", "bf16", "--resume"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "terminate called" not in run.stderr, run.stderr[-3000:]
    assert "wrote 3 shard task(s); published" in run.stdout  # rank 0 reports its share
    assert folder_bytes(tmp_path / "out") == folder_bytes(tmp_path / "ref")


def test_a_taken_output_is_refused_before_any_task_runs(tmp_path: Path) -> None:
    src = make_source(tmp_path / "src")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    with pytest.raises(shardkit.OutputExistsError, match="overwrite=True"):
        shardkit.write_plan(src, tmp_path / "out", tmp_path / "p.json", max_shard_size="20KB")
    with pytest.warns(shardkit.ShardkitWarning, match="needs overwrite=True"):
        shardkit.write_plan(src, tmp_path / "out", tmp_path / "p.json", max_shard_size="20KB", dry_run=True)
    plan = shardkit.write_plan(src, tmp_path / "out", tmp_path / "p.json", max_shard_size="20KB", overwrite=True)
    shardkit.run_plan(plan)
    assert (tmp_path / "out" / "mine.txt").read_text() == "keep"  # not a checkpoint file: left alone
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()


def test_an_in_place_reshard_as_a_plan_equals_the_one_process_in_place_reshard(tmp_path: Path) -> None:
    src = make_source(tmp_path / "ck")
    shutil.copytree(src, tmp_path / "ck2")
    shardkit.split(tmp_path / "ck2", tmp_path / "ck2", max_shard_size="20KB", overwrite=True)
    shardkit.write_plan(src, src, tmp_path / "p.json", command="split", max_shard_size="20KB", overwrite=True)
    assert shardkit.run_plan(tmp_path / "p.json").published
    assert folder_bytes(src) == folder_bytes(tmp_path / "ck2")
    assert sorted(os.listdir(tmp_path)) == ["ck", "ck2", "p.json"]


MISSING_FOLDER = "the folder the output goes into does not exist; create it first"


def test_a_missing_output_folder_is_refused_as_one_process_refuses_it(tmp_path: Path) -> None:
    """Neither writing the plan nor running it makes the folder the output goes into: the single process's
    error (ShardkitWriteError, exit 2), and nothing made: no plan file, no folder."""
    src = make_source(tmp_path / "src")
    out = tmp_path / "gone" / "deeper" / "out"
    one = assert_one_line_error(invoke_cli("split", src, out, "--max-shard-size", "20KB"), code=2,
                                contains=f"{tmp_path / 'gone' / 'deeper'}: {MISSING_FOLDER}")
    planned = assert_one_line_error(invoke_cli("split", src, out, "--max-shard-size", "20KB",
                                               "--write-plan", tmp_path / "plan.json"), code=2)
    assert planned == one
    with pytest.raises(shardkit.ShardkitWriteError, match=MISSING_FOLDER):
        shardkit.write_plan(src, out, tmp_path / "plan.json", max_shard_size="20KB")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    # the plan written, then the folder removed before it runs: refused when a task runs and at finalize, never made
    (tmp_path / "there").mkdir()
    shardkit.write_plan(src, tmp_path / "there" / "out", tmp_path / "plan.json", max_shard_size="20KB")
    (tmp_path / "there").rmdir()
    for args in (["--task", "0"], []):
        ran = assert_one_line_error(invoke_cli("run", tmp_path / "plan.json", *args), code=2)
        assert ran == one.replace(str(tmp_path / "gone" / "deeper"), str(tmp_path / "there"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json", "src"]
