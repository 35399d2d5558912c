"""GGUF as an output: ``convert SRC out.gguf --to gguf --quantize ...``, judged by gguf, transformers, diffusers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_one_line_error, leftovers, snapshot
from helpers_gguf import (
    gguf_dequantized,
    gguf_metadata,
    llama_cpp_permute,
    llama_cpp_unpermute,
    llama_gguf_name,
    read_gguf_tensors,
    tiny_llama_config,
    tiny_llama_folder,
    write_llama_gguf,
)
from helpers_quant import flux_bfl_state_dict, flux_config
from safetensors.torch import load_file, save_file

import shardkit

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_folder(tmp_path_factory.mktemp("llama") / "hf")


def test_a_q8_0_export_loads_in_transformers(llama_folder: Path, tmp_path: Path, run_cli) -> None:
    """transformers' from_pretrained(gguf_file=) gets gguf's dequantization of our bytes, which are gguf's quantize."""
    import transformers

    out = tmp_path / "llama-q8_0.gguf"
    result = run_cli("convert", llama_folder, out, "--to", "gguf", "--quantize", "q8_0")
    assert result.exit_code == 0, result.stderr
    source = load_file(llama_folder / "model.safetensors")
    tensors = read_gguf_tensors(out)
    for name, value in source.items():
        kind, raw = tensors[llama_gguf_name(name)]
        value = value.float()
        if ".q_proj." in name:
            value = llama_cpp_permute(value, 4)
        elif ".k_proj." in name:
            value = llama_cpp_permute(value, 2)
        expected_kind = T.Q8_0 if value.dim() == 2 else T.F32
        expected = gguf.quants.quantize(value.numpy(), expected_kind).view(np.uint8).reshape(-1)
        assert kind == expected_kind and np.array_equal(raw, expected), name
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name)
    reference = gguf_dequantized(out)
    loaded = model.state_dict()
    for name in source:
        want = reference[llama_gguf_name(name)]
        if ".q_proj." in name:
            want = llama_cpp_unpermute(want, 4)
        elif ".k_proj." in name:
            want = llama_cpp_unpermute(want, 2)
        assert torch.equal(loaded[name], torch.from_numpy(want)), name
    meta = gguf_metadata(out)
    assert meta["general.architecture"] == "llama" and meta["tokenizer.ggml.model"] == "no_vocab"
    assert meta["llama.attention.head_count_kv"] == 2 and meta["general.file_type"] == 7
    assert model.config.num_key_value_heads == 2 and model.config.tie_word_embeddings is False


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0"])
def test_gguf_to_safetensors_to_gguf_keeps_every_tensor_byte(qtype: str, tmp_path: Path, run_cli) -> None:
    import transformers

    torch.manual_seed(1)
    config = tiny_llama_config()
    state = transformers.LlamaForCausalLM(config).state_dict()
    original = write_llama_gguf(tmp_path / "original.gguf", state, config, "BF16" if qtype == "BF16" else qtype)
    dtype = ["--dtype", "fp32"] if qtype == "Q8_0" else []
    result = run_cli("convert", original, tmp_path / "hf", *dtype)
    assert result.exit_code == 0, result.stderr
    back = tmp_path / "back.gguf"
    result = run_cli("convert", tmp_path / "hf", back, "--to", "gguf", "--quantize", qtype.lower())
    assert result.exit_code == 0, result.stderr
    assert read_gguf_tensors(back).keys() == read_gguf_tensors(original).keys()
    for name, (kind, raw) in read_gguf_tensors(original).items():
        got_kind, got = read_gguf_tensors(back)[name]
        assert got_kind == kind and np.array_equal(got, raw), name


def test_a_gguf_copied_to_gguf_keeps_types_bytes_and_metadata(tmp_path: Path, run_cli) -> None:
    import transformers

    config = tiny_llama_config()
    state = transformers.LlamaForCausalLM(config).state_dict()
    tokens = [f"<t{i}>" for i in range(config.vocab_size)]
    original = write_llama_gguf(tmp_path / "o.gguf", state, config, "Q4_0", tokens=tokens)
    result = run_cli("convert", original, tmp_path / "copy.gguf", "--to", "gguf")
    assert result.exit_code == 0, result.stderr
    assert read_gguf_tensors(tmp_path / "copy.gguf").keys() == read_gguf_tensors(original).keys()
    assert all(np.array_equal(a[1], b[1]) and a[0] == b[0] for a, b in zip(
        read_gguf_tensors(original).values(), read_gguf_tensors(tmp_path / "copy.gguf").values(), strict=True))
    assert gguf_metadata(tmp_path / "copy.gguf")["tokenizer.ggml.tokens"] == tokens


def test_q4_0_and_rows_that_are_not_whole_blocks(tmp_path: Path, run_cli) -> None:
    """hidden 48: rows of 48 values are not whole 32-value blocks and fall back to F16, as llama.cpp's converter
    does; 1-D tensors stay F32."""
    folder = tiny_llama_folder(tmp_path / "hf", hidden_size=48, num_attention_heads=4, num_key_value_heads=4,
                               intermediate_size=64, dtype=torch.bfloat16)
    out = tmp_path / "m.gguf"
    assert run_cli("convert", folder, out, "--to", "gguf", "--quantize", "q4_0").exit_code == 0
    source = load_file(folder / "model.safetensors")
    tensors = read_gguf_tensors(out)
    for name, value in source.items():
        kind, raw = tensors[llama_gguf_name(name)]
        whole = value.dim() == 2 and value.shape[-1] % 32 == 0
        assert kind == (T.Q4_0 if whole else T.F16 if value.dim() == 2 else T.F32), name
        if ".q_proj." in name or ".k_proj." in name:
            value = llama_cpp_permute(value, 4)
        assert np.array_equal(raw, gguf.quants.quantize(value.float().numpy(), kind).view(np.uint8).reshape(-1)), name
    assert tensors["blk.0.ffn_down.weight"][0] == T.Q4_0 and tensors["blk.0.attn_q.weight"][0] == T.F16


def test_flux_bfl_file_to_gguf_and_back(tmp_path: Path, run_cli) -> None:
    """ComfyUI-GGUF layout: BFL names, general.architecture flux, 2-D weights Q8_0, biases and norms F32."""
    state = flux_bfl_state_dict(flux_config())
    save_file({f"model.diffusion_model.{k}": v for k, v in state.items()}, tmp_path / "flux.safetensors")
    out = tmp_path / "flux-Q8_0.gguf"
    result = run_cli("convert", tmp_path / "flux.safetensors", out, "--to", "gguf", "--quantize", "q8_0")
    assert result.exit_code == 0, result.stderr
    assert gguf_metadata(out)["general.architecture"] == "flux"
    tensors = read_gguf_tensors(out)
    assert tensors.keys() == state.keys()
    for name, value in state.items():
        kind, raw = tensors[name]
        assert kind == (T.Q8_0 if value.dim() == 2 and value.shape[-1] % 32 == 0 else T.F32), name
        assert np.array_equal(raw, gguf.quants.quantize(value.float().numpy(), kind).view(np.uint8).reshape(-1))
    assert "GGUF v3 flux" in run_cli("info", out).stdout
    assert run_cli("convert", out, tmp_path / "back", "--dtype", "fp32").exit_code == 0
    back = load_file(tmp_path / "back" / "model.safetensors")
    reference = gguf_dequantized(out)
    assert all(np.array_equal(back[n].numpy(), reference[n]) for n in state)


def test_refusals_leave_nothing(llama_folder: Path, tmp_path: Path, run_cli) -> None:
    before = snapshot(llama_folder)
    assert_one_line_error(run_cli("convert", llama_folder, tmp_path / "x.safetensors", "--quantize", "q8_0"),
                          contains="--quantize q8_0 is a GGUF type, which only convert writes, with --to gguf")
    assert_one_line_error(run_cli("convert", llama_folder, tmp_path / "out", "--to", "gguf"), contains="ending in .gguf")
    assert_one_line_error(run_cli("convert", llama_folder, tmp_path / "o.gguf", "--to", "gguf", "--dtype", "bf16"),
                          contains="--quantize f16, bf16, q8_0 or q4_0 sets the ggml type")
    assert_one_line_error(run_cli("convert", llama_folder, tmp_path / "o.gguf", "--to", "gguf", "--quantize",
                                  "fp8-block"), contains="expected one of f16")
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text((llama_folder / "config.json").read_text())
    save_file({**load_file(llama_folder / "model.safetensors"), "model.extra.weight": torch.zeros(4, 4)},
              odd / "model.safetensors")
    assert_one_line_error(run_cli("convert", odd, tmp_path / "odd.gguf", "--to", "gguf"),
                          contains="model.extra.weight")
    (tmp_path / "taken.gguf").write_bytes(b"keep")
    assert_one_line_error(run_cli("convert", llama_folder, tmp_path / "taken.gguf", "--to", "gguf"),
                          contains="--overwrite")
    assert (tmp_path / "taken.gguf").read_bytes() == b"keep"
    assert not (tmp_path / "o.gguf").exists() and not (tmp_path / "odd.gguf").exists() and not leftovers(tmp_path)
    assert snapshot(llama_folder) == before


def test_python_api_and_dry_run(llama_folder: Path, tmp_path: Path) -> None:
    result = shardkit.convert(llama_folder, tmp_path / "m.gguf", to="gguf", quantize="q8_0", dry_run=True)
    assert result.plan.shards[0].filename == "m.gguf" and not (tmp_path / "m.gguf").exists()
    shardkit.convert(llama_folder, tmp_path / "m.gguf", to="gguf", quantize="bf16")
    assert {k for k, _ in read_gguf_tensors(tmp_path / "m.gguf").values()} == {T.BF16, T.F32}


@pytest.mark.slow
def test_a_flux_width_export_loads_in_diffusers_and_a_flux_gguf_converts_to_diffusers(tmp_path: Path,
                                                                                       run_cli) -> None:
    """diffusers' Flux mapping is fixed at width 3072: one double and one single block of the real width."""
    from diffusers import FluxTransformer2DModel, GGUFQuantizationConfig

    config = {**flux_config(), "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 128,
              "num_attention_heads": 24, "in_channels": 64, "joint_attention_dim": 64, "pooled_projection_dim": 64,
              "axes_dims_rope": [16, 56, 56]}
    torch.manual_seed(0)
    FluxTransformer2DModel(**config).save_pretrained(tmp_path / "transformer")
    out = tmp_path / "flux-Q8_0.gguf"
    result = run_cli("convert", tmp_path / "transformer", out, "--to", "gguf", "--quantize", "q8_0")
    assert result.exit_code == 0, result.stderr
    model = FluxTransformer2DModel.from_single_file(
        str(out), quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32),
        config=str(tmp_path / "transformer"), torch_dtype=torch.float32)
    quantized = [n for n, p in model.named_parameters() if getattr(p, "quant_type", None) == T.Q8_0]
    assert len(quantized) > 10
    result = run_cli("convert", out, tmp_path / "back", "--to", "diffusers", "--config", tmp_path / "transformer",
                     "--dtype", "fp32")
    assert result.exit_code == 0, result.stderr
    back = FluxTransformer2DModel.from_pretrained(tmp_path / "back")
    original = FluxTransformer2DModel.from_pretrained(tmp_path / "transformer")
    from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

    loaded = dict(model.named_parameters())
    for name, value in back.state_dict().items():
        assert torch.allclose(value, original.state_dict()[name], atol=2e-3), name  # Q8_0 error only
        got = loaded[name]
        got = dequantize_gguf_tensor(got).float().reshape(value.shape) if name in quantized else got.float()
        assert torch.allclose(got, value, rtol=0, atol=1e-3), name  # diffusers' own dequantization, not gguf's
