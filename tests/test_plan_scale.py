"""The plan of a 671B-parameter DeepSeek-V3-shaped checkpoint, from its config without weights.

The checkpoint is built as the original is laid out (FineGrainedFP8: e4m3 weights with float32
128×128 ``weight_scale_inv``, 61 layers of which 58 MoE with 256 routed experts and one shared; 179
files where the original has 163) but every file is sparse: a real header, then a hole the size of its tensor bytes, so 680 GB
of "weights" take no disk. Planning reads headers only, so the plan is the real one.
"""

from __future__ import annotations

import json
import math
import os
import struct
import time
from pathlib import Path

import pytest

import shardkit

CONFIG = {  # deepseek-ai/DeepSeek-V3 config.json, the fields the tensor shapes come from
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "first_k_dense_replace": 3,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_attention_heads": 128, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280,
    "torch_dtype": "bfloat16",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}
BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1}


def _fp8(name: str, rows: int, cols: int) -> list[tuple[str, str, list[int]]]:
    return [(f"{name}.weight", "F8_E4M3", [rows, cols]),
            (f"{name}.weight_scale_inv", "F32", [-(-rows // 128), -(-cols // 128)])]


def layer_tensors(i: int, c: dict[str, int]) -> list[tuple[str, str, list[int]]]:
    """Every tensor of decoder layer ``i``: (name, dtype, shape)."""
    h, p = c["hidden_size"], f"model.layers.{i}"
    heads, qk = c["num_attention_heads"], c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    out = [(f"{p}.input_layernorm.weight", "BF16", [h]), (f"{p}.post_attention_layernorm.weight", "BF16", [h]),
           (f"{p}.self_attn.q_a_layernorm.weight", "BF16", [c["q_lora_rank"]]),
           (f"{p}.self_attn.kv_a_layernorm.weight", "BF16", [c["kv_lora_rank"]])]
    out += _fp8(f"{p}.self_attn.q_a_proj", c["q_lora_rank"], h)
    out += _fp8(f"{p}.self_attn.q_b_proj", heads * qk, c["q_lora_rank"])
    out += _fp8(f"{p}.self_attn.kv_a_proj_with_mqa", c["kv_lora_rank"] + c["qk_rope_head_dim"], h)
    out += _fp8(f"{p}.self_attn.kv_b_proj", heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"])
    out += _fp8(f"{p}.self_attn.o_proj", h, heads * c["v_head_dim"])
    if i < c["first_k_dense_replace"]:
        mlps = [(f"{p}.mlp", c["intermediate_size"])]
    else:
        out += [(f"{p}.mlp.gate.weight", "BF16", [c["n_routed_experts"], h]),
                (f"{p}.mlp.gate.e_score_correction_bias", "F32", [c["n_routed_experts"]])]
        mlps = [(f"{p}.mlp.experts.{e}", c["moe_intermediate_size"]) for e in range(c["n_routed_experts"])]
        mlps.append((f"{p}.mlp.shared_experts", c["moe_intermediate_size"] * c["n_shared_experts"]))
    for m, inter in mlps:
        out += _fp8(f"{m}.gate_proj", inter, h) + _fp8(f"{m}.up_proj", inter, h) + _fp8(f"{m}.down_proj", h, inter)
    return out


def write_sparse(path: Path, tensors: list[tuple[str, str, list[int]]]) -> int:
    """A safetensors file with a real header and a hole for its data; returns its tensor bytes."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in tensors:
        nbytes = BYTES[dtype] * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return offset


def build_deepseek_v3(folder: Path) -> int:
    """The sparse checkpoint (a file per dense layer, three per MoE layer: 179); returns its tensor bytes."""
    c = CONFIG
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(c, indent=1))
    groups: list[list[tuple[str, str, list[int]]]] = [[("model.embed_tokens.weight", "BF16", [c["vocab_size"], c["hidden_size"]])]]
    for i in range(c["num_hidden_layers"]):  # ~2.7 files per MoE layer: experts split in thirds
        tensors = layer_tensors(i, c)
        parts = 1 if i < c["first_k_dense_replace"] else 3
        step = -(-len(tensors) // parts)
        groups += [tensors[k:k + step] for k in range(0, len(tensors), step)]
    groups.append([("model.norm.weight", "BF16", [c["hidden_size"]]),
                   ("lm_head.weight", "BF16", [c["vocab_size"], c["hidden_size"]])])
    total, weight_map = 0, {}
    names = [f"model-{n:05d}-of-{len(groups):05d}.safetensors" for n in range(1, len(groups) + 1)]
    for name, tensors in zip(names, groups, strict=True):
        total += write_sparse(folder / name, tensors)
        weight_map.update(dict.fromkeys((t[0] for t in tensors), name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


@pytest.mark.slow
def test_the_plan_of_a_671b_deepseek_v3_is_printed_by_a_dry_run(tmp_path: Path) -> None:
    total = build_deepseek_v3(tmp_path / "dsv3")
    assert len(list((tmp_path / "dsv3").glob("*.safetensors"))) == 179
    begin = time.perf_counter()
    plan = shardkit.write_plan(tmp_path / "dsv3", tmp_path / "dsv3-bf16", tmp_path / "plan.json", dtype="bf16",
                               max_shard_size="5GB")
    seconds = time.perf_counter() - begin
    tasks = plan.tasks
    assert len(tasks) > 250 and plan.total_bytes > 1.3e12  # bf16: two bytes a parameter
    assert len(plan.sources) == 179 + 1  # every weight file and config.json: a changed one is refused
    assert all(t.size_bytes <= 5 * 10**9 + 2**20 for t in tasks)
    print(f"\n671B DeepSeek-V3 (sparse, {total / 1e9:.0f} GB fp8): plan of {len(tasks)} tasks, "
          f"{plan.total_bytes / 1e12:.2f} TB bf16, written in {seconds:.1f} s; plan file "
          f"{os.path.getsize(tmp_path / 'plan.json') / 1e6:.1f} MB")
