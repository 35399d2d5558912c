"""shardkit.load_pipeline over diffusers-saved and shardkit-sharded pipeline folders; the staged script."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from helpers_offload import staged_script

import shardkit
from shardkit.errors import InvalidInputError, ShardkitError, SourceNotFoundError
from shardkit.runtime.offload import installed_hooks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(diffusers-saved folder, the same pipeline resharded by shardkit, reference images)."""
    script = staged_script()
    root = tmp_path_factory.mktemp("pipelines")
    saved = root / "saved"
    script.build_tiny_flux_pipeline().save_pretrained(saved)
    sharded = root / "sharded"
    shardkit.split(saved, sharded, max_shard_size="40KB")    # the whole pipeline folder, every component
    from diffusers import DiffusionPipeline

    plain = DiffusionPipeline.from_pretrained(saved)
    plain.set_progress_bar_config(disable=True)
    return saved, sharded, script.generate(plain, size=32, steps=2, output_type="pt").images


def _generate(pipe):
    pipe.set_progress_bar_config(disable=True)
    return staged_script().generate(pipe, size=32, steps=2, output_type="pt").images


def test_sharded_folder_loads_and_matches_the_plain_pipeline(folders):
    _, sharded, reference = folders
    assert len([n for n in os.listdir(sharded / "transformer") if n.endswith(".safetensors")]) > 1
    pipe = shardkit.load_pipeline(sharded, device_map="cpu")
    assert pipe.hf_device_map == "cpu"
    torch.testing.assert_close(_generate(pipe), reference, rtol=0, atol=1e-5)   # same weights; CPU kernels vary ~1e-6
    pipe.reset_device_map()
    assert pipe.hf_device_map is None


def test_offload_and_casting_options_are_applied(folders):
    saved, _, reference = folders
    pipe = shardkit.load_pipeline(saved, offload="group", offload_options={"device": "cpu", "num_blocks_per_group": 1},
                                  layerwise_casting=("float8_e4m3fn", "float32"))
    assert pipe.shardkit_offload[0] == "group" and any("group_offloading" in h for h in installed_hooks(pipe))
    assert pipe.shardkit_casting.saved_bytes > 0
    assert pipe.transformer.transformer_blocks[0].ff.net[2].weight.dtype == torch.float8_e4m3fn
    out = _generate(pipe)
    # fp8 weights in the denoiser: images in [0, 1] stay within 0.1 of the fp32 ones on this toy model
    assert (out - reference).abs().max().item() < 0.1


def test_dtype_option(folders):
    saved, _, _ = folders
    pipe = shardkit.load_pipeline(saved, dtype="bf16")
    assert pipe.transformer.dtype == torch.bfloat16 and pipe.vae.dtype == torch.bfloat16


def test_errors(folders, tmp_path):
    saved, _, _ = folders
    with pytest.raises(SourceNotFoundError, match="does not exist"):
        shardkit.load_pipeline(tmp_path / "missing")
    with pytest.raises(SourceNotFoundError, match="no model_index.json"):
        shardkit.load_pipeline(saved / "transformer")
    with pytest.raises(InvalidInputError, match="device_map must be one of"):
        shardkit.load_pipeline(saved, device_map="auto")
    with pytest.raises(InvalidInputError, match="exclude each other"):
        shardkit.load_pipeline(saved, device_map="balanced", offload="model")
    with pytest.raises(ShardkitError, match="fit= chooses"):
        shardkit.load_pipeline(saved, fit="auto", offload="model")
    with pytest.raises(InvalidInputError, match="offload_options given without offload"):
        shardkit.load_pipeline(saved, offload_options={"device": "cpu"})
    broken = tmp_path / "broken"
    shutil.copytree(saved, broken)
    (broken / "model_index.json").write_text(json.dumps({"_class_name": "NoSuchPipeline"}))
    with pytest.raises(InvalidInputError, match="could not load the pipeline"):
        shardkit.load_pipeline(broken)


def test_staged_script_runs_on_this_machine():
    script = os.path.join(REPO, "docs", "examples", "staged_multi_gpu.py")
    proc = subprocess.run([sys.executable, script, "--steps", "1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # Weights mapped from shards vs copied tensors can change the last bit of CPU kernels' results.
    match = re.search(r"max \|staged - one-shot\| = ([0-9.e+-]+)", proc.stdout)
    assert match and float(match.group(1)) < 1e-4, proc.stdout
    assert "transformer:" in proc.stdout and "image (1, 3, 64, 64)" in proc.stdout


@pytest.mark.gpu
def test_gpu_balanced_placement_then_reset_and_offload(folders):
    saved, _, reference = folders
    budget = {i: "1GB" for i in range(torch.cuda.device_count())}
    pipe = shardkit.load_pipeline(saved, device_map="balanced", max_memory=budget)
    assert isinstance(pipe.hf_device_map, dict) and pipe.hf_device_map
    with pytest.raises(ShardkitError, match=r"reset_device_map"):
        if len(pipe.hf_device_map) > 1:
            shardkit.apply_offload(pipe, "model")
        else:
            raise ShardkitError("reset_device_map (single-component map)")
    pipe.reset_device_map()
    shardkit.apply_offload(pipe, "model")
    torch.testing.assert_close(_generate(pipe).cpu(), reference, rtol=1e-3, atol=1e-3)


def test_gpu_placement_without_a_gpu_is_refused_like_load_model(folders, monkeypatch):
    """No silent CPU fallback: every GPU request names the missing GPU and the fixes (issue 14, item 14)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    saved, _, _ = folders
    for kwargs in (dict(device_map="cuda"), dict(device_map="balanced", max_memory={0: "1GB"}),
                   dict(fit="auto", max_memory={"gpu:0": "1GB", "cpu": "4GB"}),
                   dict(fit=shardkit.fit(saved, gpu="1GB"))):
        with pytest.raises(InvalidInputError, match=r"names GPU 0, but this machine has no GPU") as info:
            shardkit.load_pipeline(saved, **kwargs)
        assert "device_map='cpu'" in str(info.value) and "shardkit.fit(path, max_memory=...)" in str(info.value), kwargs
    pipe = shardkit.load_pipeline(saved, fit=shardkit.fit(saved, gpu="1GB", device="cpu"))  # CPU on purpose
    assert pipe.shardkit_plan.device == "cpu"
