"""layouts/fp8.py and ``info``: every fp8-with-scales layout recognised from names, shapes, dtypes,
config and header metadata; parameters counted once; inconsistent checkpoints named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import assert_one_line_error
from helpers_quant import comfy_quantized, comfy_scaled, save_compressed, save_finegrained
from safetensors.torch import save_file

import shardkit
from shardkit.errors import InvalidInputError
from shardkit.formats.header import TensorEntry
from shardkit.layouts.fp8 import QUANTIZE_SKIP_PATTERNS, find_layout, should_skip_quantize


def _layout_folder(kind: str, base: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> Path:
    folder, state = base
    config = json.loads((folder / "config.json").read_text())
    out = tmp_path / kind
    if kind.startswith("finegrained"):
        save_finegrained(out, state, scale_dtype=kind.split("-")[1], config=config)
    elif kind.startswith("compressed"):
        save_compressed(out, state, strategy=kind.split("-")[1], config=config)
    elif kind == "comfy-scaled":
        out.mkdir()
        save_file(comfy_scaled(state), out / "model.safetensors")
    else:
        out.mkdir()
        tensors, meta = comfy_quantized(state)
        save_file(tensors, out / "model.safetensors", metadata=meta)
    return out


LAYOUTS = {
    "finegrained-F32": "fp8, 128×128 blocks, float32 scales (transformers FineGrainedFP8)",
    "finegrained-BF16": "fp8, 128×128 blocks, bf16 scales (transformers FineGrainedFP8)",
    "finegrained-F8_E8M0": "fp8, 128×128 blocks, e8m0 scales (transformers FineGrainedFP8)",
    "compressed-tensor": "fp8, per-tensor scales, float32 scales (compressed-tensors float-quantized)",
    "compressed-channel": "fp8, per-channel scales, float32 scales (compressed-tensors float-quantized)",
    "compressed-block": "fp8, 128×128 blocks, float32 scales (compressed-tensors float-quantized)",
    "comfy-scaled": "fp8, per-tensor scales, float32 scales (ComfyUI scaled_fp8)",
    "comfy-quantized": "fp8, per-tensor scales, float32 scales (ComfyUI quantized)",
}


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_info_names_the_layout_and_counts_parameters_once(kind: str, llama, tmp_path: Path, run_cli) -> None:
    folder = _layout_folder(kind, llama, tmp_path)
    result = run_cli("info", folder, "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    plain = shardkit.info(llama[0])
    assert doc["quantization"]["description"] == LAYOUTS[kind]
    assert doc["parameter_count"] == plain.parameter_count  # scales, input scales, markers are not parameters
    assert doc["memory_bytes"]["bf16"] == plain.memory_bytes["bf16"]  # the dequantized size
    assert doc["tensor_count"] > plain.tensor_count
    text = run_cli("info", folder).stdout
    assert f"quantized       {LAYOUTS[kind]}" in text


def test_a_plain_checkpoint_has_no_layout(llama) -> None:
    assert shardkit.info(llama[0]).quantization is None


def _e(name: str, dtype: str, shape: tuple[int, ...]) -> TensorEntry:
    from shardkit.units import tensor_nbytes

    return TensorEntry(name, dtype, shape, tensor_nbytes(dtype, shape))


@pytest.mark.parametrize("entries, named", [
    ([_e("a.weight", "F8_E4M3", (256, 256)), _e("a.weight_scale_inv", "F32", (2, 2)),
      _e("b.weight", "F8_E4M3", (256, 256))], "fp8 weight b.weight has no scale b.weight_scale_inv"),
    ([_e("a.weight", "F8_E4M3", (256, 256)), _e("a.weight_scale_inv", "F32", (3, 2))],
     "scale a.weight_scale_inv of shape [3, 2] fits no"),
    ([_e("a.weight", "F8_E4M3", (256, 256)), _e("a.weight_scale_inv", "F32", (2, 2)),
      _e("gone.weight_scale_inv", "F32", (2, 2))], "scale gone.weight_scale_inv has no weight gone.weight"),
    ([_e("scaled_fp8", "F8_E4M3", (0,)), _e("a.weight", "F8_E4M3", (64, 32)), _e("a.scale_weight", "F32", (5,))],
     "scale a.scale_weight of shape [5] fits no"),
])
def test_inconsistent_checkpoints_are_refused_naming_the_tensors(entries, named: str) -> None:
    with pytest.raises(InvalidInputError, match="every fp8 weight needs its scale") as caught:
        find_layout(entries, where="ckpt")
    assert named in str(caught.value)


def test_granularities_from_shapes() -> None:
    weight = _e("l.weight", "F8_E4M3", (300, 200))  # not block multiples: the grid is ceil(out/128) × ceil(in/128)
    cases = {(1,): "tensor", (): "tensor", (300, 1): "channel", (300,): "channel", (3, 2): "block", (2, 2): "block",
             (3,): "fused"}
    for shape, granularity in cases.items():
        layout = find_layout([weight, _e("l.weight_scale", "F32", shape)])
        assert layout is not None and layout.weights[0].granularity == granularity, shape
    layout = find_layout([weight, _e("l.weight_scale_inv", "F32", (3, 2))])
    assert layout.weights[0].block == (128, 128)
    layout = find_layout([weight, _e("l.weight_scale_inv", "F32", (3, 2))],
                         config={"quantization_config": {"weight_block_size": [100, 100]}})
    assert layout.weights[0].block == (100, 100)


def test_ignored_modules_may_stay_fp8_without_scale() -> None:
    entries = [_e("a.weight", "F8_E4M3", (128, 128)), _e("a.weight_scale_inv", "F32", (1, 1)),
               _e("lm_head.weight", "F8_E4M3", (128, 128))]
    with pytest.raises(InvalidInputError):
        find_layout(entries)
    layout = find_layout(entries, config={"quantization_config": {"modules_to_not_convert": ["lm_head"]}})
    assert [w.weight for w in layout.weights] == ["a.weight"]


def test_info_reports_an_inconsistent_checkpoint_and_convert_refuses_it(tmp_path: Path, run_cli) -> None:
    src = tmp_path / "broken.safetensors"
    save_file({"a.weight": torch.zeros(128, 128).to(torch.float8_e4m3fn), "a.weight_scale_inv": torch.ones(1, 1),
               "b.weight": torch.zeros(128, 128).to(torch.float8_e4m3fn)}, src)
    doc = json.loads(run_cli("info", src, "--json").stdout)
    assert "b.weight has no scale" in doc["quantization"]["error"]
    for args in (("--dtype", "bf16"), ()):
        line = assert_one_line_error(run_cli("convert", src, tmp_path / "out", *args))
        assert "fp8 weight b.weight has no scale b.weight_scale_inv" in line
        assert not (tmp_path / "out").exists()


def test_quantize_skip_rules_cover_diffusers_layerwise_casting() -> None:
    from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN

    from shardkit.runtime.casting import EXTRA_SKIP_PATTERNS

    assert set(DEFAULT_SKIP_MODULES_PATTERN) <= set(QUANTIZE_SKIP_PATTERNS)
    assert set(EXTRA_SKIP_PATTERNS) <= set(QUANTIZE_SKIP_PATTERNS)
    kept = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "proj_out.weight",
            "transformer_blocks.0.norm1.linear.weight", "time_text_embed.timestep_embedder.linear_1.weight",
            "x_embedder.weight", "norm_out.linear.weight", "layer.bias", "layer.weight"]
    shapes = {"layer.weight": (256,)}
    for name in kept:
        assert should_skip_quantize(_e(name, "BF16", shapes.get(name, (256, 256)))), name
    for name in ("single_transformer_blocks.0.proj_out.weight", "model.layers.0.self_attn.q_proj.weight",
                 "transformer_blocks.0.ff.net.0.proj.weight"):
        assert not should_skip_quantize(_e(name, "BF16", (256, 256))), name
    assert should_skip_quantize(_e("model.layers.0.self_attn.q_proj.weight", "F8_E4M3", (256, 256)))
