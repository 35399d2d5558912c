"""Tiny pipeline folders for the fit planner's tests (built offline from configs, saved with
``save_pretrained``): the tiny Stable Diffusion pipeline, and a variant whose VAE is a ``VQModel``
(no tiling, no slicing)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from helpers_pipeline import build_tiny_sd_pipeline


def save_tiny_pipeline(folder: Path, scratch: Path) -> Any:
    """Save the tiny SD pipeline into ``folder``; return the in-memory pipeline."""
    pipe = build_tiny_sd_pipeline(scratch)
    pipe.save_pretrained(str(folder))
    return pipe


def tiny_vq_model() -> Any:
    import torch
    from diffusers import VQModel

    torch.manual_seed(0)
    return VQModel(block_out_channels=(16, 32), in_channels=3, out_channels=3, latent_channels=4,
                   norm_num_groups=8, num_vq_embeddings=16, vq_embed_dim=4, sample_size=32,
                   down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
                   up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"))


def swap_in_vq_vae(folder: Path) -> None:
    """Replace the pipeline folder's VAE by a tiny VQModel (a VAE without tiling or slicing)."""
    import shutil

    shutil.rmtree(folder / "vae")
    tiny_vq_model().save_pretrained(str(folder / "vae"))
    index = json.loads((folder / "model_index.json").read_text())
    index["vae"] = ["diffusers", "VQModel"]
    (folder / "model_index.json").write_text(json.dumps(index))


# The SDXL base UNet (stabilityai/stable-diffusion-xl-base-1.0 unet/config.json, the fields that shape it).
SDXL_UNET_CONFIG: dict[str, Any] = {
    "_class_name": "UNet2DConditionModel", "addition_embed_type": "text_time", "addition_embed_type_num_heads": 64,
    "addition_time_embed_dim": 256, "attention_head_dim": [5, 10, 20], "block_out_channels": [320, 640, 1280],
    "cross_attention_dim": 2048, "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "in_channels": 4, "layers_per_block": 2, "norm_num_groups": 32, "out_channels": 4,
    "projection_class_embeddings_input_dim": 2816, "sample_size": 128, "transformer_layers_per_block": [1, 2, 10],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"], "use_linear_projection": True,
}
