"""load_model / load_pipeline of fp8 checkpoints with scales: weights stay fp8 in memory, each layer is
dequantized at compute, and outputs equal those of the dequantized checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers_compare import assert_outputs_close

import shardkit


def _tensor_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def test_llama_fp8_block_loads_in_fp8_and_computes_like_its_dequantized_copy(llama, tmp_path: Path) -> None:
    src, _ = llama
    shardkit.convert(src, tmp_path / "fp8", quantize="fp8-block")
    shardkit.convert(tmp_path / "fp8", tmp_path / "bf16", dtype="bf16")
    fp8 = shardkit.load_model("transformers:LlamaForCausalLM", tmp_path / "fp8", dtype="bf16")  # fp8 stays fp8
    plain = shardkit.load_model("transformers:LlamaForCausalLM", tmp_path / "bf16", dtype="bf16")
    up = fp8.model.layers[0].mlp.up_proj
    assert up.weight.dtype == torch.float8_e4m3fn and up.weight_scale_inv.dtype == torch.float32
    assert fp8.model.norm.weight.dtype == torch.bfloat16 and fp8.lm_head.weight.dtype == torch.bfloat16
    ids = torch.randint(0, 512, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_outputs_close(fp8(ids).logits, plain(ids).logits)
    assert up.weight.dtype == torch.float8_e4m3fn  # put back after the call
    rotary = sum(b.numel() * b.element_size() for b in fp8.model.rotary_emb.buffers())
    assert _tensor_bytes(fp8) - rotary == shardkit.info(tmp_path / "fp8").total_bytes  # fp8 + scales + the rest
    assert _tensor_bytes(fp8) < 0.6 * _tensor_bytes(plain)


def test_layers_on_disk_are_dequantized_after_accelerate_brings_them_back(llama, tmp_path: Path) -> None:
    src, _ = llama
    shardkit.convert(src, tmp_path / "fp8", quantize="fp8-channel")
    shardkit.convert(tmp_path / "fp8", tmp_path / "bf16", dtype="bf16")
    placement = {"model.embed_tokens": "cpu", "model.layers.0": "disk", "model.layers.1": "cpu", "model.norm": "cpu",
                 "model.rotary_emb": "cpu", "lm_head": "cpu"}
    fp8 = shardkit.load_model("transformers:LlamaForCausalLM", tmp_path / "fp8", device_map=placement,
                              offload_folder=tmp_path / "offload")
    plain = shardkit.load_model("transformers:LlamaForCausalLM", tmp_path / "bf16")
    ids = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_outputs_close(fp8(ids).logits, plain(ids).logits)
    assert fp8.model.layers[1].self_attn.q_proj.weight.dtype == torch.float8_e4m3fn


def test_flux_transformer_fp8_block_runs_like_dequantize_then_run(tmp_path: Path) -> None:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=64,
                           num_attention_heads=2, joint_attention_dim=128, pooled_projection_dim=128,
                           axes_dims_rope=[16, 16, 32]).save_pretrained(tmp_path / "flux")
    shardkit.convert(tmp_path / "flux", tmp_path / "fp8", quantize="fp8-block", dtype="fp32")  # kept modules: fp32
    shardkit.convert(tmp_path / "fp8", tmp_path / "fp32", dtype="fp32")
    fp8 = shardkit.load_model("diffusers:FluxTransformer2DModel", tmp_path / "fp8")
    plain = shardkit.load_model("diffusers:FluxTransformer2DModel", tmp_path / "fp32")
    assert fp8.transformer_blocks[0].attn.to_q.weight.dtype == torch.float8_e4m3fn
    assert fp8.transformer_blocks[0].norm1.linear.weight.dtype == torch.float32  # modulation kept
    g = torch.Generator().manual_seed(1)
    inputs = {"hidden_states": torch.randn(1, 16, 16, generator=g), "encoder_hidden_states": torch.randn(1, 8, 128, generator=g),
              "pooled_projections": torch.randn(1, 128, generator=g), "timestep": torch.tensor([0.5]),
              "img_ids": torch.zeros(16, 3), "txt_ids": torch.zeros(8, 3)}
    with torch.no_grad():
        # activations fp32: layers dequantized to fp32; the two runs' sums may be ordered differently
        assert_outputs_close(fp8(**inputs).sample, plain(**inputs).sample)


def test_sd_pipeline_with_fp8_components_generates_like_its_dequantized_copy(tmp_path: Path) -> None:
    from helpers_pipeline import build_tiny_sd_pipeline, generate

    build_tiny_sd_pipeline(tmp_path).save_pretrained(tmp_path / "sd")
    result = shardkit.split(tmp_path / "sd", tmp_path / "fp8", quantize="fp8-channel", dtype="fp32")  # kept: fp32
    assert result.components["unet"].quantization["quantized"] > 0
    assert result.components["text_encoder"].quantization["quantized"] > 0
    shardkit.split(tmp_path / "fp8", tmp_path / "fp32", dtype="fp32")
    assert "quantization_config" in json.loads((tmp_path / "fp8" / "unet" / "config.json").read_text())
    fp8 = shardkit.load_pipeline(tmp_path / "fp8")
    plain = shardkit.load_pipeline(tmp_path / "fp32")
    assert any(p.dtype == torch.float8_e4m3fn for p in fp8.unet.parameters())
    assert any(p.dtype == torch.float8_e4m3fn for p in fp8.text_encoder.parameters())
    assert_outputs_close(generate(fp8), generate(plain))


def test_fit_prices_scales_as_stored(llama, tmp_path: Path) -> None:
    from shardkit.fitting.weights import header_tensors

    shardkit.convert(llama[0], tmp_path / "fp8", quantize="fp8-block")
    tensors, _ = header_tensors(str(tmp_path / "fp8"))
    by_name = {t.name: t for t in tensors}
    assert not by_name["model.layers.0.mlp.up_proj.weight_scale_inv"].follows_dtype
    assert not by_name["model.layers.0.mlp.up_proj.weight"].follows_dtype
    assert by_name["model.norm.weight"].follows_dtype
    assert sum(t.loaded_bytes(2) for t in tensors) == shardkit.info(tmp_path / "fp8").total_bytes


def test_a_scaled_checkpoint_with_a_missing_scale_is_refused_before_loading(llama, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    shardkit.convert(llama[0], tmp_path / "fp8", quantize="fp8-block")
    state = load_file(tmp_path / "fp8" / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight_scale_inv"]
    save_file(state, tmp_path / "fp8" / "model.safetensors")
    with pytest.raises(shardkit.InvalidInputError, match="model.layers.1.mlp.up_proj.weight has no scale"):
        shardkit.load_model("transformers:LlamaForCausalLM", tmp_path / "fp8")
