"""Our output loads unchanged in safetensors, huggingface_hub, accelerate, diffusers and transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    TINY_UNET_CONFIG,
    assert_bit_equal,
    load_folder,
    realign,
    tensor_bytes,
    tiny_bert_config,
    tiny_clip_text_config,
    tiny_unet,
    unet_forward,
)
from helpers_compare import assert_outputs_close

import shardkit


@pytest.fixture(scope="module")
def unet_source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """A tiny UNet saved by diffusers itself (one file), its state dict and its forward output."""
    folder = tmp_path_factory.mktemp("unet-src")
    model = tiny_unet(seed=0)
    model.save_pretrained(folder)
    return folder, {k: v.clone() for k, v in model.state_dict().items()}, unet_forward(model)


@pytest.fixture(scope="module")
def unet_sharded(unet_source: tuple[Path, Any, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny UNet folder split by shardkit into several shards (config.json travels along)."""
    folder, _, _ = unet_source
    out = tmp_path_factory.mktemp("unet-out") / "unet"
    result = shardkit.split(folder, out, max_shard_size="40KB")
    assert len(result.plan.shards) > 2
    if not (out / "config.json").exists():
        shutil.copy(folder / "config.json", out / "config.json")
    return out


def test_output_uses_diffusers_names(unet_sharded: Path) -> None:
    names = sorted(p.name for p in unet_sharded.iterdir())
    assert "diffusion_pytorch_model.safetensors.index.json" in names
    assert all(n.startswith("diffusion_pytorch_model-") for n in names if n.endswith(".safetensors"))


def test_safe_open_reads_every_tensor(unet_sharded: Path, unet_source: tuple) -> None:
    from safetensors import safe_open

    _, state, _ = unet_source
    index = json.loads((unet_sharded / "diffusion_pytorch_model.safetensors.index.json").read_text())
    got = {}
    for shard in set(index["weight_map"].values()):
        with safe_open(str(unet_sharded / shard), framework="pt") as f:
            assert f.metadata()["format"] == "pt"
            for name in f.keys():
                got[name] = f.get_tensor(name)
                assert index["weight_map"][name] == shard
    assert_bit_equal(got, state)


def test_diffusers_from_pretrained_gives_identical_outputs(unet_sharded: Path, unet_source: tuple) -> None:
    from diffusers import UNet2DConditionModel

    _, _, expected = unet_source
    model = UNet2DConditionModel.from_pretrained(unet_sharded).eval()
    assert_outputs_close(unet_forward(model), expected)


def test_diffusers_loads_bf16_variant(unet_source: tuple, tmp_path: Path) -> None:
    import torch
    from diffusers import UNet2DConditionModel

    folder, state, _ = unet_source
    out = tmp_path / "unet"
    shardkit.split(folder, out, max_shard_size="40KB", dtype="bf16", variant="bf16")
    shutil.copy(folder / "config.json", out / "config.json")
    model = UNet2DConditionModel.from_pretrained(out, variant="bf16", torch_dtype=torch.bfloat16)
    for name, tensor in model.state_dict().items():
        assert tensor_bytes(tensor) == tensor_bytes(state[name].to(torch.bfloat16)), name


def test_huggingface_hub_load_torch_model(unet_sharded: Path, unet_source: tuple) -> None:
    from huggingface_hub import load_torch_model

    _, _, expected = unet_source
    model = tiny_unet(seed=123)
    load_torch_model(model, unet_sharded, strict=True, filename_pattern="diffusion_pytorch_model{suffix}.safetensors")
    assert_outputs_close(unet_forward(model.eval()), expected)


def test_accelerate_load_checkpoint_in_model(unet_sharded: Path, unet_source: tuple) -> None:
    from accelerate import init_empty_weights, load_checkpoint_in_model
    from diffusers import UNet2DConditionModel

    _, _, expected = unet_source
    index = unet_sharded / "diffusion_pytorch_model.safetensors.index.json"
    for checkpoint in (unet_sharded, index):
        model = tiny_unet(seed=7)
        load_checkpoint_in_model(model, str(checkpoint), strict=True)
        assert_outputs_close(unet_forward(model.eval()), expected)
    with init_empty_weights():
        skeleton = UNet2DConditionModel(**TINY_UNET_CONFIG)
    load_checkpoint_in_model(skeleton, str(index), device_map={"": "cpu"})
    assert_outputs_close(unet_forward(skeleton.eval()), expected)


def test_same_plan_as_huggingface_hub(unet_source: tuple, tmp_path: Path) -> None:
    """With no tensor over the limit, our shards hold exactly what huggingface_hub's would."""
    from huggingface_hub import save_torch_state_dict

    folder, state, _ = unet_source
    biggest = max(t.nbytes for t in state.values())
    ours = tmp_path / "ours"
    shardkit.save_sharded(state, ours, max_shard_size=biggest + 1000)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    save_torch_state_dict(state, theirs, max_shard_size=biggest + 1000)
    index_name = "model.safetensors.index.json"
    ours_index = json.loads((ours / index_name).read_text())
    theirs_index = json.loads((theirs / index_name).read_text())
    assert ours_index == theirs_index
    assert_bit_equal(load_folder(ours), load_folder(theirs))


# ------------------------------------------------------------------ transformers

@pytest.mark.parametrize("kind", ["clip", "bert"])
def test_transformers_from_pretrained(tmp_path: Path, kind: str) -> None:
    import torch
    from transformers import BertModel, CLIPTextModel

    cls, config = (CLIPTextModel, tiny_clip_text_config()) if kind == "clip" else (BertModel, tiny_bert_config())
    torch.manual_seed(0)
    model = cls(config).eval()
    src = tmp_path / "src"
    model.save_pretrained(src)
    out = tmp_path / "out"
    result = shardkit.split(src, out, max_shard_size="4KB")
    assert result.plan.index_filename == "model.safetensors.index.json"
    if not (out / "config.json").exists():
        shutil.copy(src / "config.json", out / "config.json")
    loaded = realign(cls.from_pretrained(out).eval())
    realign(model)
    ids = torch.tensor([[0, 5, 9, 17, 33, 1]])
    with torch.no_grad():
        assert_outputs_close(loaded(ids).last_hidden_state, model(ids).last_hidden_state)


def test_save_sharded_tied_weights_load_back_tied_in_transformers(tmp_path: Path) -> None:
    import torch
    from transformers import BertForMaskedLM

    torch.manual_seed(0)
    model = BertForMaskedLM(tiny_bert_config()).eval()
    decoder = model.cls.predictions.decoder.weight
    assert decoder.data_ptr() == model.bert.embeddings.word_embeddings.weight.data_ptr()
    result = shardkit.save_sharded(model, tmp_path, max_shard_size="4KB", overwrite=True)
    assert result.aliases.get("cls.predictions.decoder.weight") == "bert.embeddings.word_embeddings.weight"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert "cls.predictions.decoder.weight" not in index["weight_map"]
    model.config.save_pretrained(tmp_path)
    loaded = BertForMaskedLM.from_pretrained(tmp_path).eval()
    assert loaded.cls.predictions.decoder.weight.data_ptr() == loaded.bert.embeddings.word_embeddings.weight.data_ptr()
    realign(model)
    realign(loaded)
    ids = torch.tensor([[2, 5, 9, 17, 33]])
    with torch.no_grad():
        assert_outputs_close(loaded(ids).logits, model(ids).logits)
