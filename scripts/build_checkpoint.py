#!/usr/bin/env python3
"""Build a real-architecture checkpoint with random weights, without holding it in memory.

The UNet skeleton is built on the meta device from its real config; tensors are generated one at
a time (seeded per name, so the same command gives the same bytes) and streamed into one
``diffusion_pytorch_model.safetensors`` file, in the order safetensors' own writer uses
(alphabetical for a single dtype). Used by ``scripts/demo`` and the benchmarks.

    python scripts/build_checkpoint.py sd15 out/unet        # SD 1.5 UNet, ~3.4 GB fp32
    python scripts/build_checkpoint.py sdxl out/unet        # SDXL UNet, ~10.3 GB fp32
    python scripts/build_checkpoint.py tiny out/unet        # a few MB, for quick checks
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from typing import Any

SD15_UNET = {
    "_class_name": "UNet2DConditionModel", "act_fn": "silu", "attention_head_dim": 8,
    "block_out_channels": [320, 640, 1280, 1280], "center_input_sample": False, "cross_attention_dim": 768,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "downsample_padding": 1, "flip_sin_to_cos": True, "freq_shift": 0, "in_channels": 4, "layers_per_block": 2,
    "mid_block_scale_factor": 1, "norm_eps": 1e-05, "norm_num_groups": 32, "out_channels": 4, "sample_size": 64,
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
}
SDXL_UNET = {
    "_class_name": "UNet2DConditionModel", "addition_embed_type": "text_time", "addition_embed_type_num_heads": 64,
    "addition_time_embed_dim": 256, "attention_head_dim": [5, 10, 20], "block_out_channels": [320, 640, 1280],
    "center_input_sample": False, "cross_attention_dim": 2048,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"], "downsample_padding": 1,
    "flip_sin_to_cos": True, "freq_shift": 0, "in_channels": 4, "layers_per_block": 2, "mid_block_scale_factor": 1,
    "norm_eps": 1e-05, "norm_num_groups": 32, "out_channels": 4, "projection_class_embeddings_input_dim": 2816,
    "sample_size": 128, "transformer_layers_per_block": [1, 2, 10],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"], "use_linear_projection": True,
}
TINY_UNET = {
    "_class_name": "UNet2DConditionModel", "block_out_channels": [32, 64], "layers_per_block": 1,
    "sample_size": 16, "in_channels": 4, "out_channels": 4, "cross_attention_dim": 32, "attention_head_dim": 4,
    "norm_num_groups": 8, "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
}
CONFIGS = {"sd15": SD15_UNET, "sdxl": SDXL_UNET, "tiny": TINY_UNET}


def random_source(config: dict[str, Any], *, dtype: str = "F32") -> Any:
    """A shardkit Source whose tensors are generated on demand from a meta skeleton."""
    import torch
    from accelerate import init_empty_weights
    from diffusers import UNet2DConditionModel

    from shardkit.formats.dtypes import to_torch
    from shardkit.formats.header import TensorEntry
    from shardkit.formats.index import Naming
    from shardkit.sources.base import Source
    from shardkit.units import tensor_nbytes

    with init_empty_weights():
        skeleton = UNet2DConditionModel.from_config({k: v for k, v in config.items() if k != "_class_name"})
    shapes = {name: tuple(t.shape) for name, t in skeleton.state_dict().items()}

    class RandomSource(Source):
        description = "random UNet weights"
        naming = Naming("diffusion_pytorch_model")

        def __init__(self) -> None:
            self._entries = [TensorEntry(n, dtype, s, tensor_nbytes(dtype, s)) for n, s in sorted(shapes.items())]
            self._cached: tuple[str, memoryview] | None = None

        def entries(self) -> list[TensorEntry]:
            return list(self._entries)

        def read(self, entry: TensorEntry, begin: int, end: int) -> memoryview:
            if self._cached is None or self._cached[0] != entry.name:
                seed = int.from_bytes(hashlib.sha256(entry.name.encode()).digest()[:4], "little")
                gen = torch.Generator().manual_seed(seed)
                t = torch.empty(entry.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen)
                t = t.to(to_torch(dtype)).reshape(-1)
                self._cached = (entry.name, memoryview(t.view(torch.uint8).numpy()))
            return self._cached[1][begin:end]

    return RandomSource()


def build_unet(kind: str, path: str, *, dtype: str = "F32", overwrite: bool = False) -> str:
    """Write ``path/diffusion_pytorch_model.safetensors`` and ``path/config.json``; return the file."""
    import shardkit

    config = CONFIGS[kind]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    shardkit.split(random_source(config, dtype=dtype), path, max_shard_size="1TB", overwrite=overwrite)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return os.path.join(path, "diffusion_pytorch_model.safetensors")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=sorted(CONFIGS))
    parser.add_argument("output", help="folder to create")
    parser.add_argument("--dtype", default="F32", help="safetensors dtype code (F32, F16, BF16)")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args()
    file = build_unet(args.kind, args.output, dtype=args.dtype, overwrite=args.overwrite)
    print(f"{file}: {os.path.getsize(file) / 1e9:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
