"""``convert --to diffusers``: a single-file (LDM) SD checkpoint → a diffusers model folder, via diffusers' own mapping.

The LDM checkpoint is made from small diffusers models with the inverse of diffusers'
conversion (the mapping of diffusers' ``scripts/convert_diffusers_to_original_stable_diffusion.py``),
so converting it back must give the original weights exactly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch  # noqa: E402  (hard dependencies: a broken install must fail, not skip)
from conftest import assert_bit_equal, assert_one_line_error, leftovers

import shardkit

# SD 1.x layout (4 blocks, 2 layers each, attention in the first three), shrunk.
SD_LIKE_UNET = {
    "sample_size": 8, "in_channels": 4, "out_channels": 4, "layers_per_block": 2,
    "block_out_channels": [8, 8, 16, 16], "norm_num_groups": 4, "cross_attention_dim": 8, "attention_head_dim": 2,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
}
SD_LIKE_VAE = {
    "in_channels": 3, "out_channels": 3, "latent_channels": 4, "block_out_channels": [8, 8, 16, 16],
    "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
    "layers_per_block": 2, "norm_num_groups": 4, "sample_size": 16,
}
CLIP_KEY = "cond_stage_model.transformer.text_model.embeddings.position_embedding.weight"


def _unet_layer_map() -> list[tuple[str, str]]:
    """(LDM, diffusers) prefixes of the SD 1.x UNet blocks."""
    pairs = []
    for i in range(4):
        for j in range(2):
            pairs.append((f"input_blocks.{3 * i + j + 1}.0.", f"down_blocks.{i}.resnets.{j}."))
            if i < 3:
                pairs.append((f"input_blocks.{3 * i + j + 1}.1.", f"down_blocks.{i}.attentions.{j}."))
        for j in range(3):
            pairs.append((f"output_blocks.{3 * i + j}.0.", f"up_blocks.{i}.resnets.{j}."))
            if i > 0:
                pairs.append((f"output_blocks.{3 * i + j}.1.", f"up_blocks.{i}.attentions.{j}."))
        if i < 3:
            pairs.append((f"input_blocks.{3 * (i + 1)}.0.op.", f"down_blocks.{i}.downsamplers.0.conv."))
            pairs.append((f"output_blocks.{3 * i + 2}.{1 if i == 0 else 2}.", f"up_blocks.{i}.upsamplers.0."))
    pairs.append(("middle_block.1.", "mid_block.attentions.0."))
    pairs += [(f"middle_block.{2 * j}.", f"mid_block.resnets.{j}.") for j in range(2)]
    return pairs


UNET_TOP = {"time_embedding.linear_1.": "time_embed.0.", "time_embedding.linear_2.": "time_embed.2.",
            "conv_in.": "input_blocks.0.0.", "conv_norm_out.": "out.0.", "conv_out.": "out.2."}
UNET_RESNET = [("in_layers.0", "norm1"), ("in_layers.2", "conv1"), ("out_layers.0", "norm2"),
               ("out_layers.3", "conv2"), ("emb_layers.1", "time_emb_proj"), ("skip_connection", "conv_shortcut")]


def unet_to_ldm(state: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, tensor in state.items():
        ldm = next((new + name[len(old):] for old, new in UNET_TOP.items() if name.startswith(old)), name)
        if "resnets" in name:
            for sd_part, hf_part in UNET_RESNET:
                ldm = ldm.replace(hf_part, sd_part)
        for sd_part, hf_part in _unet_layer_map():
            ldm = ldm.replace(hf_part, sd_part)
        out["model.diffusion_model." + ldm] = tensor
    return out


def _vae_map() -> list[tuple[str, str]]:
    pairs = [("nin_shortcut", "conv_shortcut"), ("norm_out", "conv_norm_out"), ("mid.attn_1.", "mid_block.attentions.0.")]
    for i in range(4):
        pairs += [(f"encoder.down.{i}.block.{j}.", f"encoder.down_blocks.{i}.resnets.{j}.") for j in range(2)]
        if i < 3:
            pairs += [(f"down.{i}.downsample.", f"down_blocks.{i}.downsamplers.0."),
                      (f"up.{3 - i}.upsample.", f"up_blocks.{i}.upsamplers.0.")]
        pairs += [(f"decoder.up.{3 - i}.block.{j}.", f"decoder.up_blocks.{i}.resnets.{j}.") for j in range(3)]
    pairs += [(f"mid.block_{i + 1}.", f"mid_block.resnets.{i}.") for i in range(2)]
    return pairs


VAE_ATTN = [("norm.", "group_norm."), ("q.", "to_q."), ("k.", "to_k."), ("v.", "to_v."), ("proj_out.", "to_out.0.")]


def vae_to_ldm(state: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, tensor in state.items():
        ldm = name
        for sd_part, hf_part in _vae_map():
            ldm = ldm.replace(hf_part, sd_part)
        if "attentions" in name:
            for sd_part, hf_part in VAE_ATTN:
                ldm = ldm.replace(hf_part, sd_part)
            if tensor.dim() == 2:  # LDM's attention projections are 1x1 convolutions
                tensor = tensor.reshape(*tensor.shape, 1, 1)
        out["first_stage_model." + ldm] = tensor
    return out


@pytest.fixture(scope="module", name="sd_models")
def fixture_sd_models() -> tuple[Any, Any]:
    from diffusers import AutoencoderKL, UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(**SD_LIKE_UNET).eval(), AutoencoderKL(**SD_LIKE_VAE).eval()


@pytest.fixture(name="ldm_checkpoint")
def fixture_ldm_checkpoint(tmp_path: Path, sd_models: tuple[Any, Any]) -> dict[str, Any]:
    unet, vae = sd_models
    state = {**unet_to_ldm(unet.state_dict()), **vae_to_ldm(vae.state_dict())}
    state[CLIP_KEY] = torch.randn(77, 8)  # a text encoder the unet and vae leave out
    return {k: v.contiguous() for k, v in state.items()}


@pytest.fixture(name="pipeline_config")
def fixture_pipeline_config(tmp_path: Path, sd_models: tuple[Any, Any]) -> Path:
    """A pipeline folder holding only configs (all that --config reads)."""
    unet, vae = sd_models
    folder = tmp_path / "sd-config"
    unet.save_config(folder / "unet")
    vae.save_config(folder / "vae")
    index = {"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"],
             "vae": ["diffusers", "AutoencoderKL"], "text_encoder": ["transformers", "CLIPTextModel"]}
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


def test_ldm_safetensors_to_diffusers_unet_through_the_cli(tmp_path: Path, run_cli, sd_models, ldm_checkpoint,
                                                          pipeline_config) -> None:
    from diffusers import UNet2DConditionModel
    from safetensors.torch import save_file

    src = tmp_path / "sd.safetensors"
    save_file(ldm_checkpoint, src)
    out = tmp_path / "unet"
    result = run_cli("convert", src, out, "--to", "diffusers", "--config", pipeline_config, "--max-shard-size", "40KB")
    assert result.exit_code == 0, result.stderr
    assert "not part of this model" in result.stdout
    assert (out / "config.json").is_file() and (out / "diffusion_pytorch_model.safetensors.index.json").is_file()
    assert len(list(out.glob("diffusion_pytorch_model-*.safetensors"))) > 1
    loaded = UNet2DConditionModel.from_pretrained(out)
    assert_bit_equal(loaded.state_dict(), sd_models[0].state_dict())
    assert leftovers(tmp_path) == []


def test_ldm_ckpt_to_diffusers_vae_with_component_and_variant(tmp_path: Path, run_cli, sd_models, ldm_checkpoint,
                                                             pipeline_config) -> None:
    from diffusers import AutoencoderKL

    src = tmp_path / "sd.ckpt"
    torch.save({"state_dict": ldm_checkpoint, "global_step": 10}, src)
    out = tmp_path / "vae"
    result = run_cli("convert", src, out, "--to", "diffusers", "--config", pipeline_config, "--component", "vae",
                     "--variant", "fp16", "--dtype", "fp16", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["index"] is None
    assert (out / "diffusion_pytorch_model.fp16.safetensors").is_file()
    loaded = AutoencoderKL.from_pretrained(out, variant="fp16", torch_dtype=torch.float16)
    assert_bit_equal(loaded.state_dict(), {k: v.half() for k, v in sd_models[1].state_dict().items()})


def test_python_api_with_a_config_file(tmp_path: Path, sd_models, ldm_checkpoint, pipeline_config) -> None:
    from diffusers import UNet2DConditionModel

    src = tmp_path / "sd.pt"
    torch.save(ldm_checkpoint, src)
    result = shardkit.convert(src, tmp_path / "unet", to="diffusers", config=pipeline_config / "unet" / "config.json")
    assert result.dropped == len(ldm_checkpoint) - len(sd_models[0].state_dict())
    loaded = UNet2DConditionModel.from_pretrained(tmp_path / "unet")
    assert_bit_equal(loaded.state_dict(), sd_models[0].state_dict())


def test_without_config_the_error_names_the_model_and_what_to_pass(tmp_path: Path, run_cli, ldm_checkpoint) -> None:
    from safetensors.torch import save_file

    src = tmp_path / "sd.safetensors"
    save_file(ldm_checkpoint, src)
    line = assert_one_line_error(run_cli("convert", src, tmp_path / "out", "--to", "diffusers"), contains="--config")
    assert "'v1' checkpoint" in line and "never downloads" in line
    assert not (tmp_path / "out").exists()


def test_an_unknown_model_type_is_a_one_line_error(tmp_path: Path, run_cli, pipeline_config) -> None:
    from safetensors.torch import save_file

    src = tmp_path / "other.safetensors"
    save_file({"encoder.weight": torch.randn(4, 4), "decoder.weight": torch.randn(4, 4)}, src)
    for extra in ([], ["--config", str(pipeline_config)]):
        assert_one_line_error(run_cli("convert", src, tmp_path / "out", "--to", "diffusers", *extra),
                              contains="not a single-file checkpoint diffusers can convert")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, message", [
    (["--config", "{cfg}/nowhere"], "no config.json there"),
    (["--config", "{cfg}", "--component", "text_encoder"], "is a transformers CLIPTextModel"),
    (["--config", "{cfg}", "--component", "scheduler"], "no component 'scheduler'"),
    (["--config", "{cfg}/unet", "--component", "vae"], "applies to a pipeline folder"),
    (["--config", "{cfg}", "--strip-prefix", "model."], "do not apply with --to diffusers"),
    (["--component", "unet"], "apply with --to diffusers"),
])
def test_config_errors_exit_2_with_one_line(tmp_path: Path, run_cli, ldm_checkpoint, pipeline_config,
                                            args: list[str], message: str) -> None:
    from safetensors.torch import save_file

    src = tmp_path / "sd.safetensors"
    save_file(ldm_checkpoint, src)
    to = [] if args == ["--component", "unet"] else ["--to", "diffusers"]
    argv = [a.replace("{cfg}", str(pipeline_config)) for a in args]
    assert_one_line_error(run_cli("convert", src, tmp_path / "out", *to, *argv), contains=message)
    assert not (tmp_path / "out").exists()


def test_a_config_of_another_model_says_which_parameters_are_missing(tmp_path: Path, run_cli, sd_models,
                                                                     pipeline_config) -> None:
    from safetensors.torch import save_file

    src = tmp_path / "unet-only.safetensors"
    save_file({k: v.contiguous() for k, v in unet_to_ldm(sd_models[0].state_dict()).items()}, src)
    line = assert_one_line_error(run_cli("convert", src, tmp_path / "out", "--to", "diffusers", "--config",
                                         pipeline_config, "--component", "vae"))
    assert "does not convert into the AutoencoderKL" in line and "parameters are not in the converted" in line


def test_renamed_and_sliced_tensors_keep_their_place_in_the_file(tmp_path: Path, sd_models, ldm_checkpoint) -> None:
    """Tensors diffusers only renames (or reshapes in place) are runs of the file: the writer copies them kernel-side."""
    from safetensors.torch import save_file

    from shardkit.layouts.diffusers import find_target
    from shardkit.sharding.to_diffusers_pipeline import convert_checkpoint
    from shardkit.sources.file_backed import file_backed_source, load_file_backed

    src = tmp_path / "sd.safetensors"
    save_file(ldm_checkpoint, src)
    vae_folder = tmp_path / "vae-config"
    sd_models[1].save_config(vae_folder)
    backing = load_file_backed(str(src))
    converted, _ = convert_checkpoint(backing.tensors, find_target(vae_folder), where=str(src))
    with file_backed_source(converted, backing, description="vae") as source:
        entries = source.entries()
        assert all(e.file == str(src) for e in entries), [e.name for e in entries if e.file is None]
        for entry in entries:
            assert bytes(source.read(entry, 0, entry.nbytes)) == bytes(
                converted[entry.name].contiguous().reshape(-1).view(torch.uint8).numpy())
    attention = "encoder.mid_block.attentions.0.to_q.weight"  # a 1x1 conv in the file, a matrix in diffusers
    assert ldm_checkpoint["first_stage_model.encoder.mid.attn_1.q.weight"].dim() == 4 and converted[attention].dim() == 2


SD15_UNET = {**SD_LIKE_UNET, "sample_size": 64, "block_out_channels": [320, 640, 1280, 1280],
             "cross_attention_dim": 768, "attention_head_dim": 8, "norm_num_groups": 32}


@pytest.mark.slow
def test_an_sd15_sized_unet_converts_without_the_checkpoint_in_memory(tmp_path: Path) -> None:
    """860M parameters (1.7 GB in fp16): the converting process stays far below the checkpoint's size."""
    import subprocess
    import sys

    from diffusers import UNet2DConditionModel
    from safetensors.torch import save_file

    with torch.device("meta"):
        model = UNet2DConditionModel(**SD15_UNET)
    model.save_config(tmp_path / "unet-config")
    state = {k: torch.full(v.shape, 0.5, dtype=torch.float16) for k, v in model.state_dict().items()}
    src = tmp_path / "sd15.safetensors"
    save_file(unet_to_ldm(state), src)
    del state
    run = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
           "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)")
    shardkit_bin = Path(sys.executable).with_name("shardkit")
    done = subprocess.run([sys.executable, "-c", run, str(shardkit_bin), "convert", str(src), str(tmp_path / "unet"),
                           "--to", "diffusers", "--config", str(tmp_path / "unet-config"), "-q"],
                          capture_output=True, text=True, check=True)
    peak_rss_bytes = int(done.stdout.split()[-1])
    assert peak_rss_bytes < src.stat().st_size / 2, (peak_rss_bytes, src.stat().st_size)
    header = shardkit.read_header(tmp_path / "unet" / "diffusion_pytorch_model.safetensors")
    assert {e.name for e in header.entries} == set(model.state_dict())


def test_a_flux_checkpoint_is_recognised_and_a_wrong_config_is_named(tmp_path: Path, run_cli) -> None:
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import save_file

    src = tmp_path / "flux.safetensors"
    save_file({"double_blocks.0.img_attn.norm.key_norm.scale": torch.ones(4), "img_in.weight": torch.ones(8, 64),
               "guidance_in.in_layer.bias": torch.ones(8)}, src)
    line = assert_one_line_error(run_cli("convert", src, tmp_path / "out", "--to", "diffusers"))
    assert "'flux-dev' checkpoint" in line and "black-forest-labs/FLUX.1-dev" in line
    with torch.device("meta"):
        FluxTransformer2DModel(num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
                               joint_attention_dim=16, pooled_projection_dim=8,
                               axes_dims_rope=[2, 2, 4]).save_config(tmp_path / "transformer")
    line = assert_one_line_error(run_cli("convert", src, tmp_path / "out", "--to", "diffusers", "--config",
                                         tmp_path / "transformer"))
    assert "does not convert into the FluxTransformer2DModel" in line and "diffusers' conversion failed" in line
    assert not (tmp_path / "out").exists()


def _sd_pipeline_folders(tmp_path: Path, sd_models: tuple[Any, Any]) -> tuple[Any, Path]:
    """A reference SD pipeline (SD-like unet/vae, tiny CLIP) and a copy of its folder with configs only."""
    import shutil

    from conftest import tiny_clip_text_config
    from diffusers import DDIMScheduler, StableDiffusionPipeline
    from helpers_pipeline import write_tiny_clip_tokenizer_files
    from transformers import CLIPTextModel, CLIPTokenizer

    torch.manual_seed(1)
    vocab, merges = write_tiny_clip_tokenizer_files(tmp_path / "tok-src")
    text_encoder = CLIPTextModel(tiny_clip_text_config()).eval()
    pipe = StableDiffusionPipeline(unet=sd_models[0], vae=sd_models[1], text_encoder=text_encoder,
                                   tokenizer=CLIPTokenizer(str(vocab), str(merges), model_max_length=16),
                                   scheduler=DDIMScheduler(), safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    configs = tmp_path / "sd-configs"
    pipe.save_pretrained(tmp_path / "reference")
    shutil.copytree(tmp_path / "reference", configs, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    return pipe, configs


def test_a_whole_pipeline_with_its_text_encoder(tmp_path: Path, run_cli, sd_models, ldm_checkpoint) -> None:
    from diffusers import StableDiffusionPipeline
    from safetensors.torch import save_file

    pipe, configs = _sd_pipeline_folders(tmp_path, sd_models)
    del ldm_checkpoint[CLIP_KEY]  # the placeholder; the real text encoder follows
    ldm_checkpoint.update({f"cond_stage_model.transformer.text_model.{k}": v.clone()
                           for k, v in pipe.text_encoder.state_dict().items()})
    src = tmp_path / "sd.safetensors"
    save_file(ldm_checkpoint, src)
    out = tmp_path / "pipeline"
    result = run_cli("convert", src, out, "--to", "diffusers", "--config", configs, "--component", "all", "--json")
    assert result.exit_code == 0, result.stderr
    assert sorted(json.loads(result.stdout)["components"]) == ["text_encoder", "unet", "vae"]
    loaded = StableDiffusionPipeline.from_pretrained(out)
    for name in ("unet", "vae", "text_encoder"):
        assert_bit_equal(getattr(loaded, name).state_dict(), getattr(pipe, name).state_dict())
    assert (out / "tokenizer" / "tokenizer_config.json").is_file() and (out / "text_encoder" / "model.safetensors").is_file()


def test_a_pipeline_component_neither_in_the_checkpoint_nor_in_the_config(tmp_path: Path, run_cli, sd_models,
                                                                           ldm_checkpoint) -> None:
    from safetensors.torch import save_file

    _, configs = _sd_pipeline_folders(tmp_path, sd_models)
    src = tmp_path / "sd.safetensors"
    save_file({k: v for k, v in ldm_checkpoint.items() if k != CLIP_KEY}, src)
    line = assert_one_line_error(run_cli("convert", src, tmp_path / "out", "--to", "diffusers", "--config", configs,
                                         "--component", "all"))
    assert "text_encoder (CLIPTextModel) is not in" in line and "has no weights for it" in line
    assert not (tmp_path / "out").exists()


def test_source_and_config_in_a_bucket(tmp_path: Path, s3_env, run_cli, ldm_checkpoint, pipeline_config) -> None:
    """``--config s3://...`` reads the configs only; an ``s3://`` single file is refused in one line (not mapped)."""
    from safetensors.torch import save_file

    save_file(ldm_checkpoint, tmp_path / "sd.safetensors")
    s3_env.put("sd/sd.safetensors", (tmp_path / "sd.safetensors").read_bytes())
    for path in sorted(pipeline_config.rglob("*.json")):
        s3_env.put(f"sd-config/{path.relative_to(pipeline_config).as_posix()}", path.read_bytes())
    shardkit.convert(tmp_path / "sd.safetensors", tmp_path / "local", to="diffusers", config=pipeline_config / "unet")
    shardkit.convert(tmp_path / "sd.safetensors", tmp_path / "remote", to="diffusers",
                     config=f"s3://{s3_env.bucket}/sd-config/unet")
    local = {p.name: p.read_bytes() for p in (tmp_path / "local").iterdir()}
    assert local and {p.name: p.read_bytes() for p in (tmp_path / "remote").iterdir()} == local
    line = assert_one_line_error(run_cli("convert", f"s3://{s3_env.bucket}/sd", tmp_path / "x", "--to", "diffusers",
                                         "--config", pipeline_config / "unet"), contains="convert a local copy")
    assert f"s3://{s3_env.bucket}/sd" in line and "HF cache" not in line
