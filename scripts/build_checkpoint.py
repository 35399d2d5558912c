#!/usr/bin/env python3
"""Build a real-architecture checkpoint with random weights (seeded per tensor name), streamed without holding it in
memory. Used by ``scripts/demo`` and the benchmarks. Method: docs/benchmarks.md, "How each benchmark measures".

    python scripts/build_checkpoint.py sd15 out/unet        # SD 1.5 UNet, ~3.4 GB fp32
    python scripts/build_checkpoint.py sdxl out/unet        # SDXL UNet, ~10.3 GB fp32
    python scripts/build_checkpoint.py tiny out/unet        # a few MB, for quick checks
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import subprocess
import sys
from typing import Any

import benchlib

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
# diffusers' FluxTransformer2DModel defaults are the FLUX.1-dev sizes (12B parameters)
FLUX_DEV = {
    "_class_name": "FluxTransformer2DModel", "in_channels": 64, "num_layers": 19, "num_single_layers": 38,
    "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
    "pooled_projection_dim": 768, "guidance_embeds": True, "axes_dims_rope": [16, 56, 56], "patch_size": 1,
}
# Child-process code writing sys.argv[1] (a safetensors file) as a torch.save zip pickle at sys.argv[2].
TORCH_SAVE = ("import sys, torch; from safetensors.torch import load_file; "
              "torch.save(load_file(sys.argv[1]), sys.argv[2])")
# Child-process code saving sys.argv[1] (safetensors) as a DCP folder at sys.argv[3], as FSDP training does: its
# first tensors up to sys.argv[2] bytes ("0": all).
DCP_SAVE = ("import sys, warnings; warnings.simplefilter('ignore'); import torch.distributed.checkpoint as dcp; "
            "from safetensors import safe_open\n"
            "limit = int(float(sys.argv[2])); sd = {}; total = 0\n"
            "with safe_open(sys.argv[1], 'pt') as f:\n"
            "    for k in f.keys():\n"
            "        t = f.get_tensor(k); total += t.numel() * t.element_size(); sd[k] = t\n"
            "        if limit and total >= limit: break\n"
            "dcp.save({'model': sd}, checkpoint_id=sys.argv[3], no_dist=True)")


def diffusers_model(config: dict[str, Any], *, meta: bool = True) -> Any:
    """The diffusers model ``config`` describes (its ``_class_name``): on the meta device, or with random weights."""
    import diffusers
    from accelerate import init_empty_weights

    with init_empty_weights() if meta else contextlib.nullcontext():
        return getattr(diffusers, config["_class_name"]).from_config(config)


def unet_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape of the UNet ``config`` describes (its skeleton built on the meta device)."""
    return {name: tuple(t.shape) for name, t in diffusers_model(config).state_dict().items()}


def random_source(shapes: dict[str, tuple[int, ...]], *, dtype: str = "F32", prefix: str = "model") -> Any:
    """A shardkit Source of ``shapes`` (in name order) whose values are generated on demand, seeded by name."""
    import torch

    from shardkit.formats.dtypes import to_torch
    from shardkit.formats.header import TensorEntry
    from shardkit.formats.index import Naming
    from shardkit.sources.base import Source
    from shardkit.units import tensor_nbytes

    class RandomSource(Source):
        description = "random weights"
        naming = Naming(prefix)

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


def build_unet(kind: str, path: str, *, dtype: str = "F32", overwrite: bool = False,
               max_shard_size: int | str = "1TB") -> str:
    """Write ``path/diffusion_pytorch_model*.safetensors`` (one file unless ``max_shard_size``) and
    ``path/config.json``; return the first weights file."""
    import shardkit

    config = CONFIGS[kind]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    source = random_source(unet_shapes(config), dtype=dtype, prefix="diffusion_pytorch_model")
    shardkit.split(source, path, max_shard_size=max_shard_size, overwrite=overwrite)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return benchlib.shard_files(path)[0]


def build_random(path: str, *, size_bytes: int, shard_bytes: int | str = "1TB", tensor_bytes: int = 64 << 20,
                 dtype: str = "BF16", manifest: bool = True) -> list[str]:
    """A checkpoint of ``size_bytes`` of random 1-D tensors (``layers.NNNN.weight``), split by shardkit
    (index, and manifest unless told not) into shards of ``shard_bytes``; its file names."""
    import shardkit

    itemsize = 4 if dtype == "F32" else 2
    count, left = size_bytes // tensor_bytes, size_bytes % tensor_bytes
    shapes = {f"layers.{i:04d}.weight": (tensor_bytes // itemsize,) for i in range(count)}
    if left or not count:
        shapes[f"layers.{count:04d}.weight"] = (max(left, itemsize) // itemsize,)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    shardkit.split(random_source(shapes, dtype=dtype), path, max_shard_size=shard_bytes, manifest=manifest)
    return sorted(os.listdir(path))


def build_once(path: str, code: str, *args: str, note: str = "", hide_stderr: bool = False) -> str:
    """Build ``path`` unless it exists: run Python ``code`` in a child process with ``sys.argv[1:]``
    = ``[*args, tmp]``, then rename ``tmp`` onto ``path`` (an interrupted build leaves no input)."""
    if not os.path.exists(path):
        print(f"building {path}{note} ...", flush=True)
        tmp = path + ".tmp"
        subprocess.run([sys.executable, "-c", code, *args, tmp], check=True,
                       stderr=subprocess.DEVNULL if hide_stderr else None)
        os.replace(tmp, path)
    return path


def unet_source(kind: str, work: str, *, dtype: str = "F32") -> str:
    """The ``kind`` UNet's single safetensors file under ``work``, built once."""
    folder = os.path.join(work, f"{kind}-unet" + ("" if dtype == "F32" else f"-{dtype.lower()}"))
    src = os.path.join(folder, "diffusion_pytorch_model.safetensors")
    if not os.path.exists(src):
        print(f"building {src} ...", flush=True)
        build_unet(kind, folder, dtype=dtype, overwrite=True)
    return src


def sharded_unet(kind: str, work: str, *, dtype: str = "F32", shards: int | None = None) -> tuple[str, int]:
    """The ``kind`` UNet in shards (5GB for SDXL, 2GB for the others, or ``shards`` of them), built once;
    (folder, tensor bytes)."""
    folder = os.path.join(work, f"{kind}-unet-{dtype.lower()}-sharded")
    shapes = unet_shapes(CONFIGS[kind])
    itemsize = 4 if dtype == "F32" else 2
    nbytes = sum(math.prod(s) * itemsize for s in shapes.values())
    if not os.path.exists(os.path.join(folder, "config.json")):
        print(f"building {folder} ...", flush=True)
        limit = nbytes // shards + (64 << 20) if shards else "5GB" if kind == "sdxl" else "2GB"
        build_unet(kind, folder, dtype=dtype, overwrite=True, max_shard_size=limit)
    return folder, nbytes


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
