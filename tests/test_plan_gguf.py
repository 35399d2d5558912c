"""``convert --to gguf`` as a plan: one task per GGUF file (the one file, or each gguf-split part).

Tasks run in any order then finalize, or a ``--resume`` killed (SIGKILL) at fault points and run again (at most
one file's bytes written twice, counted from the fault traces), give the bytes of a single-process
``convert(..., to='gguf')``; a changed source is refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_one_line_error, invoke_cli
from helpers_gguf import tiny_llama_folder

import shardkit
from shardkit.api.plans import read_plan, run_plan, write_plan
from shardkit.distributed.plan_file import VERSION, dump_plan
from shardkit.sharding.options import Quantize

PARTS = [f"m-{i:05d}-of-00003.gguf" for i in range(1, 4)]  # the tiny Llama, q8_0, 40KB parts (no vocabulary)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_folder(tmp_path_factory.mktemp("src") / "llama")


@pytest.mark.parametrize(("quantize", "max_shard_size"), [("q8_0", "40KB"), ("f16", "5GB"), ("q8_0", "5GB"),
                                                          ("f16", "60KB")])  # 5GB: the default, one file
def test_tasks_in_any_order_then_finalize_equal_one_process(tmp_path: Path, llama: Path, quantize: Quantize,
                                                             max_shard_size: str) -> None:
    (tmp_path / "ref").mkdir()
    (tmp_path / "out").mkdir()
    with pytest.warns(UserWarning):  # no tokenizer.json: no vocabulary, as a single process says
        shardkit.convert(llama, tmp_path / "ref" / "m.gguf", to="gguf", quantize=quantize, max_shard_size=max_shard_size)
    reference = _files(tmp_path / "ref")
    plan = write_plan(llama, tmp_path / "out" / "m.gguf", tmp_path / "plan.json", to="gguf", quantize=quantize,
                      max_shard_size=max_shard_size)
    assert [t.output for t in plan.tasks] == list(reference)
    assert (tmp_path / "plan.json").read_bytes() == dump_plan(plan) == dump_plan(
        write_plan(llama, tmp_path / "out" / "m.gguf", to="gguf", quantize=quantize, max_shard_size=max_shard_size))  # deterministic
    doc = json.loads((tmp_path / "plan.json").read_bytes())
    assert doc["version"] == VERSION + 1 and doc["to"] == "gguf"
    assert [t.size_bytes for t in plan.tasks] == [len(b) for b in reference.values()]
    for i in reversed(range(len(plan.tasks))):
        assert run_plan(tmp_path / "plan.json", task=i).written == [i]
        assert not list((tmp_path / "out").glob("*.gguf"))  # nothing published before finalize (work: .m.gguf.*)
    assert run_plan(tmp_path / "plan.json", task=0).skipped == [0]
    assert run_plan(tmp_path / "plan.json", finalize=True).published
    assert _files(tmp_path / "out") == reference
    assert [n for n in os.listdir(tmp_path / "out") if n.startswith(".")] == []  # the work folder removed


def test_split_plan_has_one_task_per_part_with_its_header_crc(tmp_path: Path, llama: Path) -> None:
    plan = write_plan(llama, tmp_path / "m.gguf", to="gguf", quantize="q8_0", max_shard_size="40KB")
    assert [t.output for t in plan.tasks] == PARTS
    assert all(t.header_crc32 is not None and t.reads for t in plan.tasks)
    (tmp_path / "plan.json").write_bytes(dump_plan(plan))
    assert read_plan(tmp_path / "plan.json") == plan  # read back: the same plan, to='gguf' and header crcs kept


def test_a_safetensors_plan_keeps_its_bytes(tmp_path: Path, llama: Path) -> None:
    plan = write_plan(llama, tmp_path / "out", dtype="bf16")
    data = dump_plan(plan)
    assert json.loads(data)["version"] == VERSION and b'"to"' not in data and b"header_crc32" not in data


def test_a_changed_source_is_refused_in_one_line(tmp_path: Path) -> None:
    src = tiny_llama_folder(tmp_path / "llama")
    write_plan(src, tmp_path / "m.gguf", tmp_path / "plan.json", to="gguf", quantize="q8_0")
    weights = src / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    result = invoke_cli("run", str(tmp_path / "plan.json"), "--task", "0")
    assert_one_line_error(result, code=2, contains="the source changed since the plan was written (modified)")
    (src / "config.json").write_text((src / "config.json").read_text().replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": 1e-06'))
    with pytest.raises(shardkit.InvalidInputError, match="config.json: the source changed"):
        run_plan(tmp_path / "plan.json", finalize=False, task=0)
    assert not (tmp_path / "m.gguf").exists()
    assert not list(tmp_path.glob(".m.gguf.*/*.gguf"))


def _cli(src: Path, out: Path, trace: Path, **env: str) -> subprocess.CompletedProcess[str]:
    args = ["--to", "gguf", "--quantize", "q8_0", "--max-shard-size", "40KB", "--resume", "-q"]
    return subprocess.run([sys.executable, "-m", "shardkit", "convert", str(src), str(out), *args],
                          env={**os.environ, "SHARDKIT_FAULT_TRACE": str(trace), **env}, capture_output=True,
                          text=True, timeout=300)


def _labels(trace: Path) -> list[str]:
    return [line.split()[1] for line in trace.read_text().splitlines()] if trace.exists() else []


def _written(trace: Path) -> int:
    """The bytes the run wrote by the last fault point it passed."""
    return int(trace.read_text().splitlines()[-1].split()[2]) if trace.exists() else 0


def _kill_then_rerun(tmp_path: Path, llama: Path, count: int) -> list[str]:
    (tmp_path / "ref").mkdir()
    ref = _cli(llama, tmp_path / "ref" / "m.gguf", tmp_path / "ref.trace")
    assert ref.returncode == 0, ref.stderr
    reference = _files(tmp_path / "ref")
    assert list(reference) == PARTS
    assert _files(tmp_path / "ref") == _files(_one_process(tmp_path, llama))
    labels, ref_bytes = _labels(tmp_path / "ref.trace"), _written(tmp_path / "ref.trace")
    assert ref_bytes == sum(len(b) for b in reference.values())  # every file written once; publishing writes none
    special = [labels.index("plan:shard-renamed") + 1, len(labels) - labels[::-1].index("commit:before-file-rename"),
               labels.index("commit:after-file-rename") + 1, labels.index("plan:published") + 1]
    spread = [1 + round(i * (len(labels) - 1) / (count - 1)) for i in range(count)]
    killed_at = []
    for k in sorted(set(spread[:count - len(special)] + special)):
        out = tmp_path / f"out{k}"
        out.mkdir()
        killed = _cli(llama, out / "m.gguf", tmp_path / f"kill{k}.trace", SHARDKIT_FAULT_KILL_AT=str(k))
        assert killed.returncode == -9, f"point {k}: {killed.returncode} {killed.stderr[-2000:]}"
        rerun = _cli(llama, out / "m.gguf", tmp_path / f"rerun{k}.trace")
        assert rerun.returncode == 0, f"point {k}: {rerun.stderr[-2000:]}"
        assert _files(out) == reference, f"point {k} ({labels[k - 1]}): output differs"
        assert not [n for n in os.listdir(out) if n.startswith(".")], f"point {k}: leftovers"
        twice = _written(tmp_path / f"kill{k}.trace") + _written(tmp_path / f"rerun{k}.trace") - ref_bytes
        assert 0 <= twice <= max(len(b) for b in reference.values()), f"point {k}: {twice} bytes written twice"
        killed_at.append(labels[k - 1])
    return killed_at


def _one_process(tmp_path: Path, llama: Path) -> Path:
    (tmp_path / "one").mkdir()
    with pytest.warns(UserWarning):
        shardkit.convert(llama, tmp_path / "one" / "m.gguf", to="gguf", quantize="q8_0", max_shard_size="40KB")
    return tmp_path / "one"


def test_resume_killed_at_points_ends_identical(tmp_path: Path, llama: Path) -> None:
    killed_at = _kill_then_rerun(tmp_path, llama, 4)
    assert {"plan:shard-renamed", "commit:before-file-rename", "commit:after-file-rename", "plan:published"} <= set(
        killed_at)


@pytest.mark.slow
def test_resume_killed_at_ten_points_ends_identical(tmp_path: Path, llama: Path) -> None:
    killed_at = _kill_then_rerun(tmp_path, llama, 10)
    assert "write" in killed_at


def test_recover_removes_an_abandoned_gguf_plan(tmp_path: Path, llama: Path) -> None:
    plan = write_plan(llama, tmp_path / "m.gguf", tmp_path / "plan.json", to="gguf", quantize="q8_0",
                      max_shard_size="40KB")
    run_plan(tmp_path / "plan.json", task=1)
    assert [p.name for p in tmp_path.glob(".m.gguf.shardkit-plan-*/*.gguf")] == [plan.tasks[1].output]
    report = shardkit.recover(tmp_path / "m.gguf")  # the output's path, as for a single-file write
    assert [Path(p).name for p in report.removed] == [f".m.gguf.shardkit-plan-{plan.plan_id}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_a_missing_output_folder_is_refused_as_one_process_refuses_it(tmp_path: Path, llama: Path) -> None:
    """Neither writing the plan nor running it makes the output's folder: the single process's error, exit 2."""
    one = assert_one_line_error(invoke_cli("convert", llama, tmp_path / "gone" / "m.gguf", "--to", "gguf"), code=2,
                                contains="the folder the output goes into does not exist; create it first")
    planned = assert_one_line_error(invoke_cli("convert", llama, tmp_path / "gone" / "m.gguf", "--to", "gguf",
                                               "--write-plan", tmp_path / "plan.json"), code=2)
    assert planned == one
    assert not (tmp_path / "gone").exists() and not (tmp_path / "plan.json").exists()
    (tmp_path / "out").mkdir()
    with pytest.warns(UserWarning):  # no vocabulary
        write_plan(llama, tmp_path / "out" / "m.gguf", tmp_path / "plan.json", to="gguf")
    (tmp_path / "out").rmdir()  # removed before the plan runs
    ran = assert_one_line_error(invoke_cli("run", tmp_path / "plan.json"), code=2)
    assert ran == one.replace("gone", "out") and not (tmp_path / "out").exists()
