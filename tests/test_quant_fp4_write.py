"""``--quantize nvfp4|mxfp4``: bytes equal to compressed-tensors' own quantizers, laid out as the loaders
read them (compressed-tensors nvfp4-pack-quantized, gpt-oss MXFP4 experts), and loaded by transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import assert_one_line_error
from helpers_fp4 import ct_nvfp4_compress, mxfp4_experts, tiny_gpt_oss
from safetensors.torch import load_file

import shardkit


@pytest.fixture(scope="module")
def gpt_oss_plain(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    folder = tmp_path_factory.mktemp("gptoss") / "plain"
    model = tiny_gpt_oss(1)
    model.save_pretrained(folder)
    return folder, {k: v.clone() for k, v in model.state_dict().items()}


def test_quantize_nvfp4_writes_compressed_tensors_bytes(llama, tmp_path: Path, run_cli) -> None:
    from compressed_tensors.quantization import QuantizationConfig

    folder, state = llama
    result = run_cli("convert", folder, tmp_path / "out", "--quantize", "nvfp4", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["quantization"]["quantized"] == 14
    written = load_file(tmp_path / "out" / "model.safetensors")
    for name, tensor in state.items():
        prefix = name[: -len("weight")]
        if prefix + "weight_packed" not in written:
            assert torch.equal(written[name], tensor), name  # embeddings, norms, lm_head kept
            continue
        theirs = ct_nvfp4_compress(tensor)
        assert torch.equal(written[prefix + "weight_packed"], theirs["weight_packed"]), name
        assert torch.equal(written[prefix + "weight_scale"].view(torch.uint8), theirs["weight_scale"].view(torch.uint8))
        assert torch.equal(written[prefix + "weight_global_scale"], theirs["weight_global_scale"]), name
    qconfig = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qconfig)
    assert parsed.format == "nvfp4-pack-quantized" and "lm_head" in parsed.ignore
    info = json.loads(run_cli("info", tmp_path / "out", "--json").stdout)["quantization"]
    assert info["scheme"] == "compressed-tensors nvfp4-pack-quantized" and info["scaled_weights"] == 14


def test_nvfp4_output_loads_in_transformers_as_shardkit_dequantizes_it(llama, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    shardkit.convert(llama[0], tmp_path / "nvfp4", quantize="nvfp4")
    shardkit.convert(tmp_path / "nvfp4", tmp_path / "bf16", dtype="bf16")
    model, loading = AutoModelForCausalLM.from_pretrained(
        tmp_path / "nvfp4", quantization_config=CompressedTensorsConfig(run_compressed=False), output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"]
    loaded, ours = model.state_dict(), load_file(tmp_path / "bf16" / "model.safetensors")
    assert ours.keys() == {k for k in loaded if not k.endswith("rotary_emb.inv_freq")}
    for name, tensor in ours.items():
        assert torch.equal(loaded[name].to(tensor.dtype), tensor), name


def test_quantize_mxfp4_writes_gpt_oss_experts(gpt_oss_plain, tmp_path: Path, run_cli) -> None:
    folder, state = gpt_oss_plain
    result = run_cli("convert", folder, tmp_path / "out", "--quantize", "mxfp4")
    assert result.exit_code == 0, result.stderr
    written = load_file(tmp_path / "out" / "model.safetensors")
    experts = 0
    for name, tensor in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4_experts(tensor)  # compressed-tensors' MXFP4, in gpt-oss's layout
            assert name not in written and torch.equal(written[name + "_blocks"], blocks), name
            assert torch.equal(written[name + "_scales"], scales), name
            experts += 1
        else:
            assert torch.equal(written[name], tensor), name
    assert experts == 4
    qconfig = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qconfig["quant_method"] == "mxfp4" and "model.layers.*.mlp.router" in qconfig["modules_to_not_convert"]


def test_mxfp4_output_loads_in_transformers_and_round_trips(gpt_oss_plain, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder, state = gpt_oss_plain
    shardkit.convert(folder, tmp_path / "mxfp4", quantize="mxfp4")
    shardkit.convert(tmp_path / "mxfp4", tmp_path / "bf16", dtype="bf16")
    model, loading = AutoModelForCausalLM.from_pretrained(tmp_path / "mxfp4", output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"]
    loaded, ours = model.state_dict(), load_file(tmp_path / "bf16" / "model.safetensors")
    assert ours.keys() == state.keys()
    for name, tensor in ours.items():
        assert torch.equal(loaded[name].to(tensor.dtype), tensor), name
    again = shardkit.convert(tmp_path / "bf16", tmp_path / "again", quantize="mxfp4")  # requantizing is stable
    assert again.quantization["quantized"] == 4
    first, second = load_file(tmp_path / "mxfp4" / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert all(torch.equal(first[k], second[k]) for k in first if k.endswith("_scales"))


def test_quantize_mxfp4_without_experts_and_fp4_requantize_are_refused(llama, tmp_path: Path, run_cli) -> None:
    assert_one_line_error(run_cli("convert", llama[0], tmp_path / "out", "--quantize", "mxfp4"), code=2,
                          contains="experts")
    shardkit.convert(llama[0], tmp_path / "nvfp4", quantize="nvfp4")
    assert_one_line_error(run_cli("convert", tmp_path / "nvfp4", tmp_path / "out", "--quantize", "nvfp4"), code=2,
                          contains="already quantized")
    assert not (tmp_path / "out").exists()
