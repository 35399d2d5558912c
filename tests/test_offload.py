"""Offload strategies (shardkit.apply_offload) on CPU with device="cpu", and on CUDA when present."""

from __future__ import annotations

import pytest
import torch
from helpers_compare import assert_outputs_close
from helpers_offload import flux_inputs, plain_net, run_flux, staged_script, tiny_flux_transformer

import shardkit
from shardkit.errors import InvalidInputError, ShardkitError
from shardkit.runtime.offload import OffloadError, installed_hooks

STRATEGIES = [
    ("model", {}),
    ("sequential", {}),
    ("group", {"offload_type": "block_level", "num_blocks_per_group": 1}),
    ("group", {"offload_type": "block_level", "num_blocks_per_group": 2}),
    ("group", {"offload_type": "leaf_level"}),
    ("group", {"num_blocks_per_group": 1, "low_cpu_mem_usage": True}),
    # T5 ties its input embeddings, which diffusers' disk group offload cannot write: keep it resident.
    ("group", {"offload_to_disk_path": "DISK", "exclude_modules": ["text_encoder_2"]}),
    ("disk", {"offload_dir": "DISK"}),
]
IDS = ["model", "sequential", "block1", "block2", "leaf", "low-cpu", "group-disk", "disk"]
# The whole pipeline is slow on CPU: the default run covers one row per hook kind, --runslow all.
_FAST_PIPELINE = {"model", "sequential", "block2", "group-disk"}
PIPELINE_CASES = [pytest.param(*case, id=i, marks=() if i in _FAST_PIPELINE else pytest.mark.slow)
                  for case, i in zip(STRATEGIES, IDS, strict=True)]


def _options(options: dict, tmp_path) -> dict:
    return {k: (str(tmp_path / "offload") if v == "DISK" else v) for k, v in options.items()}


@pytest.fixture(scope="module")
def pipe():
    return staged_script().build_tiny_flux_pipeline()


@pytest.fixture(scope="module")
def pipe_reference(pipe):
    return staged_script().generate(pipe, size=32, steps=2, output_type="pt").images


@pytest.mark.parametrize(("strategy", "options"), PIPELINE_CASES)
def test_pipeline_strategy_output_equals_plain_and_hooks_are_removable(pipe, pipe_reference, strategy, options, tmp_path):
    script = staged_script()
    shardkit.apply_offload(pipe, strategy, device="cpu", **_options(options, tmp_path))
    try:
        assert installed_hooks(pipe), "no hook installed"
        assert pipe.shardkit_offload[0] == strategy
        out = script.generate(pipe, size=32, steps=2, output_type="pt").images
        # fp32 on CPU; moved or disk-round-tripped weights may sum in another order: within fp32 tolerance.
        assert_outputs_close(out, pipe_reference)
    finally:
        shardkit.apply_offload(pipe, "none")
    assert installed_hooks(pipe) == []
    assert all(not p.is_meta for c in pipe.components.values() if isinstance(c, torch.nn.Module) for p in c.parameters())
    torch.testing.assert_close(script.generate(pipe, size=32, steps=2, output_type="pt").images, pipe_reference,
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize(("strategy", "options"), STRATEGIES, ids=IDS)
def test_module_strategy_output_equals_plain(strategy, options, tmp_path):
    model = tiny_flux_transformer()
    inputs = flux_inputs()
    ref = run_flux(model, inputs)
    options = {k: v for k, v in options.items() if k != "exclude_modules"}
    shardkit.apply_offload(model, strategy, device="cpu", **_options(options, tmp_path))
    assert installed_hooks(model)
    torch.testing.assert_close(run_flux(model, inputs), ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(run_flux(model, inputs), ref, rtol=0, atol=1e-5)   # hooks re-arm after a call
    shardkit.apply_offload(model, "none")
    assert installed_hooks(model) == []
    torch.testing.assert_close(run_flux(model, inputs), ref, rtol=0, atol=1e-5)


def test_sequential_really_offloads_between_calls():
    model = plain_net()
    ids = torch.tensor([[1, 2]])
    ref = model(ids).detach()
    shardkit.apply_offload(model, "sequential", device="cpu")
    assert all(p.is_meta for p in model.blocks.parameters())          # weights live in the hook's map
    torch.testing.assert_close(model(ids).detach(), ref)
    assert all(p.is_meta for p in model.blocks.parameters())


def test_model_offload_chains_a_list_of_modules():
    first, second = plain_net(0), plain_net(1)
    shardkit.apply_offload([first, second], "model", device="cpu")
    assert second.shardkit_model_hook.hook.prev_module_hook is first.shardkit_model_hook
    assert "0: CpuOffload" in installed_hooks([first, second])
    shardkit.apply_offload([first, second], "none")
    assert installed_hooks([first, second]) == []


def test_group_offload_with_fp8_casting_composes():
    model = tiny_flux_transformer(torch.bfloat16)
    inputs = flux_inputs(torch.bfloat16)
    ref = run_flux(model, inputs)
    report = shardkit.apply_layerwise_casting(model, "float8_e4m3fn", "bfloat16")
    shardkit.apply_offload(model, "group", device="cpu", offload_type="leaf_level")
    out = run_flux(model, inputs)
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 0.08
    shardkit.apply_offload(model, "none")                            # casting hooks survive
    assert [h for h in installed_hooks(model) if "layerwise_casting" in h]
    assert dict(model.named_modules())[report.cast_modules[0]].weight.dtype == torch.float8_e4m3fn


# --- the guarded traps ---------------------------------------------------------------------------

def test_stream_with_several_blocks_per_group_is_refused():
    with pytest.raises(OffloadError, match="num_blocks_per_group=2 would be silently reset"):
        shardkit.apply_offload(plain_net(), "group", device="cuda:0", use_stream=True, num_blocks_per_group=2)


def test_stream_on_cpu_and_record_stream_without_stream_are_refused():
    with pytest.raises(OffloadError, match="needs an accelerator"):
        shardkit.apply_offload(plain_net(), "group", device="cpu", use_stream=True)
    with pytest.raises(InvalidInputError, match="record_stream=True needs use_stream=True"):
        shardkit.apply_offload(plain_net(), "group", device="cpu", record_stream=True)


def test_device_mapped_pipeline_must_be_reset_first(pipe):
    pipe.hf_device_map = {"transformer": 0, "text_encoder": 1, "vae": 1}   # what device_map="balanced" leaves
    try:
        for strategy in ("model", "sequential", "group"):
            with pytest.raises(OffloadError, match=r"reset_device_map\(\)"):
                shardkit.apply_offload(pipe, strategy, device="cpu")
    finally:
        pipe.hf_device_map = None
    assert installed_hooks(pipe) == []


def test_dispatched_module_is_refused():
    model = plain_net()
    model.hf_device_map = {"embed": "cpu", "blocks": 0}
    with pytest.raises(OffloadError, match="dispatched"):
        shardkit.apply_offload(model, "group", device="cpu")


def test_weights_already_on_accelerator_before_sequential_are_refused(monkeypatch, pipe):
    # A CPU machine cannot place weights on CUDA; pretend the placement probe saw it (the GPU test does it for real).
    monkeypatch.setattr("shardkit.runtime.offload_targets.placed_devices", lambda obj: {"cuda:0"})
    with pytest.raises(OffloadError, match="already moved to cuda:0 before sequential offload"):
        shardkit.apply_offload(pipe, "sequential", device="cpu")
    with pytest.raises(OffloadError, match="already moved"):
        shardkit.apply_offload(plain_net(), "sequential", device="cpu")


def test_unknown_strategy_options_and_targets():
    with pytest.raises(InvalidInputError, match="unknown offload strategy 'fast'"):
        shardkit.apply_offload(plain_net(), "fast")
    with pytest.raises(InvalidInputError, match="takes no option num_blocks_per_group"):
        shardkit.apply_offload(plain_net(), "model", num_blocks_per_group=2)
    with pytest.raises(InvalidInputError, match="offload_type must be"):
        shardkit.apply_offload(plain_net(), "group", device="cpu", offload_type="block")
    with pytest.raises(InvalidInputError, match="disk offload needs offload_dir"):
        shardkit.apply_offload(plain_net(), "disk", device="cpu")
    with pytest.raises(InvalidInputError, match="needs a diffusers pipeline"):
        shardkit.apply_offload("unet", "model")
    assert issubclass(OffloadError, ShardkitError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-accelerator message")
def test_no_accelerator_without_device_says_how_to_proceed():
    with pytest.raises(OffloadError, match="pass device='cpu'"):
        shardkit.apply_offload(plain_net(), "model")


# --- real CUDA -----------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("options", [{"offload_type": "block_level", "num_blocks_per_group": 1, "use_stream": True},
                                     {"offload_type": "leaf_level", "use_stream": True, "record_stream": True}])
def test_gpu_group_stream_offload(options):
    model = tiny_flux_transformer()
    inputs = flux_inputs()
    ref = run_flux(model, inputs)
    shardkit.apply_offload(model, "group", device="cuda", **options)
    torch.testing.assert_close(run_flux(model, inputs), ref, rtol=1e-4, atol=1e-4)
    assert all(p.device.type == "cpu" for p in model.parameters())   # offloaded between calls


@pytest.mark.gpu
def test_gpu_pipeline_moved_to_cuda_before_sequential_is_refused(pipe):
    pipe.to("cuda")
    try:
        with pytest.raises(OffloadError, match="already moved to cuda"):
            shardkit.apply_offload(pipe, "sequential")
    finally:
        pipe.to("cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["model", "sequential"])
def test_gpu_pipeline_offload_matches_plain(pipe, pipe_reference, strategy):
    shardkit.apply_offload(pipe, strategy)
    try:
        out = staged_script().generate(pipe, size=32, steps=2, output_type="pt").images
        torch.testing.assert_close(out.cpu(), pipe_reference, rtol=1e-3, atol=1e-3)
    finally:
        shardkit.apply_offload(pipe, "none")
        pipe.to("cpu")
