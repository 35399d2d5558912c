"""One memory model: ``plan --strategies``, ``estimate_memory`` and ``fit`` give one peak per strategy.

Real-size meta skeletons (FLUX.1-dev transformer, SDXL UNet): no weights, no GPU.
"""

from __future__ import annotations

import json

import pytest
from helpers_fit import SDXL_UNET_CONFIG
from helpers_load import FLUX_DEV_CONFIG, write_config

import shardkit
from shardkit.fitting.peaks import STRATEGIES
from shardkit.loading.skeleton import build_skeleton

GB = 10**9
MODELS = {
    "flux": ("diffusers:FluxTransformer2DModel", FLUX_DEV_CONFIG, (11.8e9, 12.0e9)),
    "sdxl": ("diffusers:UNet2DConditionModel", SDXL_UNET_CONFIG, (2.5e9, 2.7e9)),
}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_plan_estimate_and_fit_give_the_same_peak(model, run_cli, tmp_path) -> None:
    spec, config, (low, high) = MODELS[model]
    result = run_cli("plan", "--model", spec, "--config", write_config(tmp_path, config), "--dtype", "bf16",
                     "--strategies", "--json")
    assert result.exit_code == 0, result.stderr
    cli = {row["strategy"]: row["peak_bytes"] for row in json.loads(result.stdout)["strategies"]["strategies"]}

    skeleton = build_skeleton(spec, config=config)
    params = sum(p.numel() for p in skeleton.parameters())
    assert low < params < high  # really the full-size model
    report = shardkit.estimate_memory(skeleton, dtype="bf16")
    api = {row.spec.name: row.peak_bytes for row in report.rows}

    # A budget everything fits, so each single-GPU candidate is the strategy without switches.
    plan = shardkit.fit(skeleton, gpu="100TB", dtype="bf16")
    single = [c for c in plan.candidates if c.strategy.min_gpus == 1]
    assert all(c.fits and not c.switches for c in single)
    fitted = {c.name: max(c.peaks.gpu) for c in single}

    names = {s.name + suffix for s in STRATEGIES if s.min_gpus == 1 for suffix in ("", "+fp8")}
    assert set(cli) == set(api) == set(fitted) == names
    for name in sorted(names):
        assert cli[name] == api[name] == fitted[name], name
    # The peaks are the model's, not placeholders: bf16 weights, and offloading and fp8 lower them.
    assert report.row("gpu").param_bytes == params * 2 == plan.components[0].weight_bytes
    assert cli["sequential"] < cli["group_block_1"] < cli["group_block_4"] < cli["model_offload"]
    assert cli["gpu+fp8"] < cli["gpu"] and cli["group_block_1+fp8"] < cli["group_block_1"]
    assert 0 < report.row("gpu").activation_bytes < GB


def test_block_stream_prices_the_prefetch_across_block_lists():
    # Measured on an H200 (docs/benchmarks.md, "GPU"): the SDXL UNet, bf16, 1024x1024, group offload by block
    # with a stream peaked at 5.01 GB (fp8: 2.63 GB): down_blocks.2 and up_blocks.0 were resident together,
    # since the stream prefetches the next block in execution order, across lists. The estimate must not be below.
    skeleton = build_skeleton("diffusers:UNet2DConditionModel", config=SDXL_UNET_CONFIG)
    report = shardkit.estimate_memory(skeleton, dtype="bf16", compute_dtype="bf16", tokens=(1024 // 8) ** 2 // 4)
    assert report.row("group_block_stream").peak_bytes >= 5_006_888_960
    assert report.row("group_block_stream+fp8").peak_bytes >= 2_627_113_472
    sizes = {name: sum(p.numel() * 2 for p in module.parameters()) for name, module in skeleton.named_children()}
    blocks = {f"{name}.{i}": sum(p.numel() * 2 for p in block.parameters())
              for name in ("down_blocks", "up_blocks") for i, block in enumerate(getattr(skeleton, name))}
    rest = sum(size for name, size in sizes.items() if name not in ("down_blocks", "up_blocks"))
    assert report.row("group_block_stream").param_bytes == rest + blocks["down_blocks.2"] + blocks["up_blocks.0"]
