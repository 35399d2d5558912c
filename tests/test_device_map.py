"""plan_device_map: accelerate's placement of real-size meta skeletons, for devices this machine lacks."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_UNET_CONFIG, tiny_unet
from helpers_load import FLUX_DEV_CONFIG, SD15_UNET_CONFIG, save_model

import shardkit
from shardkit.errors import InvalidInputError, KeyMismatchError
from shardkit.loading.device_map import group_rows
from shardkit.loading.skeleton import build_skeleton

GB = 10**9


@pytest.fixture(scope="module")
def flux() -> torch.nn.Module:
    """The 12B FLUX.1-dev transformer on the meta device (no memory for its weights)."""
    return build_skeleton("diffusers:FluxTransformer2DModel", config=FLUX_DEV_CONFIG)


def test_flux_12b_on_two_16gb_gpus_with_and_without_cpu(flux) -> None:
    for max_memory in ({0: "16GB", 1: "16GB"}, {0: "16GB", 1: "16GB", "cpu": "64GB"}):
        plan = shardkit.plan_device_map(flux, max_memory=max_memory, dtype="bf16")
        assert plan.parameters == sum(p.numel() for p in flux.parameters()) and 11.8e9 < plan.parameters < 12e9
        assert plan.total_bytes == 2 * plan.parameters + sum(b.numel() * b.element_size() for b in flux.buffers())
        assert set(plan.device_map.values()) == {0, 1}, plan.device_map
        assert plan.device_bytes[0] <= 16 * GB and plan.device_bytes[1] <= 16 * GB
        assert sum(plan.device_bytes.values()) == plan.total_bytes and plan.offloaded_bytes == 0
        assert any(k.startswith("transformer_blocks") for k in plan.device_map)


def test_flux_on_smaller_gpus_offloads_to_cpu_then_disk(flux) -> None:
    plan = shardkit.plan_device_map(flux, max_memory="0=8GB,1=8GB,cpu=64GB", dtype="bf16")
    assert plan.device_bytes.get("cpu", 0) > 0 and "disk" not in plan.device_bytes
    assert plan.offloaded_bytes == plan.device_bytes["cpu"]
    assert all(plan.device_bytes[g] <= 8 * GB for g in (0, 1))
    tight = shardkit.plan_device_map(flux, max_memory={0: "8GB", "cpu": "4GB"}, dtype="bf16", device_map="sequential")
    assert tight.device_bytes["disk"] > 0 and tight.offloaded_bytes == tight.device_bytes["cpu"] + tight.device_bytes["disk"]
    fp32 = shardkit.plan_device_map(flux, max_memory={0: "80GB"}, dtype="fp32")
    assert fp32.total_bytes > 2 * plan.total_bytes - 1e6 and set(fp32.device_map.values()) == {0}


def test_table_groups_runs_and_draws_bars(flux) -> None:
    plan = shardkit.plan_device_map(flux, max_memory={0: "16GB", 1: "16GB", "cpu": "64GB"}, dtype="bf16")
    table = plan.table()
    assert "FluxTransformer2DModel" in table and "bfloat16" in table
    assert "GPU 0" in table and "GPU 1" in table and "█" in table and "CPU" in table
    assert any(line.strip().startswith("transformer_blocks.0-") for line in table.splitlines())
    assert len(table.splitlines()) < 40, "57 blocks must collapse into a few rows"
    doc = json.loads(json.dumps(plan.to_dict()))
    assert doc["total_bytes"] == plan.total_bytes and len(doc["modules"]) == len(plan.device_map)


def test_group_rows_collapses_consecutive_numbered_siblings() -> None:
    rows = group_rows({"a": 0, "b.0": 0, "b.1": 0, "b.2": 1, "b.3": 1, "c.0": 1, "d": "cpu"},
                      {"b.0": 1, "b.1": 2, "b.2": 3, "b.3": 4})
    assert rows == [("a", 0, 0), ("b.0-1", 0, 3), ("b.2-3", 1, 7), ("c.0", 1, 0), ("d", "cpu", 0)]


def test_sd15_unet_real_size_plan() -> None:
    plan = shardkit.plan_device_map("diffusers:UNet2DConditionModel", config=SD15_UNET_CONFIG,
                                    max_memory={0: "1GB", "cpu": "8GB"}, dtype="fp16")
    assert 850e6 < plan.parameters < 870e6  # the SD 1.5 UNet has 859.5M parameters
    assert plan.device_bytes[0] <= 1 * GB and plan.device_bytes["cpu"] > 0


def test_checkpoint_gives_dtypes_and_its_keys_are_checked(tmp_path) -> None:
    eager = tiny_unet()
    folder = save_model(eager, tmp_path / "half", dtype="fp16")
    plan = shardkit.plan_device_map("diffusers:UNet2DConditionModel", checkpoint=folder, config=folder,
                                    max_memory={0: "1GB", 1: "1GB"})
    with shardkit.open(folder) as ckpt:
        assert plan.total_bytes == ckpt.nbytes()
    assert plan.dtype == "float16" and plan.checkpoint and "half" in plan.checkpoint
    state = dict(eager.state_dict())
    state.pop("conv_out.weight")
    shardkit.save_sharded(state, tmp_path / "bad")
    with pytest.raises(KeyMismatchError, match="conv_out.weight"):
        shardkit.plan_device_map("diffusers:UNet2DConditionModel", checkpoint=tmp_path / "bad",
                                 config=TINY_UNET_CONFIG, max_memory={0: "1GB"})


def test_planning_needs_a_budget_and_a_strategy(flux) -> None:
    with pytest.raises(InvalidInputError, match="max_memory"):
        shardkit.plan_device_map(flux, max_memory=None)
    with pytest.raises(InvalidInputError, match="unknown device_map"):
        shardkit.plan_device_map(flux, max_memory={0: "1GB"}, device_map="wherever")
