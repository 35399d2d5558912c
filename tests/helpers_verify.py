"""Builders for the info/verify tests: small checkpoints, byte surgery, a tiny pipeline folder."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

MODEL_INDEX = {
    "_class_name": "StableDiffusionPipeline",
    "_diffusers_version": "0.42.0",
    "unet": ["diffusers", "UNet2DConditionModel"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "scheduler": ["diffusers", "DDIMScheduler"],
    "safety_checker": [None, None],
    "feature_extractor": [None, None],
    "requires_safety_checker": False,
}


def make_state_dict(seed: int = 0) -> dict[str, Any]:
    """Mixed dtypes and odd sizes: F32 matrices, an F16 bias, an odd-length BF16, I64 and BOOL."""
    import torch

    g = torch.Generator().manual_seed(seed)
    sd = {f"blocks.{i}.weight": torch.randn(48, 40, generator=g) for i in range(6)}
    sd["blocks.0.bias"] = torch.randn(40, generator=g).to(torch.float16)
    sd["norm.weight"] = torch.randn(33, generator=g).to(torch.bfloat16)
    sd["step"] = torch.tensor([7], dtype=torch.int64)
    sd["mask"] = torch.tensor([True, False, True])
    return sd


def index_of(folder: Path, name: str = "model.safetensors.index.json") -> dict:
    return json.loads((folder / name).read_text())


def write_index(folder: Path, doc: dict, name: str = "model.safetensors.index.json") -> None:
    (folder / name).write_text(json.dumps(doc))


def shard_of(folder: Path, tensor: str, index: str = "model.safetensors.index.json") -> Path:
    return folder / index_of(folder, index)["weight_map"][tensor]


def read_raw_header(path: Path) -> tuple[dict, int]:
    """(header JSON, data start) parsed with the standard library, independently of shardkit."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def tensor_offset(path: Path, name: str) -> int:
    """Absolute offset of a tensor's data."""
    header, start = read_raw_header(path)
    return start + header[name]["data_offsets"][0]


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def build_pipeline(root: Path, *, seed: int = 0, unet_shard_size: str = "100KB") -> Path:
    """A diffusers pipeline folder as save_pretrained writes it: a sharded tiny UNet (diffusers
    naming), a CLIP text encoder (transformers naming), scheduler and tokenizer config folders."""
    import torch
    from conftest import tiny_clip_text_config, tiny_unet
    from diffusers import DDIMScheduler
    from transformers import CLIPTextModel

    root.mkdir(parents=True, exist_ok=True)
    tiny_unet(seed).save_pretrained(root / "unet", max_shard_size=unet_shard_size)
    torch.manual_seed(seed)
    CLIPTextModel(tiny_clip_text_config()).save_pretrained(root / "text_encoder")
    DDIMScheduler().save_pretrained(root / "scheduler")
    (root / "tokenizer").mkdir()
    (root / "tokenizer" / "tokenizer_config.json").write_text("{}")
    (root / "model_index.json").write_text(json.dumps(MODEL_INDEX))
    return root
