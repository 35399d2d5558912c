"""The plan file (shardkit/distributed/plan_file.py): deterministic, readable, checked when read back."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_one_line_error, invoke_cli
from safetensors.torch import save_file

import shardkit
from shardkit.api.plans import plan_summary, read_plan
from shardkit.distributed.plan_file import dump_plan, parse_plan


def make_source(folder: Path, *, tensors: int = 12, seed: int = 0) -> Path:
    """A folder of float32 tensors (16 KB each) and a config: 6 shards of 2 tensors at 20KB in bf16."""
    torch.manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({f"layers.{i:02d}.weight": torch.randn(64, 64) for i in range(tensors)},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text('{"model_type": "toy"}\n')
    return folder


def test_the_same_inputs_give_the_same_plan_bytes_and_the_plan_describes_every_shard(tmp_path: Path) -> None:
    src = make_source(tmp_path / "src")
    one = shardkit.write_plan(src, tmp_path / "out", tmp_path / "a.json", max_shard_size="20KB", dtype="bf16")
    shardkit.write_plan(src, tmp_path / "out", tmp_path / "b.json", max_shard_size="20KB", dtype="bf16")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    doc = json.loads((tmp_path / "a.json").read_text())
    assert doc["format"] == "shardkit.plan" and doc["version"] == 1
    assert doc["options"]["dtype"] == "bf16" and doc["options"]["max_shard_bytes"] == 20_000
    assert [t["output"] for t in doc["tasks"]] == [f"model-0000{i}-of-00006.safetensors" for i in range(1, 7)]
    assert all(t["casts"] == {"F32->BF16": 2} and len(t["reads"]) == 1 for t in doc["tasks"])
    assert doc["finalize"] == {"index": "model.safetensors.index.json", "side_files": ["config.json"],
                               "total_bytes": 12 * 64 * 64 * 2}
    assert [s[0] for s in doc["source_files"]] == [str(src / "config.json"), str(src / "model.safetensors")]
    # the expected sizes are the single-process convert's file sizes, byte for byte
    shardkit.convert(src, tmp_path / "ref", max_shard_size="20KB", dtype="bf16")
    assert [t.size_bytes for t in one.tasks] == [(tmp_path / "ref" / t.output).stat().st_size for t in one.tasks]
    assert parse_plan(dump_plan(one), path="a.json") == one  # round trip


def test_other_options_give_another_plan(tmp_path: Path) -> None:
    src = make_source(tmp_path / "src")
    a = shardkit.write_plan(src, tmp_path / "out", max_shard_size="20KB", dtype="bf16")
    b = shardkit.write_plan(src, tmp_path / "out", max_shard_size="20KB", dtype="fp16")
    c = shardkit.write_plan(src, tmp_path / "out", max_shard_size="20KB", dtype="bf16", strip_prefix="layers.")
    assert len({a.plan_id, b.plan_id, c.plan_id}) == 3
    assert c.spec.keymap.strip_prefix == "layers."


def _plan_doc(tmp_path: Path) -> dict[str, Any]:
    src = make_source(tmp_path / "src", tensors=4)
    shardkit.write_plan(src, tmp_path / "out", tmp_path / "p.json", max_shard_size="20KB")
    doc: dict[str, Any] = json.loads((tmp_path / "p.json").read_text())
    return doc


@pytest.mark.parametrize(("edit", "words"), [
    (lambda d: d["tasks"][0].update(output="../escape.safetensors"), "leaves the output folder"),
    (lambda d: d["tasks"][0].update(output="/etc/x.safetensors"), "leaves the output folder"),
    (lambda d: d["finalize"].update(side_files=["../../.bashrc"]), "leaves the output folder"),
    (lambda d: d["tasks"][1].update(output=d["tasks"][0]["output"]), "same output name"),
    (lambda d: d["tasks"][0].update(size_bytes=-1), "malformed"),
    (lambda d: d.update(version=2), "version 2"),
    (lambda d: d.update(format="other"), "not a shardkit.plan"),
    (lambda d: d["options"].update(max_shard_bytes=0), "options"),
    (lambda d: d["options"].update(evil=1), "options must name exactly"),
    (lambda d: d.update(tasks=[]), "1 to 100000 tasks"),
    (lambda d: d["tasks"].reverse(), "out of order"),
])
def test_an_untrusted_plan_is_refused_in_one_line(tmp_path: Path, edit: Any, words: str) -> None:
    doc = _plan_doc(tmp_path)
    edit(doc)
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    with pytest.raises(shardkit.InvalidInputError, match=words):
        read_plan(tmp_path / "bad.json")
    result = invoke_cli("run", str(tmp_path / "bad.json"))
    assert_one_line_error(result, code=2)
    assert not (tmp_path / "out").exists()


def test_a_plan_file_larger_than_the_bound_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    with big.open("wb") as f:
        f.truncate(300 * 2**20)  # sparse: no disk
    with pytest.raises(shardkit.ShardkitError, match="larger than|at most|bytes"):
        read_plan(big)


def test_dry_run_prints_the_summary_and_writes_nothing(tmp_path: Path) -> None:
    src = make_source(tmp_path / "src")
    result = invoke_cli("convert", str(src), str(tmp_path / "out"), "--max-shard-size", "20KB", "--dtype", "bf16",
                        "--write-plan", str(tmp_path / "p.json"), "--dry-run")
    assert result.exit_code == 0, result.stderr
    assert "6 shard task(s), 98.30 KB of tensors" in result.stdout
    assert "task 5: model-00006-of-00006.safetensors" in result.stdout
    assert "finalize: model.safetensors.index.json, manifest, 1 side file(s)" in result.stdout
    assert not (tmp_path / "p.json").exists() and not (tmp_path / "out").exists()


def test_cli_write_plan_equals_python_write_plan(tmp_path: Path) -> None:
    src = make_source(tmp_path / "src")
    result = invoke_cli("split", str(src), str(tmp_path / "out"), "--max-shard-size", "20KB", "--write-plan",
                        str(tmp_path / "cli.json"))
    assert result.exit_code == 0, result.stderr
    assert "run: shardkit run" in result.stdout
    shardkit.write_plan(src, tmp_path / "out", tmp_path / "py.json", command="split", max_shard_size="20KB")
    assert (tmp_path / "cli.json").read_bytes() == (tmp_path / "py.json").read_bytes()
    assert plan_summary(tmp_path / "cli.json")[0].startswith("plan ")


def test_a_plan_refuses_what_runs_in_one_process(tmp_path: Path) -> None:
    src = make_source(tmp_path / "src")
    with pytest.raises(shardkit.InvalidInputError, match=r"a local path or s3://BUCKET/PREFIX"):
        shardkit.write_plan(src, "hf://org/out", tmp_path / "p.json")
    with pytest.raises(shardkit.InvalidInputError, match=r"a local path or s3://BUCKET/PREFIX"):
        shardkit.write_plan("hf://org/model", tmp_path / "o", tmp_path / "p.json")
    with pytest.raises(shardkit.InvalidInputError, match="single .safetensors output"):
        shardkit.write_plan(src, tmp_path / "one.safetensors", tmp_path / "p.json")
    result = invoke_cli("convert", str(src), str(tmp_path / "o"), "--to", "gguf", "--write-plan", str(tmp_path / "p.json"))
    assert_one_line_error(result, code=2)


def test_a_dequantized_fp8_tensor_is_counted_as_computed_and_runs_to_the_convert_bytes(tmp_path: Path) -> None:
    from helpers_quant import save_finegrained, save_llama

    state = save_llama(tmp_path / "llama")
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    save_finegrained(tmp_path / "fp8", state, config=config)
    plan = shardkit.write_plan(tmp_path / "fp8", tmp_path / "out", max_shard_size="100KB", dtype="bf16")
    casts = {k: v for t in plan.tasks for k, v in t.casts}
    assert "computed->BF16" in casts and all(r[0] for t in plan.tasks for r in t.reads)
    assert any(s.path.endswith(".safetensors") for s in plan.sources)
    shardkit.run_plan(plan)
    shardkit.convert(tmp_path / "fp8", tmp_path / "ref", max_shard_size="100KB", dtype="bf16")
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == \
        {p.name: p.read_bytes() for p in (tmp_path / "ref").iterdir()}


def test_a_plan_file_write_that_writes_nothing_is_an_error_naming_the_plan(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from test_plan_work import writes_nothing_under

    src = make_source(tmp_path / "src", tensors=2)
    (tmp_path / "plans").mkdir()
    writes_nothing_under(tmp_path / "plans", monkeypatch)
    with pytest.raises(shardkit.ShardkitWriteError, match=r"plan\.json"):
        shardkit.write_plan(src, tmp_path / "out", tmp_path / "plans" / "plan.json", max_shard_size="20KB")
    assert os.listdir(tmp_path / "plans") == []  # neither the plan nor its temporary
