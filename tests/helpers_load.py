"""Models and checkpoints for the load/lazy/placement tests (tiny, random weights, seeded)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

FLUX_DEV_CONFIG: dict[str, Any] = {
    "_class_name": "FluxTransformer2DModel",
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": [16, 56, 56],
    "patch_size": 1,
}

# The SD 1.5 UNet (runwayml/stable-diffusion-v1-5 unet/config.json, the fields that shape it).
SD15_UNET_CONFIG: dict[str, Any] = {
    "_class_name": "UNet2DConditionModel",
    "sample_size": 64, "in_channels": 4, "out_channels": 4, "layers_per_block": 2,
    "block_out_channels": [320, 640, 1280, 1280], "cross_attention_dim": 768, "attention_head_dim": 8,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    "norm_num_groups": 32,
}

TINY_VAE_CONFIG: dict[str, Any] = {
    "in_channels": 3, "out_channels": 3, "latent_channels": 4, "block_out_channels": [8, 16],
    "down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D"],
    "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D"], "layers_per_block": 1, "norm_num_groups": 4,
    "sample_size": 16,
}


def tiny_vae(seed: int = 0) -> Any:
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(**TINY_VAE_CONFIG).eval()


def vae_forward(model: Any, *, seed: int = 1) -> Any:
    """Decode a fixed latent (deterministic, no sampling)."""
    import torch

    latent = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model.decode(latent).sample


def make_tied_lm(vocab: int = 32, hidden: int = 16, layers: int = 3) -> Any:
    """A plain torch model whose output head shares the embedding's weight (a factory for load_model)."""
    import torch
    from torch import nn

    class TinyLM(nn.Module):
        _no_split_modules = ["Block"]

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, hidden)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(hidden, hidden), nn.GELU()) for _ in range(layers))
            self.norm = nn.LayerNorm(hidden)
            self.head = nn.Linear(hidden, vocab, bias=False)
            self.head.weight = self.embed.weight
            self.register_buffer("scale", torch.tensor(0.5))

        def forward(self, ids: Any) -> Any:
            x = self.embed(ids)
            for block in self.blocks:
                x = x + block(x) * self.scale
            return self.head(self.norm(x))

    return TinyLM


def lm_forward(model: Any) -> Any:
    import torch

    ids = torch.arange(12).reshape(2, 6) % 32
    with torch.no_grad():
        return model(ids)


def save_model(model: Any, folder: str | os.PathLike[str], *, max_shard_size: str = "20KB",
               name: str = "diffusion_pytorch_model", **kwargs: Any) -> Path:
    """Shard ``model`` with shardkit and write its config.json next to the shards (diffusers models)."""
    import shardkit

    folder = Path(folder)
    shardkit.save_sharded(model, folder, max_shard_size=max_shard_size, name=name, **kwargs)
    if hasattr(model, "config") and hasattr(model, "save_config"):
        model.save_config(folder)
    return folder


def write_config(folder: str | os.PathLike[str], config: dict[str, Any]) -> Path:
    path = Path(folder) / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    return path


def folder_bytes(folder: str | os.PathLike[str]) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
