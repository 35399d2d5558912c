"""Per-strategy peak memory estimates: the pure model with fake sizes, and real-size meta skeletons."""

from __future__ import annotations

import json

import pytest
import torch
from accelerate import init_empty_weights
from helpers_offload import PlainNet, plain_net, tiny_flux_transformer

import shardkit
from shardkit.errors import InvalidInputError
from shardkit.fitting.estimate import ComponentSizes, Footprint, strategy_peaks, strategy_specs
from shardkit.fitting.weights import cast_layers_of, measure, module_tensors

GB = 10**9


def _fake(name: str = "denoiser") -> ComponentSizes:
    # 4 blocks of 10/20/30/40 (fp8: half), 5 of embeddings/heads, leaves of 7 and 9, 1 in non-leaf modules.
    blocks = tuple(Footprint(b, b // 2) for b in (10, 20, 30, 40))
    return ComponentSizes(name, total=Footprint(105, 55), rest=Footprint(5, 5), block_lists=(blocks,),
                          leaves=(Footprint(7, 4), Footprint(9, 9)), nonleaf=Footprint(1, 1),
                          upcast_bytes=6, upcast_fp8_bytes=3)


def _peaks(components, **kw) -> dict[str, int]:
    return {e.spec.name: e.param_bytes for e in strategy_peaks(components, **kw)}


def test_pure_peaks_follow_the_hook_semantics():
    p = _peaks([_fake()])
    assert p["gpu"] == p["model_offload"] == 105
    assert p["group_block_1"] == 5 + 40                 # rest + largest block
    assert p["group_block_2"] == 5 + 70                 # rest + blocks 3,4
    assert p["group_block_4"] == 5 + 100
    assert p["group_block_stream"] == 5 + 70            # current + prefetched block
    assert p["group_leaf"] == p["sequential"] == 9 + 1  # largest leaf + non-leaf tensors
    assert p["group_leaf_stream"] == 16 + 1
    # fp8: stored bytes of cast layers + the running layer's upcast copy
    assert p["gpu+fp8"] == 55 + 6
    assert p["group_block_1+fp8"] == 5 + 20 + 6
    assert p["group_leaf+fp8"] == max(9, 6 + 3) + 1


def test_pipeline_rows_sum_for_gpu_and_take_the_largest_component_otherwise():
    small = ComponentSizes("vae", Footprint(50, 50), leaves=(Footprint(50, 50),))
    p = _peaks([_fake(), small])
    assert p["gpu"] == 155 and p["model_offload"] == 105 and p["group_leaf"] == 50
    # Per-component activations: the peak is the component whose weights + activations are largest.
    p = {e.spec.name: e.peak_bytes for e in strategy_peaks([_fake(), small], activation_bytes=[0, 60])}
    assert p["gpu"] == 155 + 60 and p["model_offload"] == 50 + 60 and p["group_block_1"] == 50 + 60


def test_fits_and_activation_allowance():
    rows = strategy_peaks([_fake()], activation_bytes=20, gpu_bytes=70)
    fits = {e.spec.name: e.fits for e in rows}
    assert fits["group_block_1"] and not fits["group_block_2"] and not fits["gpu"]
    assert all(e.peak_bytes == e.param_bytes + 20 and e.activation_bytes == 20 for e in rows)


def test_specs_are_directly_applicable_and_ranked(tmp_path):
    specs = strategy_specs()
    assert len(specs) == 18 and [s.speed_rank for s in specs] == list(range(18))
    slowdowns = [s.strategy.slowdown_with(s.fp8) for s in specs]
    assert slowdowns == sorted(slowdowns) and specs[0].name == "gpu" and specs[-1].name == "group_leaf+fp8"
    model = plain_net()
    ids = torch.tensor([[1, 2, 3]])
    ref = model(ids).detach()
    for spec in specs:
        if spec.fp8 or spec.options.get("use_stream") or spec.offload == "none":
            continue
        shardkit.apply_offload(model, spec.offload, device="cpu", **spec.options)
        torch.testing.assert_close(model(ids).detach(), ref)
    shardkit.apply_offload(model, "none")


def test_measure_matches_the_module():
    model = PlainNet(width=16, depth=4)
    sizes = measure(module_tensors(model), cast_layers=cast_layers_of(model))
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    block_bytes = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    assert sizes.total.plain_bytes == param_bytes
    assert sizes.block_lists == ((Footprint(block_bytes, block_bytes // 4),) * 4,)   # Linear weights+bias → fp8
    assert sizes.rest.plain_bytes == param_bytes - 4 * block_bytes
    assert max(leaf.plain_bytes for leaf in sizes.leaves) == (16 * 64 + 64) * 4
    # embedding and norm are skipped by casting: stored as they are
    assert sizes.rest.fp8_bytes == sizes.rest.plain_bytes - (16 * 3 + 3) * 3


def test_estimate_on_a_meta_skeleton_equals_the_materialised_model():
    with init_empty_weights():
        skeleton = tiny_flux_transformer()
    real = tiny_flux_transformer()
    a = shardkit.estimate_memory(skeleton, dtype="bf16").to_dict()
    b = shardkit.estimate_memory(real.to(torch.bfloat16)).to_dict()
    assert a["strategies"] == b["strategies"]
    assert a["components"]["model"]["bytes"] == sum(p.numel() * 2 for p in real.parameters())


def test_checkpoint_headers_give_the_dtypes(tmp_path):
    real = tiny_flux_transformer().to(torch.float16)
    real.save_pretrained(tmp_path / "transformer")
    with init_empty_weights():
        skeleton = tiny_flux_transformer()                 # fp32 skeleton
    from_headers = shardkit.estimate_memory(skeleton, checkpoint=tmp_path / "transformer")
    assert from_headers.components[0].total.plain_bytes == sum(p.numel() * 2 for p in real.parameters())
    assert "checkpoint headers" in " ".join(from_headers.notes)
    pipeline = shardkit.estimate_memory({"transformer": skeleton}, checkpoint=tmp_path)
    assert pipeline.row("gpu").param_bytes == from_headers.row("gpu").param_bytes


def test_fp8_rows_price_what_casting_actually_saves():
    model = tiny_flux_transformer(torch.bfloat16)
    estimate = shardkit.estimate_memory(model)
    report = shardkit.apply_layerwise_casting(model, "float8_e4m3fn", "bfloat16")
    sizes = estimate.components[0]
    assert sizes.total.plain_bytes - sizes.total.fp8_bytes == report.saved_bytes


def test_real_size_flux_skeleton_on_16gb():
    from diffusers import FluxTransformer2DModel

    with init_empty_weights():
        flux = FluxTransformer2DModel(guidance_embeds=True)     # the FLUX.1-dev sizes are the defaults
    report = shardkit.estimate_memory(flux, gpu_bytes="16GB", dtype="bf16")
    params = sum(p.numel() for p in flux.parameters())
    assert 11.8e9 < params < 12.0e9
    assert report.row("gpu").param_bytes == params * 2
    assert not report.row("gpu").fits and not report.row("model_offload").fits
    assert report.row("group_block_1").fits and report.row("sequential").peak_bytes < 2 * GB
    assert report.row("gpu+fp8").peak_bytes < report.row("gpu").peak_bytes
    assert report.fitting()[0].spec.name == "gpu+fp8"
    doc = json.loads(json.dumps(report.to_dict()))
    assert doc["gpu_bytes"] == 16 * GB and len(doc["strategies"]) == 18
    table = report.table()
    assert "group_block_stream" in table and "GPU budget: 16.00 GB" in table


def test_pipeline_mapping_casts_only_the_denoiser():
    with init_empty_weights():
        components = {"transformer": tiny_flux_transformer(), "vae_like": PlainNet()}
    report = shardkit.estimate_memory(components, dtype="fp16")
    sizes = {c.name: c for c in report.components}
    assert sizes["vae_like"].total.fp8_bytes == sizes["vae_like"].total.plain_bytes
    assert sizes["transformer"].total.fp8_bytes < sizes["transformer"].total.plain_bytes


def test_bad_inputs():
    with pytest.raises(InvalidInputError, match="needs an nn.Module"):
        shardkit.estimate_memory("model")
    with pytest.raises(InvalidInputError):
        shardkit.estimate_memory(plain_net(), gpu_bytes="16XB")
    with pytest.raises(InvalidInputError, match="no components"):
        strategy_peaks([])
