"""Pipeline-folder discovery: model_index.json → components with their naming."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from shardkit.errors import InvalidInputError, SourceNotFoundError
from shardkit.formats.layout import find_components, is_pipeline_folder


def _write_pipeline(root, index: dict, files: dict[str, list[str]]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "model_index.json").write_text(json.dumps(index))
    for folder, names in files.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / "config.json").write_text("{}")
        for name in names:
            if name.endswith(".safetensors"):
                save_file({"w": torch.zeros(2)}, str(root / folder / name))
            else:
                (root / folder / name).write_text("x")


SD_INDEX = {
    "_class_name": "StableDiffusionPipeline",
    "_diffusers_version": "0.42.0",
    "unet": ["diffusers", "UNet2DConditionModel"],
    "vae": ["diffusers", "AutoencoderKL"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "scheduler": ["diffusers", "PNDMScheduler"],
    "safety_checker": [None, None],
    "feature_extractor": [None, None],
    "requires_safety_checker": False,
}


def test_finds_components_in_index_order_with_their_naming(tmp_path):
    _write_pipeline(tmp_path / "p", SD_INDEX, {
        "unet": ["diffusion_pytorch_model-00001-of-00002.safetensors",
                 "diffusion_pytorch_model-00002-of-00002.safetensors"],
        "vae": ["diffusion_pytorch_model.safetensors"],
        "text_encoder": ["model.safetensors"],
        "tokenizer": ["vocab.json"],
        "scheduler": ["scheduler_config.json"],
    })
    components = find_components(tmp_path / "p")
    assert [c.name for c in components] == ["unet", "vae", "text_encoder", "tokenizer", "scheduler"]
    by_name = {c.name: c for c in components}
    assert [c.name for c in components if c.has_weights] == ["unet", "vae", "text_encoder"]
    assert by_name["unet"].naming.prefix == "diffusion_pytorch_model"
    assert by_name["unet"].library == "diffusers"
    assert by_name["unet"].class_name == "UNet2DConditionModel"
    assert by_name["text_encoder"].naming.prefix == "model"
    assert by_name["text_encoder"].library == "transformers"
    assert by_name["vae"].path == str(tmp_path / "p" / "vae")
    assert is_pipeline_folder(tmp_path / "p")
    assert not is_pipeline_folder(tmp_path / "p" / "unet")
    assert not is_pipeline_folder(tmp_path / "p" / "model_index.json")


def test_naming_follows_the_files_and_other_libraries(tmp_path):
    index = {"safety_checker": ["stable_diffusion", "StableDiffusionSafetyChecker"],
             "odd": ["diffusers", "SomeModel"]}
    _write_pipeline(tmp_path / "p", index, {
        "safety_checker": ["model.fp16.safetensors"],
        "odd": ["model.safetensors"],   # a diffusers component saved with transformers naming
    })
    by_name = {c.name: c for c in find_components(tmp_path / "p", variant="fp16")}
    assert by_name["safety_checker"].library == "stable_diffusion"
    assert by_name["safety_checker"].naming.prefix == "model"
    assert by_name["safety_checker"].naming.variant == "fp16"
    assert by_name["odd"].naming.prefix == "model"


def test_missing_component_folder_has_no_weights(tmp_path):
    _write_pipeline(tmp_path / "p", {"unet": ["diffusers", "UNet2DConditionModel"]}, {})
    (component,) = find_components(tmp_path / "p")
    assert not component.has_weights
    assert component.naming.prefix == "diffusion_pytorch_model"


@pytest.mark.parametrize("name", ["../escape", "a/b", ".."])
def test_refuses_component_names_that_leave_the_folder(tmp_path, name):
    _write_pipeline(tmp_path / "p", {name: ["diffusers", "UNet2DConditionModel"]}, {})
    with pytest.raises(InvalidInputError, match="not a plain folder name"):
        find_components(tmp_path / "p")


def test_bad_model_index(tmp_path):
    with pytest.raises(SourceNotFoundError, match="model_index.json"):
        find_components(tmp_path)
    (tmp_path / "model_index.json").write_text("[1, 2")
    with pytest.raises(InvalidInputError, match="not valid JSON"):
        find_components(tmp_path)
    (tmp_path / "model_index.json").write_text("[1, 2]")
    with pytest.raises(InvalidInputError, match="JSON object"):
        find_components(tmp_path)
