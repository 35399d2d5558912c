"""load_model of NVFP4 / MXFP4 checkpoints: weights stay packed in memory, each layer is dequantized at
compute, and outputs equal those of the checkpoint ``convert --dtype`` dequantized."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers_compare import assert_outputs_close
from helpers_fp4 import save_ct_nvfp4, save_gpt_oss_mxfp4, save_modelopt_nvfp4

import shardkit

LLAMA = "transformers:LlamaForCausalLM"


def _bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def _logits(model: torch.nn.Module, vocab: int) -> torch.Tensor:
    ids = torch.randint(0, vocab, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("kind", ["ct", "modelopt"])
def test_nvfp4_loads_packed_and_computes_like_its_dequantized_copy(kind: str, llama, tmp_path: Path) -> None:
    folder, state = llama
    config = json.loads((folder / "config.json").read_text())
    src = tmp_path / kind
    (save_ct_nvfp4 if kind == "ct" else save_modelopt_nvfp4)(src, state, config)
    shardkit.convert(src, tmp_path / "bf16", dtype="bf16")
    packed = shardkit.load_model(LLAMA, src, dtype="bf16")
    plain = shardkit.load_model(LLAMA, tmp_path / "bf16", dtype="bf16")
    up = packed.model.layers[0].mlp.up_proj
    stored = up.weight if kind == "modelopt" else up.weight_packed
    assert stored.dtype == torch.uint8 and tuple(stored.shape) == (512, 128)
    assert up.weight_scale.dtype == torch.float8_e4m3fn
    assert_outputs_close(_logits(packed, 512), _logits(plain, 512))
    assert (up.weight if kind == "modelopt" else up.weight_packed).dtype == torch.uint8  # put back after the call
    assert kind == "modelopt" or not hasattr(up, "weight")
    assert _bytes(packed) < 0.45 * _bytes(plain)


def test_gpt_oss_mxfp4_experts_stay_packed(tmp_path: Path) -> None:
    src = tmp_path / "mxfp4"
    save_gpt_oss_mxfp4(src)
    shardkit.convert(src, tmp_path / "bf16", dtype="bf16")
    packed = shardkit.load_model("transformers:GptOssForCausalLM", src, dtype="bf16")
    plain = shardkit.load_model("transformers:GptOssForCausalLM", tmp_path / "bf16", dtype="bf16")
    experts = packed.model.layers[1].mlp.experts
    assert experts.gate_up_proj_blocks.dtype == torch.uint8 and experts.gate_up_proj_scales.dtype == torch.uint8
    assert_outputs_close(_logits(packed, 128), _logits(plain, 128))
    assert not hasattr(experts, "gate_up_proj") and not hasattr(experts, "down_proj")


def test_offloaded_nvfp4_layers_are_dequantized_after_accelerate_brings_them_back(llama, tmp_path: Path) -> None:
    src, _ = llama
    shardkit.convert(src, tmp_path / "nvfp4", quantize="nvfp4")
    shardkit.convert(tmp_path / "nvfp4", tmp_path / "bf16", dtype="bf16")
    placement = {"model.embed_tokens": "cpu", "model.layers.0": "disk", "model.layers.1": "cpu", "model.norm": "cpu",
                 "model.rotary_emb": "cpu", "lm_head": "cpu"}
    packed = shardkit.load_model(LLAMA, tmp_path / "nvfp4", device_map=placement, offload_folder=tmp_path / "offload")
    plain = shardkit.load_model(LLAMA, tmp_path / "bf16")
    assert_outputs_close(_logits(packed, 512), _logits(plain, 512))
    assert packed.model.layers[1].self_attn.q_proj.weight_packed.dtype == torch.uint8
