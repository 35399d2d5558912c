"""``convert --to single-file``: diffusers folders → original single-file layouts, proven by diffusers' own loader.

Every model is built from a shrunk diffusers config with random weights and saved by diffusers;
the exported file must load with ``from_single_file(..., config=FOLDER, local_files_only=True)``
bit-equal, convert back with ``--to diffusers`` to the same tensors, and (pipelines) generate
the same image for the same seed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch  # noqa: E402  (hard dependencies: a broken install must fail, not skip)
from conftest import assert_bit_equal, assert_one_line_error, leftovers, load_folder
from test_convert_diffusers import SD_LIKE_UNET, SD_LIKE_VAE

import shardkit

SD2_UNET = {**SD_LIKE_UNET, "use_linear_projection": True, "attention_head_dim": [2, 2, 4, 4],
            "cross_attention_dim": 16}
SDXL_UNET = {
    "sample_size": 8, "in_channels": 4, "out_channels": 4, "layers_per_block": 2, "block_out_channels": [8, 16, 16],
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "transformer_layers_per_block": [1, 2, 2], "attention_head_dim": [2, 4, 4], "use_linear_projection": True,
    "addition_embed_type": "text_time", "addition_time_embed_dim": 8, "projection_class_embeddings_input_dim": 64,
    "cross_attention_dim": 40, "norm_num_groups": 4,
}
SD3 = {"sample_size": 8, "patch_size": 2, "in_channels": 4, "num_layers": 2, "attention_head_dim": 8,
       "num_attention_heads": 2, "joint_attention_dim": 16, "caption_projection_dim": 16, "pooled_projection_dim": 8,
       "out_channels": 4, "pos_embed_max_size": 16}
SD35 = {**SD3, "num_layers": 3, "qk_norm": "rms_norm", "dual_attention_layers": [0, 1]}
# (diffusers class, config, model type recorded in the header, a name the original layout has)
MODELS = {
    "sd1-unet": ("UNet2DConditionModel", SD_LIKE_UNET, "sd1", "model.diffusion_model.output_blocks.11.0.skip_connection.weight"),
    "sd2-unet": ("UNet2DConditionModel", SD2_UNET, "sd2", "model.diffusion_model.input_blocks.1.1.proj_in.weight"),
    "sdxl-unet": ("UNet2DConditionModel", SDXL_UNET, "sdxl", "model.diffusion_model.label_emb.0.0.weight"),
    "vae": ("AutoencoderKL", SD_LIKE_VAE, "vae", "encoder.mid.attn_1.q.weight"),
    "sd3": ("SD3Transformer2DModel", SD3, "sd3", "model.diffusion_model.joint_blocks.1.context_block.attn.qkv.weight"),
    "sd35": ("SD3Transformer2DModel", SD35, "sd3", "model.diffusion_model.joint_blocks.0.x_block.attn2.qkv.weight"),
}


def _build(class_name: str, config: dict[str, Any], folder: Path, *, seed: int = 0, **save: Any) -> Any:
    import diffusers

    torch.manual_seed(seed)
    model = getattr(diffusers, class_name)(**config).eval()
    with torch.no_grad():  # norms start at 1/0: randomise every tensor so that a swapped one shows
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    model.save_pretrained(folder, **save)
    return model


def _header_metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return dict(f.metadata())


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """diffusers must find everything in the local folders: any Hub access fails the test."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_a_model_exports_loads_with_from_single_file_and_converts_back(tmp_path: Path, run_cli, kind: str) -> None:
    import diffusers

    class_name, config, model_type, original_name = MODELS[kind]
    model = _build(class_name, config, tmp_path / "model")
    out = tmp_path / "model.safetensors"
    result = run_cli("convert", tmp_path / "model", out, "--to", "single-file", "--json")
    assert result.exit_code == 0, result.stderr
    assert _header_metadata(out) == {"format": "pt", "converted_from": "diffusers", "model_type": model_type}
    assert original_name in shardkit.read_header(out).by_name()

    cls = getattr(diffusers, class_name)
    loaded = cls.from_single_file(str(out), config=str(tmp_path / "model"), local_files_only=True)
    assert_bit_equal(loaded.state_dict(), model.state_dict())

    back = run_cli("convert", out, tmp_path / "back", "--to", "diffusers", "--config", tmp_path / "model")
    assert back.exit_code == 0, back.stderr
    assert_bit_equal(load_folder(tmp_path / "back"), load_folder(tmp_path / "model"))
    assert leftovers(tmp_path) == []


def test_fused_tensors_are_assembled_and_the_rest_stays_in_place(tmp_path: Path) -> None:
    """Only q/k/v fusions and swapped adaLN halves are built in memory; every other tensor points into the folder."""
    from shardkit.layouts.single_file_export import plan_export, trace_part
    from shardkit.sources.original_layout import OriginalLayoutSource

    _build("SD3Transformer2DModel", SD3, tmp_path / "sd3")
    _, parts = plan_export(str(tmp_path / "sd3"), component=None)
    with OriginalLayoutSource.open(parts, variant=None, trace=trace_part, metadata={}, description="sd3") as src:
        built = sorted(e.name.removeprefix("model.diffusion_model.") for e in src.entries() if e.file is None)
        in_place = [e for e in src.entries() if e.file is not None]
    assert built == sorted([f"joint_blocks.{i}.{side}.attn.qkv.{w}" for i in range(2)
                            for side in ("x_block", "context_block") for w in ("weight", "bias")]
                           + [f"{block}.adaLN_modulation.1.{w}" for block in ("final_layer", "joint_blocks.1.context_block")
                              for w in ("weight", "bias")])
    assert in_place and all(e.file.endswith("diffusion_pytorch_model.safetensors") for e in in_place)


def test_dtype_and_variant(tmp_path: Path, run_cli) -> None:
    from diffusers import UNet2DConditionModel

    model = _build("UNet2DConditionModel", SD_LIKE_UNET, tmp_path / "unet", variant="fp16")
    out = tmp_path / "unet.safetensors"
    result = run_cli("convert", tmp_path / "unet", out, "--to", "single-file", "--variant", "fp16", "--dtype", "fp16")
    assert result.exit_code == 0, result.stderr
    assert {e.dtype for e in shardkit.read_header(out).entries} == {"F16"}
    loaded = UNet2DConditionModel.from_single_file(str(out), config=str(tmp_path / "unet"), local_files_only=True,
                                                   torch_dtype=torch.float16)
    assert_bit_equal(loaded.state_dict(), {k: v.half() for k, v in model.state_dict().items()})


def test_a_folder_output_gets_shards_an_index_and_a_manifest(tmp_path: Path, run_cli) -> None:
    _build("SD3Transformer2DModel", SD3, tmp_path / "sd3")
    out = tmp_path / "sd3-single"
    result = run_cli("convert", tmp_path / "sd3", out, "--to", "single-file", "--max-shard-size", "20KB")
    assert result.exit_code == 0, result.stderr
    assert (out / "model.safetensors.index.json").is_file() and (out / "shardkit.manifest.json").is_file()
    assert shardkit.verify(out).ok
    whole = tmp_path / "sd3.safetensors"
    assert run_cli("convert", tmp_path / "sd3", whole, "--to", "single-file").exit_code == 0
    from safetensors.torch import load_file

    assert_bit_equal(load_folder(out), load_file(str(whole)))


def test_pickled_and_sharded_diffusers_folders(tmp_path: Path, run_cli) -> None:
    """Older folders hold diffusion_pytorch_model.bin; big ones an index and shards."""
    from diffusers import SD3Transformer2DModel

    model = _build("SD3Transformer2DModel", SD3, tmp_path / "bin", safe_serialization=False)
    _build("SD3Transformer2DModel", SD3, tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    for kind in ("bin", "sharded"):
        out = tmp_path / f"{kind}.safetensors"
        assert run_cli("convert", tmp_path / kind, out, "--to", "single-file").exit_code == 0
        loaded = SD3Transformer2DModel.from_single_file(str(out), config=str(tmp_path / kind), local_files_only=True)
        assert_bit_equal(loaded.state_dict(), model.state_dict())


def test_an_incomplete_folder_is_refused(tmp_path: Path, run_cli) -> None:
    from safetensors.torch import load_file, save_file

    _build("UNet2DConditionModel", SD_LIKE_UNET, tmp_path / "unet")
    weights = tmp_path / "unet" / "diffusion_pytorch_model.safetensors"
    state = load_file(str(weights))
    del state["conv_in.weight"]  # diffusers' LDM mapping skips a missing top-level tensor without a word
    save_file(state, str(weights))
    line = assert_one_line_error(run_cli("convert", tmp_path / "unet", tmp_path / "o.safetensors", "--to",
                                         "single-file"), contains="misses 1 of its tensors")
    assert "conv_in.weight" in line and not (tmp_path / "o.safetensors").exists()


# ----------------------------------------------------------------------------- pipelines


def _text_encoder(tokenizer: Any, *, hidden: int, act: str = "quick_gelu", projection: bool = False) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                            num_attention_heads=2, num_hidden_layers=2, max_position_embeddings=16,
                            projection_dim=16, hidden_act=act, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=1)
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config).eval()


def _sd2_pipeline(scratch: Path) -> Any:
    """SD 2.x: an OpenCLIP text encoder (gelu), a linear-projection UNet."""
    from diffusers import UNet2DConditionModel
    from helpers_pipeline import build_tiny_sd_pipeline

    pipe = build_tiny_sd_pipeline(scratch, seed=2)
    torch.manual_seed(3)
    pipe.text_encoder = _text_encoder(pipe.tokenizer, hidden=32, act="gelu")
    pipe.unet = UNet2DConditionModel(**{**pipe.unet.config, "use_linear_projection": True}).eval()
    pipe.register_modules(text_encoder=pipe.text_encoder, unet=pipe.unet)
    return pipe


def _sdxl_shared(scratch: Path, *, seed: int) -> tuple[Any, Any]:
    """A tiny CLIP tokenizer and a 2-block VAE, as SDXL base and refiner pipelines use them."""
    from diffusers import AutoencoderKL
    from helpers_pipeline import write_tiny_clip_tokenizer_files
    from transformers import CLIPTokenizer

    torch.manual_seed(seed)
    vocab, merges = write_tiny_clip_tokenizer_files(scratch / "tok-src")
    vae = AutoencoderKL(block_out_channels=(8, 8), latent_channels=4, norm_num_groups=4, sample_size=32,
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2)
    return CLIPTokenizer(str(vocab), str(merges), model_max_length=16), vae.eval()


def _sdxl_pipeline(scratch: Path) -> Any:
    """SDXL base: CLIP-L (hidden 16) and OpenCLIP-bigG with projection (hidden 24), as in the real one they differ."""
    from diffusers import (
        EulerDiscreteScheduler,
        StableDiffusionXLPipeline,
        UNet2DConditionModel,
    )

    tokenizer, vae = _sdxl_shared(scratch, seed=4)
    return StableDiffusionXLPipeline(
        vae=vae, unet=UNet2DConditionModel(**SDXL_UNET).eval(), scheduler=EulerDiscreteScheduler(),
        text_encoder=_text_encoder(tokenizer, hidden=16), tokenizer=tokenizer,
        text_encoder_2=_text_encoder(tokenizer, hidden=24, act="gelu", projection=True), tokenizer_2=tokenizer)


def _sd1_pipeline(scratch: Path) -> Any:
    from helpers_pipeline import build_tiny_sd_pipeline

    return build_tiny_sd_pipeline(scratch, seed=1)


PIPELINES = {"sd1": (_sd1_pipeline, "StableDiffusionPipeline", "cond_stage_model.transformer.text_model."),
             "sd2": (_sd2_pipeline, "StableDiffusionPipeline", "cond_stage_model.model.transformer.resblocks.1.attn."),
             "sdxl": (_sdxl_pipeline, "StableDiffusionXLPipeline", "conditioner.embedders.1.model.text_projection")}


@pytest.mark.parametrize("kind", sorted(PIPELINES))
def test_a_pipeline_exports_with_component_all_and_generates_the_same_image(tmp_path: Path, run_cli, kind: str) -> None:
    import diffusers
    import numpy as np
    from helpers_pipeline import generate

    build, pipeline_class, text_key = PIPELINES[kind]
    pipe = build(tmp_path)
    pipe.save_pretrained(tmp_path / "pipeline")
    out = tmp_path / f"{kind}.safetensors"
    result = run_cli("convert", tmp_path / "pipeline", out, "--to", "single-file", "--component", "all")
    assert result.exit_code == 0, result.stderr
    assert _header_metadata(out)["model_type"] == kind
    names = shardkit.read_header(out).by_name()
    assert any(n.startswith(text_key) for n in names), sorted(names)[:5]
    assert any(n.startswith("first_stage_model.") for n in names) and any(n.startswith("model.diffusion_model.")
                                                                          for n in names)

    loaded = getattr(diffusers, pipeline_class).from_single_file(str(out), config=str(tmp_path / "pipeline"),
                                                                 local_files_only=True)
    models = [n for n in ("unet", "vae", "text_encoder", "text_encoder_2") if hasattr(pipe, n)]
    for name in models:
        assert_bit_equal(getattr(loaded, name).state_dict(), getattr(pipe, name).state_dict())
    assert np.array_equal(generate(loaded), generate(pipe))

    back = run_cli("convert", out, tmp_path / "back", "--to", "diffusers", "--config", tmp_path / "pipeline",
                   "--component", "all")
    assert back.exit_code == 0, back.stderr
    for name in models:
        assert_bit_equal(load_folder(tmp_path / "back" / name), load_folder(tmp_path / "pipeline" / name))


def test_the_sdxl_refiner_pipeline(tmp_path: Path, run_cli) -> None:
    """The refiner has only the OpenCLIP text encoder, as conditioner.embedders.0."""
    import numpy as np
    from diffusers import (
        EulerDiscreteScheduler,
        StableDiffusionXLImg2ImgPipeline,
        UNet2DConditionModel,
    )

    tokenizer, vae = _sdxl_shared(tmp_path, seed=5)
    unet = UNet2DConditionModel(**{**SDXL_UNET, "cross_attention_dim": 24, "projection_class_embeddings_input_dim": 56})
    pipe = StableDiffusionXLImg2ImgPipeline(
        vae=vae, unet=unet.eval(), scheduler=EulerDiscreteScheduler(), text_encoder=None, tokenizer=None,
        text_encoder_2=_text_encoder(tokenizer, hidden=24, act="gelu", projection=True), tokenizer_2=tokenizer,
        requires_aesthetics_score=True)
    pipe.save_pretrained(tmp_path / "refiner")
    out = tmp_path / "refiner.safetensors"
    assert run_cli("convert", tmp_path / "refiner", out, "--to", "single-file", "--component", "all").exit_code == 0
    assert _header_metadata(out)["model_type"] == "sdxl-refiner"
    assert "conditioner.embedders.0.model.text_projection" in shardkit.read_header(out).by_name()
    loaded = StableDiffusionXLImg2ImgPipeline.from_single_file(str(out), config=str(tmp_path / "refiner"),
                                                               local_files_only=True)
    for name in ("unet", "vae", "text_encoder_2"):
        assert_bit_equal(getattr(loaded, name).state_dict(), getattr(pipe, name).state_dict())
    image = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))

    def refine(p: Any) -> Any:
        p.set_progress_bar_config(disable=True)
        return p("a photo of a cat", image=image, num_inference_steps=2, strength=0.9, output_type="np",
                 generator=torch.Generator().manual_seed(0)).images[0]

    assert np.array_equal(refine(loaded), refine(pipe))


def test_one_component_of_a_pipeline(tmp_path: Path, run_cli) -> None:
    """A VAE exported alone has no prefix, as standalone VAE files have; the model type is the pipeline's."""
    from diffusers import AutoencoderKL

    pipe = _sd1_pipeline(tmp_path)
    pipe.save_pretrained(tmp_path / "pipeline")
    out = tmp_path / "vae.safetensors"
    assert run_cli("convert", tmp_path / "pipeline", out, "--to", "single-file", "--component", "vae").exit_code == 0
    assert "decoder.conv_in.weight" in shardkit.read_header(out).by_name()
    loaded = AutoencoderKL.from_single_file(str(out), config=str(tmp_path / "pipeline" / "vae"), local_files_only=True)
    assert_bit_equal(loaded.state_dict(), pipe.vae.state_dict())
    unet = tmp_path / "unet.safetensors"
    assert run_cli("convert", tmp_path / "pipeline", unet, "--to", "single-file").exit_code == 0  # default: the denoiser
    assert _header_metadata(unet)["model_type"] == "sd1"


# ----------------------------------------------------------------------------- refusals


def test_other_model_types_are_refused_naming_the_supported_ones(tmp_path: Path, run_cli) -> None:
    from diffusers import UNet2DModel

    UNet2DModel(block_out_channels=(8, 8), norm_num_groups=4, down_block_types=("DownBlock2D",) * 2,
                up_block_types=("UpBlock2D",) * 2).save_pretrained(tmp_path / "ddpm")
    line = assert_one_line_error(run_cli("convert", tmp_path / "ddpm", tmp_path / "o.safetensors", "--to", "single-file"))
    assert "UNet2DModel" in line and "SD3/SD3.5" in line and "Flux.1" in line
    index = {"_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"]}
    (tmp_path / "flux").mkdir()
    (tmp_path / "flux" / "model_index.json").write_text(json.dumps(index))
    line = assert_one_line_error(run_cli("convert", tmp_path / "flux", tmp_path / "o.safetensors", "--to", "single-file",
                                         "--component", "all"))
    assert "FluxPipeline" in line and "--component transformer" in line
    assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.parametrize("args, message", [
    (["--config", "{src}"], "do not apply with --to single-file"),
    (["--strip-prefix", "x."], "do not apply with --to single-file"),
    (["--component", "vae"], "applies to a pipeline folder"),
    (["--max-shard-size", "1KB"], "names one file"),  # without it, one file however large
])
def test_bad_options_are_one_line_errors(tmp_path: Path, run_cli, args: list[str], message: str) -> None:
    _build("UNet2DConditionModel", SD_LIKE_UNET, tmp_path / "unet")
    argv = [a.replace("{src}", str(tmp_path / "unet")) for a in args]
    assert_one_line_error(run_cli("convert", tmp_path / "unet", tmp_path / "o.safetensors", "--to", "single-file", *argv),
                          contains=message)
    assert not (tmp_path / "o.safetensors").exists()


def test_a_file_source_or_an_output_inside_the_source_is_refused(tmp_path: Path, run_cli) -> None:
    _build("UNet2DConditionModel", SD_LIKE_UNET, tmp_path / "unet")
    before = sorted(p.name for p in (tmp_path / "unet").iterdir())
    weights = tmp_path / "unet" / "diffusion_pytorch_model.safetensors"
    assert_one_line_error(run_cli("convert", weights, tmp_path / "o.safetensors", "--to", "single-file"),
                          contains="model or pipeline folder")
    assert_one_line_error(run_cli("convert", tmp_path / "unet", tmp_path / "unet" / "o.safetensors", "--to",
                                  "single-file"), contains="inside the source folder")
    assert sorted(p.name for p in (tmp_path / "unet").iterdir()) == before


def test_python_api_and_dry_run(tmp_path: Path) -> None:
    _build("AutoencoderKL", SD_LIKE_VAE, tmp_path / "vae")
    planned = shardkit.convert(tmp_path / "vae", tmp_path / "vae.safetensors", to="single-file", dry_run=True)
    assert planned.dry_run and not (tmp_path / "vae.safetensors").exists()
    done = shardkit.convert(tmp_path / "vae", tmp_path / "vae.safetensors", to="single-file")
    assert done.plan.total_bytes == planned.plan.total_bytes == (tmp_path / "vae").joinpath(
        "diffusion_pytorch_model.safetensors").stat().st_size - 8 - _header_bytes(tmp_path / "vae")


def test_the_summary_names_the_file_written(tmp_path: Path, run_cli) -> None:
    _build("AutoencoderKL", SD_LIKE_VAE, tmp_path / "vae")
    out = tmp_path / "exported" / "vae.safetensors"
    out.parent.mkdir()
    result = run_cli("convert", tmp_path / "vae", out, "--to", "single-file")
    assert result.exit_code == 0, result.stderr
    assert "wrote 1 file, " in result.stdout and result.stdout.rstrip().splitlines()[-2].endswith(f": {out}")
    assert "shard(s)" not in result.stdout


def test_quantize_into_one_file_writes_the_quantized_tensors(tmp_path: Path, run_cli) -> None:
    from helpers_quant import tiny_llama
    from safetensors.torch import load_file

    tiny_llama().save_pretrained(tmp_path / "llama")
    result = run_cli("convert", tmp_path / "llama", tmp_path / "one.safetensors", "--quantize", "fp8-block")
    assert result.exit_code == 0, result.stderr
    assert "largest relative error" in result.stdout
    tensors = load_file(tmp_path / "one.safetensors")
    assert tensors["model.layers.0.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert "model.layers.0.mlp.up_proj.weight_scale_inv" in tensors


def _header_bytes(folder: Path) -> int:
    import struct

    with open(folder / "diffusion_pytorch_model.safetensors", "rb") as f:
        return struct.unpack("<Q", f.read(8))[0]


# ----------------------------------------------------------------------------- real sizes


@pytest.mark.parametrize("class_name, config", [
    ("UNet2DConditionModel", {}),  # SD 1.x sizes (320..1280 channels)
    ("UNet2DConditionModel", {**SDXL_UNET, "block_out_channels": [320, 640, 1280], "transformer_layers_per_block":
                              [1, 2, 10], "attention_head_dim": [5, 10, 20], "cross_attention_dim": 2048,
                              "addition_time_embed_dim": 256, "projection_class_embeddings_input_dim": 2816,
                              "norm_num_groups": 32}),
    ("AutoencoderKL", {"block_out_channels": [128, 256, 512, 512], "down_block_types": ["DownEncoderBlock2D"] * 4,
                       "up_block_types": ["UpDecoderBlock2D"] * 4, "latent_channels": 4, "layers_per_block": 2}),
    ("SD3Transformer2DModel", {}),  # SD3 medium
    ("SD3Transformer2DModel", {"num_layers": 38, "num_attention_heads": 38, "caption_projection_dim": 2432,
                               "pos_embed_max_size": 192, "qk_norm": "rms_norm"}),  # SD3.5 large
    ("FluxTransformer2DModel", {"guidance_embeds": True}),  # Flux.1 dev (schnell: no guidance)
    ("FluxTransformer2DModel", {}),
])
def test_real_size_layouts_agree_with_diffusers_forward_mapping(tmp_path: Path, class_name: str,
                                                                config: dict[str, Any]) -> None:
    """On the meta device (no memory): every parameter of the real-size model has an original tensor, and
    diffusers' own conversion of the proposed original layout gives back exactly the model's tensors."""
    import diffusers

    from shardkit.layouts.single_file_export import plan_export, trace_part

    with torch.device("meta"):
        model = getattr(diffusers, class_name)(**config)
    model.save_config(tmp_path)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    _, parts = plan_export(str(tmp_path), component=None)
    originals = trace_part(parts[0], shapes)
    assert {p.target for o in originals.values() for p in o.pieces} == set(shapes)
    fused = [o for o in originals.values() if o.renamed_from is None]
    assert len(fused) < len(originals) / 4


@pytest.mark.parametrize("layout, prefix, projection, size", [
    ("clip", "cond_stage_model.transformer.", False, (768, 12, 12, "quick_gelu")),  # SD 1.x: CLIP ViT-L
    ("openclip", "cond_stage_model.model.", False, (1024, 23, 16, "gelu")),  # SD 2.x: OpenCLIP ViT-H, penultimate
    ("clip", "conditioner.embedders.0.transformer.", False, (768, 12, 12, "quick_gelu")),  # SDXL
    ("openclip", "conditioner.embedders.1.model.", True, (1280, 32, 20, "gelu")),  # SDXL: OpenCLIP ViT-bigG
])
def test_real_size_text_encoder_layouts_agree_with_diffusers_forward_mapping(
        tmp_path: Path, layout: str, prefix: str, projection: bool, size: tuple[int, int, int, str]) -> None:
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from shardkit.layouts.single_file_export import ExportPart, trace_part

    hidden, layers, heads, act = size
    config = CLIPTextConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                            num_attention_heads=heads, hidden_act=act, projection_dim=hidden)
    with torch.device("meta"):
        model = (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)
    model.config.save_pretrained(tmp_path)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    originals = trace_part(ExportPart("text_encoder", str(tmp_path), layout, prefix), shapes)
    assert {p.target for o in originals.values() for p in o.pieces} == set(shapes)
    assert all(name.startswith(prefix) for name in originals)
    fused = sorted(o.name.removeprefix(prefix) for o in originals.values() if o.renamed_from is None)
    if layout == "openclip":  # q/k/v → in_proj, and the projection transposed
        assert len(fused) == 2 * layers + projection and f"transformer.resblocks.{layers - 1}.attn.in_proj_weight" in fused
    else:
        assert fused == []


@pytest.mark.slow
def test_flux_exports_and_loads_with_from_single_file(tmp_path: Path, run_cli) -> None:
    """diffusers' Flux conversion hard-codes Flux.1's inner size (3072): one block of each kind, full width, bf16."""
    from diffusers import FluxTransformer2DModel

    config = {"num_layers": 1, "num_single_layers": 1, "in_channels": 16, "joint_attention_dim": 32,
              "pooled_projection_dim": 16, "guidance_embeds": True}
    with torch.device("meta"):
        model = FluxTransformer2DModel(**config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    model.save_pretrained(tmp_path / "flux")
    out = tmp_path / "flux.safetensors"
    result = run_cli("convert", tmp_path / "flux", out, "--to", "single-file")
    assert result.exit_code == 0, result.stderr
    names = shardkit.read_header(out).by_name()
    assert "single_blocks.0.linear1.weight" in names and "double_blocks.0.img_attn.qkv.weight" in names
    loaded = FluxTransformer2DModel.from_single_file(str(out), config=str(tmp_path / "flux"), local_files_only=True,
                                                     torch_dtype=torch.bfloat16)
    assert_bit_equal(loaded.state_dict(), model.state_dict())
    del loaded
    back = run_cli("convert", out, tmp_path / "back", "--to", "diffusers", "--config", tmp_path / "flux")
    assert back.exit_code == 0, back.stderr
    assert_bit_equal(load_folder(tmp_path / "back"), load_folder(tmp_path / "flux"))


@pytest.mark.slow
def test_flux_width_export_memory_does_not_hold_the_fused_tensors(tmp_path: Path) -> None:
    """Flux.1 width, 1 double + 4 single blocks in bf16 (~1.8 GB, 40% of it fused q/k/v and linear1): the
    exporting process stays far below the model's size (fused tensors are read as byte runs, never assembled)."""
    import os
    import sys

    from diffusers import FluxTransformer2DModel
    from helpers_hub import run_measured
    from safetensors.torch import save_file

    with torch.device("meta"):
        model = FluxTransformer2DModel(num_layers=1, num_single_layers=4, guidance_embeds=True)
    model.save_config(tmp_path / "flux")
    generator = torch.Generator().manual_seed(0)
    save_file({k: torch.randn(v.shape, generator=generator).to(torch.bfloat16) for k, v in model.state_dict().items()},
              str(tmp_path / "flux" / "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
    size_bytes = (tmp_path / "flux" / "diffusion_pytorch_model.safetensors").stat().st_size
    shardkit_bin = Path(sys.executable).with_name("shardkit")
    code, _, peak_rss_bytes, stderr = run_measured(
        [shardkit_bin, "convert", tmp_path / "flux", tmp_path / "flux.safetensors", "--to", "single-file", "-q"],
        {**os.environ, "HF_HUB_OFFLINE": "1"})
    assert code == 0, stderr
    assert peak_rss_bytes < size_bytes / 2, (peak_rss_bytes, size_bytes)
    header = shardkit.read_header(tmp_path / "flux.safetensors")
    assert header.by_name()["single_blocks.3.linear1.weight"].shape == (3 * 3072 + 4 * 3072, 3072)
