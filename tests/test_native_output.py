"""``save_sharded`` of diffusers and transformers models: their own layout, so ``from_pretrained(out)`` loads it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch  # noqa: E402  (a hard dependency: a broken install must fail, not skip)
from conftest import TINY_UNET_CONFIG, assert_bit_equal, realign, tiny_unet, unet_forward
from helpers_compare import assert_outputs_close

import shardkit


def _tiny_gpt2(*, tie: bool = True) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, tie_word_embeddings=tie,
                        bos_token_id=0, eos_token_id=1)
    return GPT2LMHeadModel(config).eval()


def _logits(model: Any) -> Any:
    realign(model)
    with torch.no_grad():
        return model(torch.tensor([[0, 5, 9, 17, 33, 1]])).logits


def test_diffusers_model_is_saved_with_diffusers_names_and_config(tmp_path: Path) -> None:
    from diffusers import UNet2DConditionModel

    unet = tiny_unet()
    out = tmp_path / "unet"
    result = shardkit.save_sharded(unet, out, max_shard_size="40KB")
    assert len(result.plan.shards) > 1
    assert result.plan.index_filename == "diffusion_pytorch_model.safetensors.index.json"
    names = sorted(p.name for p in out.iterdir() if p.name != "shardkit.manifest.json")  # loaders ignore it
    assert "config.json" in names
    assert all(n.startswith("diffusion_pytorch_model") for n in names if n != "config.json"), names
    config = json.loads((out / "config.json").read_text())
    assert config["_class_name"] == "UNet2DConditionModel"
    assert config["cross_attention_dim"] == TINY_UNET_CONFIG["cross_attention_dim"]
    loaded = UNet2DConditionModel.from_pretrained(out).eval()
    assert_bit_equal(loaded.state_dict(), unet.state_dict())
    assert_outputs_close(unet_forward(loaded), unet_forward(unet))


def test_diffusers_variant_and_cast_load_with_that_variant(tmp_path: Path) -> None:
    from diffusers import UNet2DConditionModel

    unet = tiny_unet()
    out = tmp_path / "unet"
    shardkit.save_sharded(unet, out, max_shard_size="40KB", variant="fp16", dtype="fp16")
    assert (out / "diffusion_pytorch_model.safetensors.index.fp16.json").is_file()
    assert len(list(out.glob("diffusion_pytorch_model.fp16-0000?-of-0000?.safetensors"))) > 1
    loaded = UNet2DConditionModel.from_pretrained(out, variant="fp16", torch_dtype=torch.float16)
    expected = {k: v.to(torch.float16) for k, v in unet.state_dict().items()}
    assert_bit_equal(loaded.state_dict(), expected)


def test_transformers_model_keeps_the_tied_name_transformers_reloads(tmp_path: Path) -> None:
    """GPT-2 ties lm_head.weight to transformer.wte.weight; sorted order alone would keep lm_head."""
    from transformers import GPT2LMHeadModel

    model = _tiny_gpt2()
    out = tmp_path / "gpt2"
    result = shardkit.save_sharded(model, out, max_shard_size="8KB")
    assert len(result.plan.shards) > 1
    assert result.aliases == {"lm_head.weight": "transformer.wte.weight"}
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "transformer.wte.weight" in index["weight_map"] and "lm_head.weight" not in index["weight_map"]
    assert (out / "generation_config.json").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["dtype"] == "float32"
    assert model.config.architectures is None  # the caller's model is left as it was
    loaded = GPT2LMHeadModel.from_pretrained(out).eval()
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    assert torch.equal(loaded.transformer.wte.weight, model.transformer.wte.weight)
    assert_outputs_close(_logits(loaded), _logits(model))


def test_transformers_untied_variant_and_cast(tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    model = _tiny_gpt2(tie=False)
    out = tmp_path / "gpt2"
    result = shardkit.save_sharded(model, out, max_shard_size="8KB", variant="bf16", dtype="bf16")
    assert result.aliases == {}
    assert (out / "model.safetensors.index.bf16.json").is_file()
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = GPT2LMHeadModel.from_pretrained(out, variant="bf16")
    assert loaded.dtype == torch.bfloat16
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight.to(torch.bfloat16))
    assert not torch.equal(loaded.lm_head.weight, loaded.transformer.wte.weight)


def test_a_plain_module_keeps_the_generic_layout(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 4)
    result = shardkit.save_sharded(model, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors", "shardkit.manifest.json"]
    assert result.plan.filenames() == ["model.safetensors"]


def test_a_quantized_model_is_refused_with_nothing_written(tmp_path: Path) -> None:
    unet = tiny_unet()
    unet.hf_quantizer = object()  # what a quantized from_pretrained leaves on the model
    with pytest.raises(shardkit.InvalidInputError, match="quantized: save it with its own save_pretrained"):
        shardkit.save_sharded(unet, tmp_path / "out")
    assert not (tmp_path / "out").exists()
