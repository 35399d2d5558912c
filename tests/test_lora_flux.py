"""``convert FLUX OUT --lora FILE``: Flux LoRAs (kohya's ``lora_unet_double_blocks_*`` and diffusers'
``transformer.*.lora_A/B``) merged into a diffusers FluxTransformer2DModel folder or an original (BFL) single
file, judged by diffusers: ``FluxPipeline.load_lora_weights(...); fuse_lora()`` on the same transformer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import assert_one_line_error, load_folder
from helpers_lora import (
    FLUX,
    assert_within_bf16,
    assert_within_bf16_scale,
    cast_lora_file,
    flux_fused,
    save_flux,
    save_flux_diffusers_lora,
    save_flux_kohya_lora,
)
from helpers_quant import flux_bfl_state_dict

import shardkit

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Flux transformer folder (fp32), a diffusers-format LoRA on it, and a kohya one on its BFL names."""
    root = tmp_path_factory.mktemp("flux-lora")
    base = save_flux(root / "flux", FLUX)
    bfl = {name: tuple(t.shape) for name, t in flux_bfl_state_dict(FLUX).items()}
    # diffusers splits kohya's linear1 at Flux.1's widths only (3072, 12288): at this width it is left to the slow test
    kohya = save_flux_kohya_lora(root / "kohya.safetensors", bfl, skip=("linear1",))
    return {"root": root, "base": base, "diffusers": save_flux_diffusers_lora(base, root / "lora-diffusers"),
            "kohya": kohya}


@pytest.mark.parametrize("kind", ["diffusers", "kohya"])
def test_a_flux_lora_merges_into_the_folder_as_diffusers_fuses_it(flux: dict[str, Path], run_cli, kind: str) -> None:
    """Bit-equal in fp32: kohya's fused img_attn.qkv split into to_q/to_k/to_v as diffusers splits it (A shared,
    B cut by rows), alpha folded into A and B as diffusers folds it; the other tensors untouched."""
    out = flux["root"] / f"merged-{kind}"
    result = run_cli("convert", flux["base"], out, "--lora", flux[kind])
    assert result.exit_code == 0, result.stderr
    got, want, base = load_folder(out), flux_fused(flux["base"], flux[kind]), load_folder(flux["base"])
    assert set(got) == set(want)
    changed = {k for k in got if not torch.equal(got[k], base[k])}
    assert {"transformer_blocks.0.attn.to_q.weight", "transformer_blocks.1.attn.add_v_proj.weight",
            "single_transformer_blocks.1.norm.linear.weight"} <= changed
    assert len(changed) >= 30
    assert [k for k in got if not torch.equal(got[k], want[k])] == []
    if kind == "kohya":  # diffusers' conversion gives the top-level layers no prefix: they are not loaded, nor merged
        assert "x_embedder.weight" not in changed and "diffusers' load_lora_weights leaves them out" in result.stderr


def test_a_merged_flux_folder_loads_in_bf16(flux: dict[str, Path]) -> None:
    from diffusers import FluxTransformer2DModel

    out = flux["root"] / "merged-bf16"
    result = shardkit.convert(flux["base"], out, lora=flux["diffusers"], dtype="bf16")
    assert result.to_dict()["lora"]["tensors"] >= 30
    got = load_folder(out)
    assert {v.dtype for v in got.values()} == {torch.bfloat16}
    assert_within_bf16(got, flux_fused(flux["base"], flux["diffusers"]))
    model = FluxTransformer2DModel.from_pretrained(out, torch_dtype=torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16


def test_kohya_linear1_at_a_width_diffusers_does_not_split_is_refused(flux: dict[str, Path], run_cli,
                                                                        tmp_path: Path) -> None:
    bfl = {name: tuple(t.shape) for name, t in flux_bfl_state_dict(FLUX).items()}
    lora = save_flux_kohya_lora(tmp_path / "linear1.safetensors", bfl)
    result = run_cli("convert", flux["base"], tmp_path / "out", "--lora", lora)
    assert_one_line_error(result, contains="diffusers' Flux LoRA conversion refuses it")
    assert not (tmp_path / "out").exists()


def test_a_small_bfl_file_is_refused_naming_the_width(flux: dict[str, Path], run_cli, tmp_path: Path) -> None:
    """diffusers maps an original Flux file at width 3072 only; a diffusers-named LoRA cannot be placed in another."""
    from safetensors.torch import save_file

    save_file(flux_bfl_state_dict(FLUX), tmp_path / "flux-bfl.safetensors")
    result = run_cli("convert", tmp_path / "flux-bfl.safetensors", tmp_path / "out.safetensors", "--lora",
                     flux["diffusers"])
    assert_one_line_error(result, contains="of width 32")
    assert not (tmp_path / "out.safetensors").exists()


# Flux.1's width (diffusers' BFL mapping and kohya's linear1 split are fixed at 3072), one block of each kind.
WIDE = {**FLUX, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 128, "num_attention_heads": 24,
        "axes_dims_rope": [16, 56, 56], "guidance_embeds": True}


@pytest.mark.slow
def test_flux_width_loras_merge_into_the_folder_and_into_the_bfl_file(tmp_path: Path, run_cli) -> None:
    """Width 3072 in bf16: a kohya LoRA on every BFL weight (linear1 split into to_q/to_k/to_v/proj_mlp) and a
    diffusers one, each merged into the diffusers folder and into the original single file (their rows of the fused
    qkv / linear1, norm_out's swapped halves); every weight within bf16 rounding of diffusers' fuse_lora, the file
    loaded by from_single_file."""
    from diffusers import FluxTransformer2DModel

    base = save_flux(tmp_path / "flux", WIDE, dtype=torch.bfloat16)
    single = tmp_path / "flux-bfl.safetensors"
    assert run_cli("convert", base, single, "--to", "single-file").exit_code == 0
    shapes = {e.name: e.shape for e in shardkit.read_header(single).entries}
    before = load_folder(base)
    loras = {"kohya": save_flux_kohya_lora(tmp_path / "kohya.safetensors", shapes),
             "diffusers": save_flux_diffusers_lora(base, tmp_path / "lora-diffusers", rank=8, alpha=4)}
    for kind, lora in loras.items():
        cast_lora_file(lora, torch.bfloat16)  # as trainers save them (diffusers would round fp32 A and B to bf16)
        want = flux_fused(base, lora, dtype=torch.bfloat16)
        result = run_cli("convert", base, tmp_path / f"folder-{kind}", "--lora", lora)
        assert result.exit_code == 0, result.stderr
        assert_within_bf16_scale(load_folder(tmp_path / f"folder-{kind}"), want, before)
        out = tmp_path / f"merged-{kind}.safetensors"
        result = run_cli("convert", single, out, "--lora", lora)
        assert result.exit_code == 0, result.stderr
        merged = FluxTransformer2DModel.from_single_file(str(out), config=str(base), local_files_only=True,
                                                         torch_dtype=torch.bfloat16).state_dict()
        assert_within_bf16_scale(merged, want, before)
        changed = [k for k, v in merged.items() if not torch.equal(v, before[k])]
        assert {"single_transformer_blocks.0.proj_mlp.weight", "transformer_blocks.0.attn.to_v.weight"} <= set(changed)
        del merged, want


def test_a_flux_pipeline_folder_gets_the_lora_in_its_transformer(flux: dict[str, Path], run_cli) -> None:
    """A FluxPipeline folder (here its transformer and scheduler only): the transformer merged as diffusers fuses it,
    the rest written as it is."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    pipe = FluxPipeline(transformer=FluxTransformer2DModel.from_pretrained(flux["base"]),
                        scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None, tokenizer=None,
                        text_encoder_2=None, tokenizer_2=None)
    pipe.save_pretrained(flux["root"] / "pipeline")
    out = flux["root"] / "pipeline-merged"
    result = run_cli("convert", flux["root"] / "pipeline", out, "--lora", flux["kohya"])
    assert result.exit_code == 0, result.stderr
    got, want = load_folder(out / "transformer"), flux_fused(flux["base"], flux["kohya"])
    assert got.keys() == want.keys() and [k for k in got if not torch.equal(got[k], want[k])] == []
    assert (out / "model_index.json").read_text() == (flux["root"] / "pipeline" / "model_index.json").read_text()
    assert (out / "scheduler" / "scheduler_config.json").exists()


def test_a_lora_file_on_the_hub_merges_as_a_local_one(flux: dict[str, Path], hub, tmp_path: Path) -> None:
    """``--lora hf://ORG/REPO/FILE.safetensors``: one file of a Hub repository, read through the HF cache."""
    from helpers_hub import hub_env, hub_files, run_shardkit

    hub.state.add_repo("alice/flux-lora", hub_files(flux["kohya"].parent / "lora-diffusers"))
    lora = "hf://alice/flux-lora/pytorch_lora_weights.safetensors"
    done = run_shardkit(hub_env(hub, tmp_path / "home"), "convert", flux["base"], tmp_path / "out", "--lora", lora)
    assert done.returncode == 0, done.stderr
    shardkit.convert(flux["base"], tmp_path / "local", lora=flux["diffusers"])
    assert load_folder(tmp_path / "out").keys() == load_folder(tmp_path / "local").keys()
    assert (tmp_path / "out" / "diffusion_pytorch_model.safetensors").read_bytes() == \
        (tmp_path / "local" / "diffusion_pytorch_model.safetensors").read_bytes()
