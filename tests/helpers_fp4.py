"""fp4 checkpoints built by their own libraries' code, independently of shardkit.

- compressed-tensors ``nvfp4-pack-quantized``: the library's observers (``generate_gparam``,
  ``compute_dynamic_scales_and_zp``) and its ``NVFP4PackedCompressor``, config from its ``QuantizationConfig``.
- NVIDIA ModelOpt NVFP4: built by hand from the documented format (``nvidia-modelopt`` is not installed
  here: it is heavy and GPU-oriented): ``weight_scale_2 = amax / (6 × 448)`` shared by q/k/v and gate/up,
  ``weight_scale = e4m3(block amax / (6 × weight_scale_2))``, values packed by compressed-tensors'
  ``pack_fp4_to_uint8`` (low nibble first), ``hf_quant_config.json``.
- gpt-oss MXFP4: a tiny transformers ``GptOssForCausalLM`` with random weights, its experts quantized by
  compressed-tensors' MXFP4 observer and compressor and laid out as gpt-oss stores them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

NVFP4_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GPT_OSS = {"hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
           "vocab_size": 128, "max_position_embeddings": 64, "layer_types": ["sliding_attention", "full_attention"]}


def _save(folder: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any] | None) -> None:
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config, indent=2))


def _is_linear(name: str, t: torch.Tensor) -> bool:
    return name.endswith(".weight") and t.dim() == 2 and name.split(".")[-2] in NVFP4_LINEARS


def ct_nvfp4_config(*, activations: bool = False) -> dict[str, Any]:
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4, NVFP4A16

    preset = NVFP4 if activations else NVFP4A16
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], **preset)},
                                format="nvfp4-pack-quantized", quantization_status="compressed", ignore=["lm_head"])
    return json.loads(json.dumps(config.model_dump(), default=str))


def ct_nvfp4_compress(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' own NVFP4 quantization of one weight: weight_packed, weight_scale, weight_global_scale."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4A16
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp, generate_gparam

    scheme = QuantizationScheme(targets=["Linear"], **NVFP4A16)
    low, high = torch.aminmax(w)
    global_scale = generate_gparam(low, high)
    scale, zero = compute_dynamic_scales_and_zp(w, scheme.weights, torch.nn.Module(), global_scale=global_scale)
    return NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_global_scale": global_scale,
                                           "weight_zero_point": zero}, scheme)


def ct_nvfp4_decompress(module: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """compressed-tensors' decompression (bf16); another ``dtype``: its ``dequantize`` of the same unpacked
    values and bf16 scales, kept in that dtype."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.quant_scheme import NVFP4A16

    scheme = QuantizationScheme(targets=["Linear"], **NVFP4A16)
    if dtype == torch.bfloat16:
        return NVFP4PackedCompressor.decompress(dict(module), scheme)["weight"]
    packed = module["weight_packed"]
    values = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2)
    return dequantize(x_q=values, scale=module["weight_scale"].to(values.dtype), args=scheme.weights,
                      global_scale=module["weight_global_scale"], dtype=dtype)


def save_ct_nvfp4(folder: Path, state: dict[str, torch.Tensor], config: dict[str, Any], *,
                  activations: bool = False) -> None:
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if not _is_linear(name, t):
            out[name] = t
            continue
        prefix = name[: -len("weight")]
        for key, value in ct_nvfp4_compress(t).items():
            out[prefix + key] = value
        if activations:
            out[prefix + "input_global_scale"] = torch.tensor([2.5])
    _save(folder, out, {**config, "quantization_config": ct_nvfp4_config(activations=activations)})


def modelopt_quantize(w: torch.Tensor, scale_2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed, weight_scale) of ``w`` given its ``weight_scale_2``, per the ModelOpt NVFP4 format."""
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8
    from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

    rows = w.shape[0]
    blocks = w.float().reshape(rows, -1, 16)
    scale = (blocks.abs().amax(dim=-1) / (6.0 * scale_2)).clamp(max=448).to(torch.float8_e4m3fn)
    divisor = scale.float().unsqueeze(-1) * scale_2
    values = cast_to_fp4((blocks / torch.where(divisor == 0, 1.0, divisor)).clamp(-6, 6)).reshape(rows, -1)
    return pack_fp4_to_uint8(values), scale


def save_modelopt_nvfp4(folder: Path, state: dict[str, torch.Tensor], config: dict[str, Any], *,
                        hf_quant_config: bool = True, in_config: bool = False) -> None:
    """ModelOpt NVFP4: q/k/v and gate/up share one ``weight_scale_2``; ``input_scale`` on every linear."""
    shared: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if _is_linear(name, t):
            group = name.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
            shared[group] = torch.maximum(shared.get(group, torch.zeros(())), t.float().abs().amax())
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if not _is_linear(name, t):
            out[name] = t
            continue
        group = name.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
        scale_2 = (shared[group] / (6.0 * 448.0)).to(torch.float32)
        prefix = name[: -len("weight")]
        out[name], out[prefix + "weight_scale"] = modelopt_quantize(t, scale_2)
        out[prefix + "weight_scale_2"], out[prefix + "input_scale"] = scale_2.reshape(()), torch.tensor(0.01)
    quant = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": ["lm_head"]}
    doc = dict(config)
    if in_config:
        doc["quantization_config"] = {"quant_method": "modelopt", **quant}
    _save(folder, out, doc)
    if hf_quant_config:
        (folder / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"},
                                                                 "quantization": quant}))


def modelopt_reference(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor,
                       out: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """ModelOpt's NVFP4QTensor.dequantize: e2m1 × (f32(weight_scale) × weight_scale_2) per 16-value block."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    rows = packed.shape[0]
    values = unpack_fp4_from_uint8(packed, rows, packed.shape[1] * 2, dtype=torch.float32).reshape(rows, -1, 16)
    return (values * (scale.to(torch.float32).unsqueeze(-1) * scale_2)).reshape(rows, -1).to(out)


def tiny_gpt_oss(seed: int = 0) -> Any:
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    model = GptOssForCausalLM(GptOssConfig(**GPT_OSS)).to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name:
                p.normal_(0, 0.05)
    return model


def ct_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' MXFP4 quantization of rows ``w`` (out, in): (packed (out, in/2), scales (out, in/32))."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import MXFP4A16
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    scheme = QuantizationScheme(targets=["Linear"], **MXFP4A16)
    scale, zero = compute_dynamic_scales_and_zp(w, scheme.weights, torch.nn.Module())
    done = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zero}, scheme)
    return done["weight_packed"], done["weight_scale"]


def mxfp4_experts(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss ``X_blocks`` (E, out, in/32, 16) and ``X_scales`` (E, out, in/32) of dense experts (E, in, out)."""
    stored = dense.transpose(1, 2).contiguous()
    experts, rows, cols = stored.shape
    packed, scales = ct_mxfp4(stored.reshape(experts * rows, cols))
    return packed.reshape(experts, rows, cols // 32, 16), scales.reshape(experts, rows, cols // 32)


def save_gpt_oss_mxfp4(folder: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """A tiny gpt-oss saved by transformers, then its experts in MXFP4 as the released checkpoints hold them."""
    model = tiny_gpt_oss(seed)
    model.save_pretrained(folder)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name + "_blocks"], out[name + "_scales"] = mxfp4_experts(t)
        else:
            out[name] = t
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    os.remove(folder / "model.safetensors")
    _save(folder, out, config)
    return state
