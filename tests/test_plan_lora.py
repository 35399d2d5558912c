"""A LoRA merge as a plan (`convert --lora ... --write-plan`): the adapters travel in the plan (their files part of
the source's identity), every task merges its shard's weights, and the output equals `convert --lora`'s bytes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import assert_one_line_error, invoke_cli
from helpers_lora import LLAMA, llama_class, save_adapter, save_base
from test_plan_run import folder_bytes

import shardkit
from shardkit.api.plans import read_plan

pytest.importorskip("peft")

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("plan-lora")
    base = save_base(root / "base", llama_class(), LLAMA)
    return {"root": root, "base": base, "adapter": save_adapter(base, root / "adapter", llama_class(), **LORA)}


def test_a_lora_merge_as_a_plan_equals_convert_with_the_adapter(llama: dict[str, Path], tmp_path: Path) -> None:
    shardkit.convert(llama["base"], tmp_path / "ref", lora=llama["adapter"], dtype="bf16", max_shard_size="10KB")
    result = invoke_cli("convert", str(llama["base"]), str(tmp_path / "out"), "--lora", str(llama["adapter"]),
                        "--dtype", "bf16", "--max-shard-size", "10KB", "--write-plan", str(tmp_path / "plan.json"))
    assert result.exit_code == 0, result.stderr
    plan = read_plan(tmp_path / "plan.json")
    assert plan.spec.lora == (str(llama["adapter"]),) and len(plan.tasks) > 2
    assert json.loads((tmp_path / "plan.json").read_text())["lora"]["adapters"] == [str(llama["adapter"])]
    assert {f"{llama['adapter']}/adapter_model.safetensors", f"{llama['adapter']}/adapter_config.json"} <= \
        {s.path for s in plan.sources}
    for i in reversed(range(len(plan.tasks))):  # any order, each a separate call
        shardkit.run_plan(tmp_path / "plan.json", task=i)
    assert shardkit.run_plan(tmp_path / "plan.json", finalize=True).published
    assert folder_bytes(tmp_path / "out") == folder_bytes(tmp_path / "ref")


def test_a_changed_adapter_is_refused_and_a_remote_one_is_not_planned(llama: dict[str, Path], tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    for f in llama["adapter"].iterdir():
        (adapter / f.name).write_bytes(f.read_bytes())
    shardkit.write_plan(llama["base"], tmp_path / "out", tmp_path / "plan.json", lora=adapter, dtype="bf16")
    stat = os.stat(adapter / "adapter_config.json")
    os.utime(adapter / "adapter_config.json", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    result = invoke_cli("run", str(tmp_path / "plan.json"), "--task", "0")
    assert_one_line_error(result, code=2, contains="adapter_config.json: the source changed since the plan was written")
    with pytest.raises(shardkit.InvalidInputError, match="a plan merges local adapters"):
        shardkit.write_plan(llama["base"], tmp_path / "o2", lora="s3://bucket/adapter")
    with pytest.raises(shardkit.InvalidInputError, match="merges in a convert"):
        shardkit.write_plan(llama["base"], tmp_path / "o3", command="split", lora=adapter)
