"""``convert UNET OUT --lora FILE``: diffusers and kohya LoRA files merged into a UNet, judged by diffusers'
``pipe.load_lora_weights(...); pipe.fuse_lora()`` on a tiny Stable Diffusion pipeline with random weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import load_folder
from helpers_pipeline import build_tiny_sd_pipeline
from safetensors.torch import save_file

pytest.importorskip("peft")

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "conv1", "conv_shortcut"]


@pytest.fixture(scope="module")
def sd(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny SD pipeline folder, and one LoRA on its UNet saved in diffusers' format and in kohya's."""
    from diffusers import StableDiffusionPipeline
    from diffusers.utils import convert_state_dict_to_kohya
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    root = tmp_path_factory.mktemp("sd-lora")
    pipe = build_tiny_sd_pipeline(root)
    pipe.save_pretrained(root / "sd")
    torch.manual_seed(1)
    pipe.unet.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=TARGETS))
    layers = get_peft_model_state_dict(pipe.unet)
    StableDiffusionPipeline.save_lora_weights(root / "lora-diffusers", unet_lora_layers=layers,
                                              unet_lora_adapter_metadata=pipe.unet.peft_config["default"].to_dict())
    kohya = convert_state_dict_to_kohya({f"unet.{k}": v for k, v in layers.items()})
    kohya = {k: torch.tensor(2.0) if k.endswith(".alpha") else v for k, v in kohya.items()}  # scale 2 / 4
    save_file(kohya, root / "lora-kohya.safetensors")
    text = text_encoder_lora(root)  # one file with both: kohya names, alpha 2 on the UNet, rank on the text encoder
    both = convert_state_dict_to_kohya({**{f"unet.{k}": v for k, v in layers.items()},
                                        **{f"text_encoder.{k}": v for k, v in text.items()}})
    both = {k: torch.tensor(2.0) if k.endswith(".alpha") and k.startswith("lora_unet") else v for k, v in both.items()}
    save_file(both, root / "lora-both.safetensors")
    return {"root": root, "unet": root / "sd" / "unet", "diffusers": root / "lora-diffusers" /
            "pytorch_lora_weights.safetensors", "kohya": root / "lora-kohya.safetensors",
            "both": root / "lora-both.safetensors", "text-merged": root / "text-merged.safetensors"}


def text_encoder_lora(root: Path) -> dict[str, torch.Tensor]:
    """A LoRA on the pipeline's CLIP text encoder made with PEFT itself (transformers' own adapter integration
    wants a newer PEFT), and PEFT's merge of it saved as the judge (diffusers loads text-encoder LoRAs the same way)."""
    from peft import LoraConfig, get_peft_model
    from peft.utils import get_peft_model_state_dict
    from transformers import CLIPTextModel

    torch.manual_seed(2)
    model = get_peft_model(CLIPTextModel.from_pretrained(root / "sd" / "text_encoder"),
                           LoraConfig(r=2, lora_alpha=2, init_lora_weights=False,
                                      target_modules=["q_proj", "k_proj", "v_proj", "out_proj"]))
    layers = {k.removeprefix("base_model.model."): v.clone() for k, v in get_peft_model_state_dict(model).items()}
    save_file({k: v.contiguous() for k, v in model.merge_and_unload().state_dict().items()},
              root / "text-merged.safetensors")
    return layers


def fused_unet(sd: dict[str, Path], lora: Path, component: str = "unet") -> dict[str, torch.Tensor]:
    """diffusers' own merge: the pipeline with the LoRA loaded, fused and unloaded; one component's weights."""
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(sd["root"] / "sd")
    pipe.load_lora_weights(lora.parent, weight_name=lora.name)
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    return getattr(pipe, component).state_dict()


@pytest.mark.parametrize("kind", ["diffusers", "kohya"])
def test_a_unet_lora_merges_as_diffusers_fuses_it(sd: dict[str, Path], run_cli, kind: str) -> None:
    """Every tensor bit-equal: linear pairs as B @ A, 3x3 conv pairs as PEFT's conv2d(Aᵀ, B)ᵀ."""
    out = sd["root"] / f"merged-{kind}"
    result = run_cli("convert", sd["unet"], out, "--lora", sd[kind])
    assert result.exit_code == 0, result.stderr
    assert "LoRA weight(s)" in result.stdout
    got, want = load_folder(out), fused_unet(sd, sd[kind])
    assert set(got) == set(want)
    base = load_folder(sd["unet"])
    changed = [k for k in got if not torch.equal(got[k], base[k])]
    assert len(changed) >= 20
    assert any(got[k].dim() == 4 and got[k].shape[-1] == 3 for k in changed)  # 3x3 convs among them
    assert [k for k in got if not torch.equal(got[k], want[k])] == []
    (out / "config.json").read_text()  # side files travel


def test_a_merged_unet_loads_into_the_pipeline(sd: dict[str, Path]) -> None:
    from diffusers import UNet2DConditionModel

    import shardkit

    out = sd["root"] / "merged-bf16"
    result = shardkit.convert(sd["unet"], out, lora=sd["diffusers"], dtype="bf16")
    assert result.to_dict()["lora"]["tensors"] >= 20
    assert {v.dtype for v in load_folder(out).values()} == {torch.bfloat16}
    unet = UNet2DConditionModel.from_pretrained(out, torch_dtype=torch.bfloat16)
    assert next(unet.parameters()).dtype == torch.bfloat16


def test_a_lora_for_another_unet_is_refused(sd: dict[str, Path], run_cli, tmp_path: Path) -> None:
    from conftest import assert_one_line_error

    other = tmp_path / "other.safetensors"
    save_file({"unet.down_blocks.0.attentions.0.proj_in.lora_A.weight": torch.zeros(4, 7),
               "unet.down_blocks.0.attentions.0.proj_in.lora_B.weight": torch.zeros(32, 4)}, other)
    result = run_cli("convert", sd["unet"], tmp_path / "out", "--lora", other)
    assert_one_line_error(result, contains="do not fit down_blocks.0.attentions.0.proj_in.weight")
    assert not (tmp_path / "out").exists()


def test_a_pipeline_folder_gets_the_lora_in_its_unet_and_text_encoder(sd: dict[str, Path], run_cli) -> None:
    """The whole pipeline written (other components and files as they are): the UNet merged as diffusers fuses
    it, the text encoder as PEFT merges it (one kohya file with both); diffusers loads the result."""
    from diffusers import StableDiffusionPipeline
    from safetensors.torch import load_file

    out = sd["root"] / "merged-pipeline"
    result = run_cli("convert", sd["root"] / "sd", out, "--lora", sd["both"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout.count(f"merged {sd['both']}:") == 2  # unet, text_encoder
    fused, unet = fused_unet(sd, sd["kohya"]), load_folder(out / "unet")  # the same UNet pairs and alphas
    assert unet.keys() == fused.keys() and [k for k, v in unet.items() if not torch.equal(v, fused[k])] == []
    text, judged = load_folder(out / "text_encoder"), load_file(sd["text-merged"])
    assert text.keys() == judged.keys() and [k for k, v in text.items() if not torch.equal(v, judged[k])] == []
    base_text = load_folder(sd["root"] / "sd" / "text_encoder")
    assert sum(not torch.equal(v, base_text[k]) for k, v in text.items()) == 8  # q/k/v/out_proj of 2 layers
    vae, base_vae = load_folder(out / "vae"), load_folder(sd["root"] / "sd" / "vae")
    assert vae.keys() == base_vae.keys() and all(torch.equal(v, base_vae[k]) for k, v in vae.items())
    assert (out / "model_index.json").read_text() == (sd["root"] / "sd" / "model_index.json").read_text()
    StableDiffusionPipeline.from_pretrained(out)
