"""formats.suffixes: the one table of checkpoint file names."""

from __future__ import annotations

import pytest

from shardkit.formats.suffixes import is_index_file, is_saved_weight_file, is_weight_file


@pytest.mark.parametrize("name", ["model.safetensors", "model-00001-of-00002.safetensors", "pytorch_model.bin",
                                  "v1-5-pruned.ckpt", "model.pt", "weights.pth", "__0_0.distcp",
                                  "model.safetensors.index.json", "diffusion_pytorch_model.fp16.safetensors.index.json",
                                  "pytorch_model.bin.index.json"])
def test_weight_files(name: str) -> None:
    assert is_weight_file(name)


@pytest.mark.parametrize("name", ["config.json", "model_index.json", "README.md", "tokenizer.json",
                                  "scheduler_config.json", "index.json", "merges.txt"])
def test_side_files_are_not_weight_files(name: str) -> None:
    assert not is_weight_file(name) and not is_index_file(name) and not is_saved_weight_file(name)


def test_saved_weight_files_are_what_save_pretrained_writes() -> None:
    assert is_saved_weight_file("diffusion_pytorch_model.safetensors")
    assert is_saved_weight_file("pytorch_model.bin.index.json")
    assert not is_saved_weight_file("model.ckpt") and not is_saved_weight_file("__0_0.distcp")
