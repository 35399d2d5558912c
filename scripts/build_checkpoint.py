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
import math
import os
import subprocess
import sys
from typing import Any

import benchlib  # also puts tests/ (the tests' Hub: hub_state) on sys.path

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


def unet_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape of the UNet ``config`` describes (its skeleton built on the meta device)."""
    from accelerate import init_empty_weights
    from diffusers import UNet2DConditionModel

    with init_empty_weights():
        skeleton = UNet2DConditionModel.from_config({k: v for k, v in config.items() if k != "_class_name"})
    return {name: tuple(t.shape) for name, t in skeleton.state_dict().items()}


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


# ----------------------------------------------------------------------------- Hub repositories (lazy bytes)

def lazy_weights(model: Any, *, dtype: str, prefix: str, limit: int = 10**12, true_oid: bool = False) -> dict[str, Any]:
    """``model``'s tensors as safetensors files of ``dtype`` for the tests' Hub (tests/hub_state.LazyBlob: real
    headers, zeros made as they are sent), in shards of ``limit`` bytes named as save_pretrained names them,
    with their index when there are several."""
    from hub_state import LazyBlob  # tests/: a file of the tests' Hub whose bytes after its head are made as sent

    from shardkit.formats.header import TensorEntry, build_header

    itemsize = 2 if dtype in ("BF16", "F16") else 4
    entries = [TensorEntry(k, dtype, tuple(t.shape), math.prod(t.shape) * itemsize) for k, t in model.state_dict().items()]
    groups: list[list[TensorEntry]] = [[]]
    for e in entries:
        if groups[-1] and sum(x.nbytes for x in groups[-1]) + e.nbytes > limit:
            groups.append([])
        groups[-1].append(e)
    names = [f"{prefix}.safetensors"] if len(groups) == 1 else \
        [f"{prefix}-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)]
    files: dict[str, Any] = {}
    for filename, group in zip(names, groups, strict=True):
        head, _ = build_header(group)
        files[filename] = LazyBlob(head, len(head) + sum(e.nbytes for e in group), true_oid=true_oid)
    if len(groups) > 1:
        weight_map = {e.name: f for f, g in zip(names, groups, strict=True) for e in g}
        files[f"{prefix}.safetensors.index.json"] = json.dumps(
            {"metadata": {"total_size": sum(e.nbytes for e in entries)}, "weight_map": weight_map}).encode()
    return files


def hub_unet_repo(kind: str = "sd15") -> dict[str, Any]:
    """The ``kind`` UNet in fp32 (sd15: 3.44 GB) as diffusers saves it in two shards: config.json, shards, index."""
    from accelerate import init_empty_weights
    from diffusers import UNet2DConditionModel

    with init_empty_weights():
        model = UNet2DConditionModel.from_config(CONFIGS[kind])
    limit = 2 * 10**9 if kind == "sd15" else 1 << 20
    return {"config.json": json.dumps(dict(model.config)).encode(),
            **lazy_weights(model, dtype="F32", prefix="diffusion_pytorch_model", limit=limit, true_oid=True)}


def hub_flux_repo() -> dict[str, Any]:
    """A FLUX.1-dev-sized pipeline in bf16 (34 GB): the transformer (11.9B), T5-XXL (4.8B), CLIP-L and the VAE
    built on the meta device from their real configs, the scheduler, tokenizer files at their real sizes."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from hub_state import LazyBlob
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    vae = {"latent_channels": 16, "block_out_channels": [128, 256, 512, 512], "down_block_types":
           ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4, "layers_per_block": 2,
           "sample_size": 1024, "scaling_factor": 0.3611, "shift_factor": 0.1159, "use_quant_conv": False,
           "use_post_quant_conv": False}
    t5 = T5Config(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24, vocab_size=32128,
                  feed_forward_proj="gated-gelu", is_encoder_decoder=False, relative_attention_num_buckets=32)
    clip = CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12,
                          vocab_size=49408, max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu")
    with init_empty_weights():
        models = {"transformer": ("diffusers", "FluxTransformer2DModel", FluxTransformer2DModel.from_config(FLUX_DEV)),
                  "text_encoder": ("transformers", "CLIPTextModel", CLIPTextModel(clip)),
                  "text_encoder_2": ("transformers", "T5EncoderModel", T5EncoderModel(t5)),
                  "vae": ("diffusers", "AutoencoderKL", AutoencoderKL(**vae))}
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
