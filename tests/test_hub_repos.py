"""The offline Hub's lazy repositories of real models' sizes (tests/hub_repos.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from hub_repos import hub_unet_repo
from safetensors import safe_open

pytest.importorskip("diffusers")

TINY_UNET = {"block_out_channels": [32, 64], "layers_per_block": 1, "sample_size": 16, "cross_attention_dim": 32,
             "attention_head_dim": 4, "norm_num_groups": 8, "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
             "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"]}


def test_a_unet_repo_is_shards_as_diffusers_saves_them_with_their_index_and_true_oids(tmp_path: Path) -> None:
    from accelerate import init_empty_weights
    from diffusers import UNet2DConditionModel

    with init_empty_weights():
        shapes = {k: tuple(t.shape) for k, t in UNet2DConditionModel.from_config(TINY_UNET).state_dict().items()}
    files = hub_unet_repo(TINY_UNET, limit=1 << 20)
    index = json.loads(files.pop("diffusion_pytorch_model.safetensors.index.json"))
    assert json.loads(files.pop("config.json"))["block_out_channels"] == [32, 64]
    assert sorted(files) == [f"diffusion_pytorch_model-{i:05d}-of-{len(files):05d}.safetensors"
                             for i in range(1, len(files) + 1)] and len(files) > 1
    found: dict[str, tuple[int, ...]] = {}
    for name, blob in files.items():
        data = blob[0:len(blob)]
        assert blob.oid == hashlib.sha256(data).hexdigest()
        (tmp_path / name).write_bytes(data)
        with safe_open(str(tmp_path / name), "pt") as f:
            found.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
            assert all(index["weight_map"][k] == name for k in f.keys())
    assert found == shapes and set(index["weight_map"]) == set(shapes)
    assert index["metadata"]["total_size"] == sum(len(b) - len(b.head) for b in files.values())
