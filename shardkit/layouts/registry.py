"""Every layout shardkit maps, listed once; and which quantized layout a checkpoint uses.

:data:`LAYOUTS` is the one list: fp8 with scales (per tensor, per channel, 128×128 blocks), NVFP4,
MXFP4, llama.cpp's GGUF names, and diffusers ↔ original single file for each supported family. Each
entry is a name, a line saying what it is, and a strategy (:class:`~shardkit.layouts.table.LayoutStrategy`)
defined in that layout's own module: a new layout is that module and one entry here. A test runs
every entry forward and back on its sample (:func:`~shardkit.layouts.table.round_trip_problems`).

:func:`find_quant_layout` tries the fp4 layouts (:mod:`shardkit.layouts.fp4`) and then the fp8 ones
(:func:`shardkit.layouts.fp8.find_layout`): an NVFP4 checkpoint also holds ``weight_scale`` tensors,
and read as fp8 its packed bytes would be multiplied as if they were values. :func:`quant_config` is
the recipe next to the weights: ``config.json``, with ModelOpt's ``hf_quant_config.json`` folded in.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import InvalidInputError, Option
from ..formats.header import TensorEntry
from ..formats.json_types import Config, JsonObject
from ..formats.layout import read_config
from ..formats.links import parse_json, read_inside
from .adapters import PeftLora
from .fp4 import HF_QUANT_CONFIG, Fp4Layout, find_fp4_layout
from .fp4_quantize import Fp4Scheme
from .fp8 import QuantLayout, find_layout
from .fp8_quantize import QUANTIZE_RECIPES
from .gguf_names import GgufNames
from .quant import Dequantizer, QuantStrategy
from .single_file_export import LDM_VAE, UNET, SingleFileFamily
from .table import LayoutStrategy

__all__ = ["HF_QUANT_CONFIG", "LAYOUTS", "AnyLayout", "RegisteredLayout", "dequantizer", "find_quant_layout",
           "quant_config", "quant_strategy", "registered"]

AnyLayout = QuantLayout | Fp4Layout
MAX_QUANT_CONFIG_BYTES = 16 * 2**20


def find_quant_layout(entries: Sequence[TensorEntry], *, config: Config | None = None,
                      metadata: Mapping[str, str] | None = None, where: str = "checkpoint",
                      allow_lossy: bool = False) -> AnyLayout | None:
    """The checkpoint's quantized layout (fp4 or fp8 with scales), or None when it holds none.

    Args:
        entries: the checkpoint's tensors.
        config: its config (:func:`quant_config`).
        metadata: its safetensors header metadata.
        where: the checkpoint, for messages.
        allow_lossy: return an inconsistent fp4 layout (its broken weights left out, passed through as
            stored) instead of refusing it; an inconsistent fp8 one is then read as plain tensors.

    Raises:
        InvalidInputError: a missing or misshapen scale, or fp4 weights without their quantization
            config; one line naming the tensor.
    """
    fp4 = find_fp4_layout(entries, config=config, where=where)
    if fp4 is not None:
        refusal = fp4.refusal(where)
        if refusal is not None and not allow_lossy:
            raise InvalidInputError(*refusal)
        return fp4
    try:
        return find_layout(entries, config=config, metadata=metadata, where=where)
    except InvalidInputError:
        if allow_lossy:
            return None
        raise


def quant_config(folder: str) -> JsonObject | None:
    """``folder/config.json``; without a ``quantization_config`` in it, ModelOpt's ``hf_quant_config.json``
    (``{"quantization": {...}}``) as one with ``quant_method: modelopt``. None when there is neither."""
    return quant_config_of(folder, read_config(folder))


def quant_config_of(folder: str, config: JsonObject | None) -> JsonObject | None:
    """:func:`quant_config` for a caller that has already read ``folder``'s config.json (``config``)."""
    if config is not None and config.get("quantization_config"):
        return config
    path = os.path.join(folder, HF_QUANT_CONFIG)
    try:  # a checked descriptor: a FIFO, /dev/zero or a link leaving the folder is refused unread
        raw = read_inside(folder, HF_QUANT_CONFIG, where=folder, max_bytes=MAX_QUANT_CONFIG_BYTES)
    except FileNotFoundError:
        return config
    except OSError as e:
        raise InvalidInputError(f"{path}: not readable ({e.strerror or e}); fix or remove it") from e
    doc = parse_json(raw, path=path)
    quant = doc.get("quantization") if isinstance(doc, dict) else None
    if not isinstance(quant, dict):
        return config
    return {**(config or {}), "quantization_config": {"quant_method": "modelopt", **quant}}


@dataclass(frozen=True)
class RegisteredLayout:
    """One layout of :data:`LAYOUTS`: its name, what it is, and its strategy."""

    name: str
    summary: str
    strategy: LayoutStrategy


_SD_UNET = {"sample_size": 8, "in_channels": 4, "out_channels": 4, "layers_per_block": 2,
            "block_out_channels": [8, 8, 16, 16], "norm_num_groups": 4, "cross_attention_dim": 8, "attention_head_dim": 2,
            "down_block_types": ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
            "up_block_types": ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3}
_SDXL_UNET = {"sample_size": 8, "in_channels": 4, "out_channels": 4, "layers_per_block": 2, "block_out_channels": [8, 16, 16],
              "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
              "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
              "transformer_layers_per_block": [1, 2, 2], "attention_head_dim": [2, 4, 4], "use_linear_projection": True,
              "addition_embed_type": "text_time", "addition_time_embed_dim": 8,
              "projection_class_embeddings_input_dim": 64, "cross_attention_dim": 40, "norm_num_groups": 4}
_VAE = {"in_channels": 3, "out_channels": 3, "latent_channels": 4, "block_out_channels": [8, 8, 16, 16],
        "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
        "layers_per_block": 2, "norm_num_groups": 4, "sample_size": 16}
_CLIP = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
         "max_position_embeddings": 16, "projection_dim": 16, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1}
_SD3 = {"sample_size": 8, "patch_size": 2, "in_channels": 4, "num_layers": 2, "attention_head_dim": 8,
        "num_attention_heads": 2, "joint_attention_dim": 16, "caption_projection_dim": 16, "pooled_projection_dim": 8,
        "out_channels": 4, "pos_embed_max_size": 16}
_FLUX = {"num_layers": 1, "num_single_layers": 1, "in_channels": 16, "joint_attention_dim": 32,
         "pooled_projection_dim": 16, "guidance_embeds": True}  # diffusers' converter hard-codes Flux.1's width

LAYOUTS: tuple[RegisteredLayout, ...] = (
    RegisteredLayout("fp8-tensor", "fp8 e4m3, one scale per tensor (compressed-tensors float-quantized)",
                     QUANTIZE_RECIPES["fp8-tensor"]),
    RegisteredLayout("fp8-channel", "fp8 e4m3, one scale per output channel (compressed-tensors float-quantized)",
                     QUANTIZE_RECIPES["fp8-channel"]),
    RegisteredLayout("fp8-block", "fp8 e4m3, one scale per 128×128 block (transformers FineGrainedFP8)",
                     QUANTIZE_RECIPES["fp8-block"]),
    RegisteredLayout("nvfp4", "fp4 e2m1, e4m3 scale per 16 + global scale (compressed-tensors nvfp4-pack-quantized)",
                     Fp4Scheme("nvfp4")),
    RegisteredLayout("mxfp4", "fp4 e2m1, e8m0 scale per 32, MoE experts (gpt-oss)", Fp4Scheme("mxfp4")),
    RegisteredLayout("peft-lora", "PEFT LoRA adapter keys (base_model.model.M.lora_A/lora_B, modules_to_save)",
                     PeftLora()),
    RegisteredLayout("gguf-llama", "llama.cpp's Llama tensor names (blk.N.attn_q...)", GgufNames()),
    RegisteredLayout("single-file-sd-unet", "SD 1.x/2.x UNet ↔ LDM (model.diffusion_model.input_blocks...)",
                     SingleFileFamily("unet", UNET, "diffusers", "UNet2DConditionModel", _SD_UNET)),
    RegisteredLayout("single-file-sdxl-unet", "SDXL UNet ↔ SGM (label_emb, transformer depth per block)",
                     SingleFileFamily("unet", UNET, "diffusers", "UNet2DConditionModel", _SDXL_UNET)),
    RegisteredLayout("single-file-vae", "SD/SDXL VAE ↔ LDM (first_stage_model.encoder.down...)",
                     SingleFileFamily("vae", LDM_VAE, "diffusers", "AutoencoderKL", _VAE)),
    RegisteredLayout("single-file-clip", "CLIP text encoder ↔ LDM (cond_stage_model.transformer...)",
                     SingleFileFamily("clip", "cond_stage_model.transformer.", "transformers", "CLIPTextModel", _CLIP)),
    RegisteredLayout("single-file-openclip", "OpenCLIP text encoder ↔ SGM (fused in_proj, transposed projection)",
                     SingleFileFamily("openclip", "conditioner.embedders.1.model.", "transformers",
                                      "CLIPTextModelWithProjection", {**_CLIP, "hidden_act": "gelu"})),
    RegisteredLayout("single-file-sd3", "SD3/SD3.5 transformer ↔ SAI (joint_blocks, fused qkv)",
                     SingleFileFamily("sd3", UNET, "diffusers", "SD3Transformer2DModel", _SD3)),
    RegisteredLayout("single-file-flux", "Flux.1 transformer ↔ BFL (double_blocks, single_blocks, fused linear1)",
                     SingleFileFamily("flux", "", "diffusers", "FluxTransformer2DModel", _FLUX)),
)


def registered(name: str) -> RegisteredLayout:
    """The layout called ``name`` in :data:`LAYOUTS`.

    Raises:
        InvalidInputError: no such layout; the message lists them.
    """
    for layout in LAYOUTS:
        if layout.name == name:
            return layout
    raise InvalidInputError(f"no layout {name!r}; the layouts are {', '.join(layout.name for layout in LAYOUTS)}")


def quant_strategy(name: str) -> QuantStrategy:
    """The quantized layout called ``name`` (``quantize=name``) as its :class:`~shardkit.layouts.quant.QuantStrategy`.

    Raises:
        InvalidInputError: no quantized layout of that name; the message lists them.
    """
    for layout in LAYOUTS:
        if layout.name == name and isinstance(layout.strategy, QuantStrategy):
            return layout.strategy
    names = ", ".join(layout.name for layout in LAYOUTS if isinstance(layout.strategy, QuantStrategy))
    raise InvalidInputError(Option("quantize", name), f": expected one of {names}")


def dequantizer(layout: AnyLayout, entries: Sequence[TensorEntry]) -> Dequantizer:
    """The dense weights of a checkpoint's quantized ``layout`` (:func:`find_quant_layout`, found among ``entries``),
    from the first entry of :data:`LAYOUTS` that reads it."""
    for registered_layout in LAYOUTS:
        strategy = registered_layout.strategy
        found = strategy.dequantizer(layout, entries) if isinstance(strategy, QuantStrategy) else None
        if found is not None:
            return found
    raise InvalidInputError(f"{layout.scheme}: no layout of the registry reads it (add its strategy to LAYOUTS)")
