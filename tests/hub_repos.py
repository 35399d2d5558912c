"""Repositories of real models' sizes for the offline Hub (``hub_state``), built in no time: their weight files are
:class:`hub_state.LazyBlob` s, real safetensors headers from the real classes built on the meta device, zeros made
as they are sent. Used by ``scripts/bench_hub.py``.
"""

from __future__ import annotations

import json
import math
from typing import Any

from helpers_hub import lazy_safetensors
from hub_state import LazyBlob

T5_XXL = {"d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64, "num_layers": 24, "vocab_size": 32128,
          "feed_forward_proj": "gated-gelu", "is_encoder_decoder": False, "relative_attention_num_buckets": 32}
CLIP_L = {"hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12, "num_hidden_layers": 12,
          "vocab_size": 49408, "max_position_embeddings": 77, "projection_dim": 768, "hidden_act": "quick_gelu"}
FLUX_VAE = {"latent_channels": 16, "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2,
            "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
            "sample_size": 1024, "scaling_factor": 0.3611, "shift_factor": 0.1159, "use_quant_conv": False,
            "use_post_quant_conv": False}


def lazy_weights(model: Any, *, dtype: str, prefix: str, limit: int = 10**12, true_oid: bool = False) -> dict[str, Any]:
    """``model``'s tensors as lazy safetensors files of ``dtype``, in shards of at most ``limit`` bytes named as
    save_pretrained names them, with their index when there are several (``true_oid``: see LazyBlob)."""
    itemsize = 2 if dtype in ("BF16", "F16") else 4
    groups: list[dict[str, tuple[str, tuple[int, ...]]]] = [{}]
    group_bytes = 0
    for name, tensor in model.state_dict().items():
        nbytes = math.prod(tensor.shape) * itemsize
        if groups[-1] and group_bytes + nbytes > limit:
            groups.append({})
            group_bytes = 0
        groups[-1][name] = (dtype, tuple(tensor.shape))
        group_bytes += nbytes
    names = [f"{prefix}.safetensors"] if len(groups) == 1 else \
        [f"{prefix}-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)]
    files: dict[str, Any] = {}
    for filename, group in zip(names, groups, strict=True):
        blob = lazy_safetensors(group)
        files[filename] = LazyBlob(blob.head, blob.size, true_oid=True) if true_oid else blob
    if len(groups) > 1:
        weight_map = {name: f for f, group in zip(names, groups, strict=True) for name in group}
        total = sum(len(blob) - len(blob.head) for blob in files.values())
        files[f"{prefix}.safetensors.index.json"] = json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}).encode()
    return files


def hub_unet_repo(config: dict[str, Any], *, limit: int) -> dict[str, Any]:
    """The UNet of ``config`` in fp32 as diffusers saves it, in shards of ``limit`` bytes: config.json, shards, index
    (true sha256 oids, for a client that checks what it downloads)."""
    from accelerate import init_empty_weights
    from diffusers import UNet2DConditionModel

    with init_empty_weights():
        model = UNet2DConditionModel.from_config(config)
    return {"config.json": json.dumps(dict(model.config)).encode(),
            **lazy_weights(model, dtype="F32", prefix="diffusion_pytorch_model", limit=limit, true_oid=True)}


def hub_flux_repo(transformer: dict[str, Any]) -> dict[str, Any]:
    """A FLUX.1-dev-sized pipeline in bf16 (34 GB with FLUX.1-dev's ``transformer`` config, 11.9B): T5-XXL (4.8B),
    CLIP-L and the VAE built on the meta device from their real configs, the scheduler, tokenizer files at their
    real sizes."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    with init_empty_weights():
        models = {"transformer": ("diffusers", "FluxTransformer2DModel", FluxTransformer2DModel.from_config(transformer)),
                  "text_encoder": ("transformers", "CLIPTextModel", CLIPTextModel(CLIPTextConfig(**CLIP_L))),
                  "text_encoder_2": ("transformers", "T5EncoderModel", T5EncoderModel(T5Config(**T5_XXL))),
                  "vae": ("diffusers", "AutoencoderKL", AutoencoderKL(**FLUX_VAE))}
    files: dict[str, Any] = {}
    index: dict[str, object] = {"_class_name": "FluxPipeline", "_diffusers_version": "0.30.0",
                                "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
                                "tokenizer": ["transformers", "CLIPTokenizer"],
                                "tokenizer_2": ["transformers", "T5TokenizerFast"]}
    limits = {"transformer": 10 * 10**9, "text_encoder_2": 5 * 10**9}
    for name, (library, class_name, model) in models.items():
        index[name] = [library, class_name]
        config = model.config
        files[f"{name}/config.json"] = (config.to_json_string() if hasattr(config, "to_json_string")
                                        else json.dumps(dict(config))).encode()
        weights = lazy_weights(model, dtype="BF16", limit=limits.get(name, 10**12),
                               prefix="diffusion_pytorch_model" if library == "diffusers" else "model")
        files.update({f"{name}/{filename}": blob for filename, blob in weights.items()})
    files["model_index.json"] = json.dumps(index).encode()
    files["scheduler/scheduler_config.json"] = json.dumps(
        {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0, "use_dynamic_shifting": True}).encode()
    # tokenizer files at their real sizes; header-only commands must not fetch them
    files["tokenizer_2/tokenizer.json"] = LazyBlob(b"{}", 2_424_035)
    files["tokenizer_2/spiece.model"] = LazyBlob(b"", 791_656)
    files["tokenizer/vocab.json"] = LazyBlob(b"{}", 1_059_962)
    return files
