"""Skeletons on the meta device from classes, factories and configs."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_UNET_CONFIG, tiny_clip_text_config
from helpers_load import make_tied_lm
from torch import nn

from shardkit.errors import InvalidInputError, SourceNotFoundError
from shardkit.loading.skeleton import build_skeleton, cast_floating, is_meta_module, resolve_model_class


def test_resolve_library_strings_classes_and_factories() -> None:
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextModel

    assert resolve_model_class("diffusers:UNet2DConditionModel") is UNet2DConditionModel
    assert resolve_model_class("transformers:CLIPTextModel") is CLIPTextModel
    assert resolve_model_class("torch.nn:Linear") is nn.Linear
    assert resolve_model_class(UNet2DConditionModel) is UNet2DConditionModel
    factory = lambda: nn.Linear(2, 2)  # noqa: E731
    assert resolve_model_class(factory) is factory


@pytest.mark.parametrize("spec", ["diffusers:NoSuchModel", "nosuchlib:Model", "UNet2DConditionModel", "diffusers:",
                                  "diffusers:__version__", 42])
def test_unknown_model_class_is_one_line_error(spec: object) -> None:
    with pytest.raises(InvalidInputError) as info:
        resolve_model_class(spec)
    assert "\n" not in str(info.value)


def test_diffusers_skeleton_from_dict_file_and_folder(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "UNet2DConditionModel", **TINY_UNET_CONFIG}))
    for config in (TINY_UNET_CONFIG, tmp_path / "config.json", tmp_path, str(tmp_path)):
        unet = build_skeleton("diffusers:UNet2DConditionModel", config=config)
        assert is_meta_module(unet)
        assert unet.config.block_out_channels == (8, 16) or list(unet.config.block_out_channels) == [8, 16]


def test_dtype_casts_meta_parameters_and_keeps_fp32_modules() -> None:
    class Net(nn.Module):
        _keep_in_fp32_modules = ["norm"]

        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.norm = nn.LayerNorm(4)
            self.register_buffer("steps", torch.arange(3))

    net = build_skeleton(Net, dtype="bf16")
    assert net.proj.weight.dtype == torch.bfloat16 and net.proj.weight.is_meta
    assert net.norm.weight.dtype == torch.float32
    assert net.steps.dtype == torch.int64  # integer buffers are never cast


def test_transformers_skeleton_from_config_dict() -> None:
    config = tiny_clip_text_config().to_dict()
    model = build_skeleton("transformers:CLIPTextModel", config=config, dtype=torch.float16)
    assert is_meta_module(model)
    assert type(model).__name__ == "CLIPTextModel"
    assert model.get_submodule(next(n for n, _ in model.named_modules() if n.endswith("final_layer_norm"))).weight.dtype == torch.float16


def test_factory_gets_config_keys_as_keyword_arguments() -> None:
    model = build_skeleton(nn.Linear, config={"in_features": 3, "out_features": 5})
    assert model.weight.shape == (5, 3) and model.weight.is_meta


def test_meta_module_is_returned_as_is_and_ties_survive_casting() -> None:
    lm = build_skeleton(make_tied_lm())
    assert lm.head.weight is lm.embed.weight, "a tie made in __init__ must survive init_empty_weights"
    assert build_skeleton(lm) is lm
    cast_floating(lm, lambda name: torch.float16)
    assert lm.head.weight is lm.embed.weight and lm.head.weight.dtype == torch.float16


def test_refuses_modules_with_weights_and_missing_configs(tmp_path) -> None:
    with pytest.raises(InvalidInputError, match="already holds weights"):
        build_skeleton(nn.Linear(2, 2))
    with pytest.raises(InvalidInputError, match="needs a config"):
        build_skeleton("diffusers:UNet2DConditionModel")
    with pytest.raises(SourceNotFoundError, match="config.json"):
        build_skeleton("diffusers:UNet2DConditionModel", config=tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(InvalidInputError, match="not valid JSON"):
        build_skeleton("diffusers:UNet2DConditionModel", config=tmp_path)
    with pytest.raises(InvalidInputError, match="not an nn.Module"):
        build_skeleton(lambda: 3)
