"""``convert --lora``: adapters that do not fit their base are refused in one line, exit 2, before any output exists."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import assert_one_line_error
from helpers_lora import LLAMA, edit_config, llama_class, save_adapter, save_base
from safetensors.torch import save_file

pytest.importorskip("peft")

TARGETS = ["q_proj", "v_proj"]


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-errors")
    base = save_base(root / "base", llama_class(), LLAMA)
    wide = save_base(root / "wide", llama_class(), {**LLAMA, "hidden_size": 48, "intermediate_size": 96})
    return {"root": root, "base": base, "wide": wide,
            "adapter": save_adapter(base, root / "adapter", llama_class(), r=4, lora_alpha=8, target_modules=TARGETS)}


def copy_adapter(made: dict[str, Path], tmp_path: Path, **changes: object) -> Path:
    adapter = Path(shutil.copytree(made["adapter"], tmp_path / "adapter"))
    if changes:
        edit_config(adapter, **changes)
    return adapter


def refused(run_cli, made: dict[str, Path], tmp_path: Path, *adapters: Path, base: Path | None = None,
            contains: str, extra: tuple[str, ...] = ()) -> str:
    out = tmp_path / "out"
    args = [a for adapter in adapters for a in ("--lora", adapter)]
    result = run_cli("convert", base or made["base"], out, *args, *extra)
    line = assert_one_line_error(result, contains=contains)
    assert not out.exists()
    return line


def test_an_adapter_for_another_base_names_the_first_mismatched_key(made, run_cli, tmp_path) -> None:
    line = refused(run_cli, made, tmp_path, made["adapter"], base=made["wide"], contains="do not fit")
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight (4, 32)" in line
    assert "model.layers.0.self_attn.q_proj.weight (48, 48)" in line


def test_a_target_module_that_matches_no_weight(made, run_cli, tmp_path) -> None:
    adapter = copy_adapter(made, tmp_path, target_modules=[*TARGETS, "qkv_proj"])
    refused(run_cli, made, tmp_path, adapter, contains="target module 'qkv_proj' (the adapter's target_modules) "
                                                      "matches no weight")


def test_a_key_whose_weight_the_base_lacks(made, run_cli, tmp_path) -> None:
    adapter = copy_adapter(made, tmp_path, target_modules=".*proj")  # a regex: the keys themselves are checked
    weights = adapter / "adapter_model.safetensors"
    from safetensors.torch import load_file

    tensors = {k.replace("layers.1.", "layers.7."): v for k, v in load_file(weights).items()}
    save_file(tensors, weights)
    refused(run_cli, made, tmp_path, adapter, contains="targets model.layers.7.self_attn.q_proj.weight, which")


def test_a_rank_that_disagrees_with_the_tensors(made, run_cli, tmp_path) -> None:
    adapter = copy_adapter(made, tmp_path, r=8)
    refused(run_cli, made, tmp_path, adapter, contains="has rank 4")
    pattern = copy_adapter(made, tmp_path / "p", rank_pattern={"v_proj": 2})
    refused(run_cli, made, tmp_path, pattern, contains="r=2 for model.layers.0.self_attn.v_proj")


def test_two_adapters_on_one_weight_in_different_dtypes(made, run_cli, tmp_path) -> None:
    half = save_adapter(made["base"], tmp_path / "bf16", llama_class(), seed=5, dtype=torch.bfloat16, r=2,
                        lora_alpha=2, target_modules=["q_proj"])
    refused(run_cli, made, tmp_path, made["adapter"], half, contains="changed by adapters stored in different dtypes")


@pytest.mark.parametrize(("changes", "contains"), [
    ({"peft_type": "LOHA"}, "peft_type LOHA is not supported; supported: PEFT LoRA"),
    ({"peft_type": "LOKR"}, "peft_type LOKR is not supported"),
])
def test_other_adapter_kinds_name_what_is_supported(made, run_cli, tmp_path, changes, contains) -> None:
    refused(run_cli, made, tmp_path, copy_adapter(made, tmp_path, **changes), contains=contains)


def test_a_unet_lora_on_a_llama_and_a_file_that_is_no_lora(made, run_cli, tmp_path) -> None:
    kohya = tmp_path / "kohya.safetensors"
    save_file({"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": torch.zeros(2, 8),
               "lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight": torch.zeros(8, 2)}, kohya)
    refused(run_cli, made, tmp_path, kohya, contains="target module 'down_blocks.0.attentions.0.proj_in' (the "
                                                    "adapter's target_modules) matches no weight")
    line = refused(run_cli, made, tmp_path, made["base"] / "model.safetensors", contains="no UNet or transformer LoRA keys")
    assert "supported: PEFT LoRA folders" in line and "kohya" in line


def test_a_missing_adapter_and_other_targets(made, run_cli, tmp_path) -> None:
    refused(run_cli, made, tmp_path, tmp_path / "nowhere", contains="no such file or folder")
    refused(run_cli, made, tmp_path, made["adapter"], contains="--lora merges into a checkpoint written as safetensors",
            extra=("--to", "single-file"))


def test_dora_on_an_embedding_and_beside_another_adapter(made, run_cli, tmp_path) -> None:
    embedding = save_adapter(made["base"], tmp_path / "dora-embed", llama_class(), seed=6, r=2, lora_alpha=2,
                             use_dora=True, target_modules=["embed_tokens"])
    refused(run_cli, made, tmp_path, embedding, contains="DoRA on model.embed_tokens.weight (an embedding, conv")
    dora = save_adapter(made["base"], tmp_path / "dora", llama_class(), seed=8, r=2, lora_alpha=2, use_dora=True,
                        target_modules=["q_proj"])
    refused(run_cli, made, tmp_path, made["adapter"], dora, contains="a DoRA adapter and another adapter both change")
