"""fp8-with-scales checkpoints built the way their own tools write them, independently of shardkit.

Each builder quantizes a real model's weights (a tiny Llama from its transformers config, a
Flux-shaped transformer in the original BFL key names) with a small reference absmax quantizer
written here, and saves them in one layout: transformers FineGrainedFP8, compressed-tensors
float-quantized, ComfyUI scaled_fp8, ComfyUI quantized (``_quantization_metadata``).
:func:`reference_dequant` is the test's own weight × scale, to compare shardkit with.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

FP8 = torch.float8_e4m3fn
LLAMA = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 64}


def tiny_llama(seed: int = 0) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**LLAMA)).to(torch.bfloat16).eval()


def save_llama(folder: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """A tiny Llama saved by transformers (bf16); returns its state dict."""
    model = tiny_llama(seed)
    model.save_pretrained(folder)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny Llama saved by transformers, and its state dict (import this fixture into a test module)."""
    folder = tmp_path_factory.mktemp("llama") / "plain"
    return folder, save_llama(folder)


def is_quantized_linear(name: str, t: torch.Tensor) -> bool:
    return name.endswith("_proj.weight") and t.dim() == 2


def quantize(w: torch.Tensor, granularity: str, block: tuple[int, int] = (128, 128),
             dtype: torch.dtype = FP8) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference absmax quantizer: (q, scale) with w ≈ q × scale; blocks padded at the edges (ceil grid)."""
    top = torch.finfo(dtype).max
    w = w.float()
    if granularity == "tensor":
        scale = (w.abs().amax() / top).reshape(1)
        return (w / scale).clamp(-top, top).to(dtype), scale
    if granularity == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / top
        return (w / scale).clamp(-top, top).to(dtype), scale
    rows, cols = w.shape
    r, c = math.ceil(rows / block[0]), math.ceil(cols / block[1])
    padded = torch.zeros(r * block[0], c * block[1])
    padded[:rows, :cols] = w
    scale = padded.reshape(r, block[0], c, block[1]).abs().amax(dim=(1, 3)) / top
    expanded = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return (w / expanded).clamp(-top, top).to(dtype), scale


def reference_dequant(q: torch.Tensor, scale: torch.Tensor, out: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """weight × scale, broadcast the plain way (the test's own arithmetic)."""
    if scale.dtype == torch.uint8:
        scale = torch.pow(2.0, scale.float() - 127)
    s = scale.float()
    if s.numel() == 1:
        s = s.reshape(())
    elif s.dim() == 2 and s.shape[1] != 1:
        rows, cols = q.shape  # 128×128 blocks, the last ones cut at the edges
        s = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
    else:
        s = s.reshape(-1, *([1] * (q.dim() - 1)))
    return (q.float() * s).to(out)


def save_finegrained(folder: Path, state: dict[str, torch.Tensor], *, scale_dtype: str = "F32",
                     config: dict[str, Any] | None = None) -> None:
    """transformers FineGrainedFP8: ``weight_scale_inv`` per 128×128 block, in float32, bf16 or e8m0."""
    out: dict[str, torch.Tensor] = {}
    for name, t, (q, scale) in _linears(state, "block", out):
        if scale_dtype == "F8_E8M0":
            scale = torch.pow(2.0, torch.ceil(torch.log2(scale)))  # powers of two, then re-quantize on them
            expanded = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: t.shape[0], : t.shape[1]]
            q = (t.float() / expanded).clamp(-448, 448).to(FP8)
            scale = scale.to(torch.float8_e8m0fnu)
        elif scale_dtype == "BF16":
            scale = scale.to(torch.bfloat16)
        out[name], out[name[: -len("weight")] + "weight_scale_inv"] = q, scale
    _save(folder, out)
    qconfig = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
               "modules_to_not_convert": ["lm_head"]}
    if scale_dtype == "F8_E8M0":
        qconfig["scale_fmt"] = "ue8m0"
    _write_config(folder, config, qconfig)


def save_compressed(folder: Path, state: dict[str, torch.Tensor], *, strategy: str,
                    config: dict[str, Any] | None = None) -> None:
    """compressed-tensors float-quantized: ``weight_scale`` per tensor (1,), channel (out, 1) or block; ``input_scale``."""
    out: dict[str, torch.Tensor] = {}
    for name, _, (q, scale) in _linears(state, strategy, out):
        prefix = name[: -len("weight")]
        out[name], out[prefix + "weight_scale"], out[prefix + "input_scale"] = q, scale, torch.ones(1)
    _save(folder, out)
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                                               "symmetric": True, "dynamic": False},
             "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}
    _write_config(folder, config, {"quant_method": "compressed-tensors", "format": "float-quantized",
                                   "config_groups": {"group_0": group}, "ignore": ["lm_head"]})


def _linears(state: dict[str, torch.Tensor], granularity: str, kept: dict[str, torch.Tensor]) -> Any:
    """(name, tensor, quantize(tensor)) of each Llama linear weight; every other tensor goes into ``kept``."""
    for name, t in state.items():
        if is_quantized_linear(name, t):
            yield name, t, quantize(t, granularity)
        else:
            kept[name] = t.contiguous()


def _save(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def comfy_scaled(state: dict[str, torch.Tensor], *, quantized: Any = None) -> dict[str, torch.Tensor]:
    """ComfyUI scaled_fp8: a ``scaled_fp8`` marker, ``X.scale_weight`` (one value) and ``X.scale_input``."""
    quantized = quantized or (lambda name, t: name.endswith(".weight") and t.dim() == 2)
    out: dict[str, torch.Tensor] = {"scaled_fp8": torch.empty(0, dtype=FP8)}
    for name, t in state.items():
        if not quantized(name, t):
            out[name] = t.contiguous()
            continue
        q, scale = quantize(t, "tensor")
        prefix = name[: -len("weight")]
        out[name], out[prefix + "scale_weight"], out[prefix + "scale_input"] = q, scale, torch.ones(1)
    return out


def comfy_quantized(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The newer ComfyUI layout: ``X.weight_scale`` (scalar) and a ``_quantization_metadata`` header entry."""
    out, layers = {}, {}
    for name, t in state.items():
        if not is_quantized_linear(name, t):
            out[name] = t.contiguous()
            continue
        q, scale = quantize(t, "tensor")
        out[name], out[name[: -len("weight")] + "weight_scale"] = q, scale.reshape(())
        layers[name[: -len(".weight")]] = {"format": "float8_e4m3fn"}
    meta = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers}), "format": "pt"}
    return out, meta


def _write_config(folder: Path, config: dict[str, Any] | None, qconfig: dict[str, Any]) -> None:
    doc = dict(config if config is not None else json.loads((folder / "config.json").read_text()))
    doc["quantization_config"] = qconfig
    (folder / "config.json").write_text(json.dumps(doc, indent=2))


def flux_config() -> dict[str, Any]:
    return {"patch_size": 1, "in_channels": 16, "num_layers": 2, "num_single_layers": 2, "attention_head_dim": 16,
            "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 32,
            "axes_dims_rope": [4, 4, 8], "guidance_embeds": False}


def flux_bfl_state_dict(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """A Flux transformer in the original (BFL) key names, as single-file checkpoints store it."""
    g = torch.Generator().manual_seed(seed)
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    mlp, head = inner * 4, config["attention_head_dim"]
    shapes: dict[str, tuple[int, ...]] = {
        "time_in.in_layer": (inner, 256), "time_in.out_layer": (inner, inner),
        "vector_in.in_layer": (inner, config["pooled_projection_dim"]), "vector_in.out_layer": (inner, inner),
        "txt_in": (inner, config["joint_attention_dim"]), "img_in": (inner, config["in_channels"]),
        "final_layer.linear": (config["in_channels"], inner), "final_layer.adaLN_modulation.1": (2 * inner, inner),
    }
    for i in range(config["num_layers"]):
        for side in ("img", "txt"):
            shapes.update({f"double_blocks.{i}.{side}_mod.lin": (6 * inner, inner),
                           f"double_blocks.{i}.{side}_attn.qkv": (3 * inner, inner),
                           f"double_blocks.{i}.{side}_attn.proj": (inner, inner),
                           f"double_blocks.{i}.{side}_mlp.0": (mlp, inner),
                           f"double_blocks.{i}.{side}_mlp.2": (inner, mlp)})
    for i in range(config["num_single_layers"]):
        shapes.update({f"single_blocks.{i}.modulation.lin": (3 * inner, inner),
                       f"single_blocks.{i}.linear1": (3 * inner + mlp, inner),
                       f"single_blocks.{i}.linear2": (inner, inner + mlp)})
    state = {}
    for module, shape in shapes.items():
        state[f"{module}.weight"] = (torch.randn(shape, generator=g) * 0.05).to(torch.bfloat16)
        state[f"{module}.bias"] = (torch.randn(shape[0], generator=g) * 0.01).to(torch.bfloat16)
    norms = [f"double_blocks.{i}.{s}_attn.norm.{n}_norm.scale" for i in range(config["num_layers"])
             for s in ("img", "txt") for n in ("query", "key")]
    norms += [f"single_blocks.{i}.norm.{n}_norm.scale" for i in range(config["num_single_layers"]) for n in ("query", "key")]
    state.update({n: torch.ones(head, dtype=torch.bfloat16) for n in norms})
    return state
