"""``--quantize fp8-block|fp8-channel|fp8-tensor``: layouts the real loaders read (transformers FineGrainedFP8,
compressed-tensors), equal bit for bit to shardkit's own dequantization, precision-critical layers kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import assert_one_line_error, snapshot
from helpers_quant import LLAMA
from safetensors.torch import load_file

import shardkit


def _logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(ids).logits.float(), model.state_dict()


SCHEMES = {"fp8-block": ("weight_scale_inv", "F32", "transformers FineGrainedFP8"),
           "fp8-channel": ("weight_scale", "BF16", "compressed-tensors float-quantized"),
           "fp8-tensor": ("weight_scale", "BF16", "compressed-tensors float-quantized")}


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_quantized_llama_loads_in_transformers_equal_to_shardkits_dequantization(
        scheme: str, llama, tmp_path: Path, run_cli) -> None:
    if scheme != "fp8-block":
        pytest.importorskip("compressed_tensors")
    src, state = llama
    before = snapshot(src)
    result = run_cli("convert", src, tmp_path / "fp8", "--quantize", scheme, "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)["quantization"]
    suffix, scale_dtype, scheme_name = SCHEMES[scheme]
    linears = [n for n in state if n.endswith("_proj.weight")]
    assert report["quantized"] == len(linears) == 14
    assert set(report["kept"]) == {"lm_head", "model.embed_tokens"}
    assert set(report["errors"]) == set(linears)
    assert all(0 < e["relative_error"] < 0.06 for e in report["errors"].values())
    header = {e.name: e for e in shardkit.read_header(tmp_path / "fp8" / "model.safetensors").entries}
    for name in linears:
        assert header[name].dtype == "F8_E4M3" and header[name[: -len("weight")] + suffix].dtype == scale_dtype
    for name in ("model.norm.weight", "model.embed_tokens.weight", "lm_head.weight"):
        assert header[name].dtype == "BF16"
    assert shardkit.info(tmp_path / "fp8").quantization["scheme"] == scheme_name
    qconfig = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    ignored = qconfig.get("modules_to_not_convert") or qconfig.get("ignore")
    assert "lm_head" in ignored and "model.embed_tokens" in ignored

    ids = torch.randint(0, LLAMA["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(0))
    plain, _ = _logits(src, ids)
    quantized, loaded = _logits(tmp_path / "fp8", ids)  # transformers on CPU: dequantized (fp8) / decompressed (ct)
    assert torch.nn.functional.cosine_similarity(plain.flatten(), quantized.flatten(), dim=0) > 0.99
    shardkit.convert(tmp_path / "fp8", tmp_path / "bf16", dtype="bf16")
    mine = load_file(tmp_path / "bf16" / "model.safetensors")
    assert set(mine) == set(state)
    for name, tensor in mine.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    assert snapshot(src) == before


def test_quantize_keeps_scales_uncast_and_other_tensors_cast(llama, tmp_path: Path) -> None:
    src, state = llama
    f32 = tmp_path / "f32"
    shardkit.convert(src, f32, dtype="fp32")
    result = shardkit.convert(f32, tmp_path / "out", quantize="fp8-block", dtype="bf16", max_shard_size="300KB")
    assert result.quantization["quantized"] == 14 and len(result.plan.shards) > 1
    header = {e.name: e.dtype for h in shardkit.info(tmp_path / "out").shards
              for e in shardkit.read_header(tmp_path / "out" / h.file).entries}
    assert header["model.layers.0.mlp.up_proj.weight_scale_inv"] == "F32"
    assert header["model.layers.0.mlp.up_proj.weight"] == "F8_E4M3"
    assert header["model.norm.weight"] == "BF16" and header["lm_head.weight"] == "BF16"


def test_block_quantize_keeps_weights_that_are_not_block_multiples(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    src = tmp_path / "m.safetensors"
    save_file({"a.weight": torch.randn(256, 128), "b.weight": torch.randn(200, 128)}, src)
    result = shardkit.convert(src, tmp_path / "out", quantize="fp8-block")
    assert result.quantization["kept"] == ["b"] and result.quantization["quantized"] == 1
    result = shardkit.convert(src, tmp_path / "ch", quantize="fp8-channel")
    assert result.quantization["quantized"] == 2
    out = load_file(tmp_path / "ch" / "model.safetensors")
    assert out["b.weight_scale"].shape == (200, 1) and out["b.weight_scale"].dtype == torch.float32


HUGE_BAND = 2**40  # every weight in one band: the whole tensor at once


def _quantize_and_back(src: Path, out: Path, scheme: str, monkeypatch: pytest.MonkeyPatch, *,
                       band_bytes: int | None = None) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``src`` quantized by ``scheme`` (with ``band_bytes`` in both fp8 and fp4 bands when given), and that read
    back in bf16: both outputs' tensors."""
    import shardkit.layouts.fp4_math as fp4_math
    import shardkit.layouts.fp8_math as fp8_math

    if band_bytes is not None:
        monkeypatch.setattr(fp8_math, "BAND_BYTES", band_bytes)
        monkeypatch.setattr(fp4_math, "BAND_BYTES", band_bytes)
    out.mkdir()
    shardkit.split(src, out / "q", quantize=scheme)
    shardkit.convert(out / "q", out / "bf16", dtype="bf16")
    return load_file(out / "q" / "model.safetensors"), load_file(out / "bf16" / "model.safetensors")


def _save_plain(folder: Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    state = {name: (torch.randn(shape, generator=g) * 0.05).to(torch.bfloat16) for name, shape in shapes.items()}
    folder.mkdir()
    save_file(state, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return state


def test_block_quantize_of_a_weight_wider_than_one_band_of_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At the default band, 128 rows of a weight wider than 32,768 columns are more than a band: the band is still
    whole 128-row blocks, and the bytes are those of the whole tensor quantized at once (and read back)."""
    from shardkit.layouts.fp8_math import quantize_band

    state = _save_plain(tmp_path / "plain", {"wide.weight": (256, 257 * 128), "odd.weight": (200, 257 * 128)})
    banded = _quantize_and_back(tmp_path / "plain", tmp_path / "banded", "fp8-block", monkeypatch)
    q, scale = quantize_band(state["wide.weight"].float(), "block")
    assert torch.equal(banded[0]["wide.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(banded[0]["wide.weight_scale_inv"], scale)
    assert torch.equal(banded[0]["odd.weight"], state["odd.weight"])  # rows not a multiple of 128: kept, as before
    whole = _quantize_and_back(tmp_path / "plain", tmp_path / "whole", "fp8-block", monkeypatch, band_bytes=HUGE_BAND)
    for got, want in zip(banded, whole, strict=True):
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), name


@pytest.mark.parametrize("band_bytes", [127 * 256 * 4, 1000])
@pytest.mark.parametrize("scheme", ["fp8-block", "fp8-channel", "fp8-tensor", "nvfp4", "mxfp4"])
def test_a_band_narrower_than_a_block_row_gives_the_whole_tensors_bytes(scheme: str, band_bytes: int, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A band of 127 rows of 256 columns (less than one 128-row block, and than one expert), or less than one row:
    quantized and read back, every byte is the one-band bytes."""
    shapes = {"l.weight": (384, 256), "w.weight": (256, 512), "norm.weight": (256,),
              "m.experts.gate_up_proj": (2, 256, 384), "m.experts.down_proj": (2, 384, 256)}
    _save_plain(tmp_path / "plain", shapes)
    banded = _quantize_and_back(tmp_path / "plain", tmp_path / "banded", scheme, monkeypatch, band_bytes=band_bytes)
    whole = _quantize_and_back(tmp_path / "plain", tmp_path / "whole", scheme, monkeypatch, band_bytes=HUGE_BAND)
    assert len(banded[0]) > len(shapes)  # something was quantized
    for got, want in zip(banded, whole, strict=True):
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), name


def test_quantized_flux_transformer_keeps_modulation_and_runs_close(tmp_path: Path) -> None:
    from diffusers import FluxTransformer2DModel
    from helpers_offload import run_flux

    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                   attention_head_dim=64, num_attention_heads=2, joint_attention_dim=128,
                                   pooled_projection_dim=128, axes_dims_rope=[16, 16, 32]).eval()
    model.save_pretrained(tmp_path / "flux")
    result = shardkit.convert(tmp_path / "flux", tmp_path / "fp8", quantize="fp8-block")
    kept = set(result.quantization["kept"])
    assert {"x_embedder", "context_embedder", "norm_out.linear", "proj_out",
            "transformer_blocks.0.norm1.linear", "single_transformer_blocks.0.norm.linear"} <= kept
    assert "transformer_blocks.0.attn.to_q" not in kept and result.quantization["quantized"] >= 8
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    shardkit.convert(tmp_path / "fp8", tmp_path / "back", dtype="fp32")
    back = FluxTransformer2DModel.from_pretrained(tmp_path / "back").eval()
    assert "quantization_config" not in json.loads((tmp_path / "back" / "config.json").read_text())
    g = torch.Generator().manual_seed(1)
    inputs = {"hidden_states": torch.randn(1, 16, 16, generator=g), "encoder_hidden_states": torch.randn(1, 8, 128, generator=g),
              "pooled_projections": torch.randn(1, 128, generator=g), "timestep": torch.tensor([0.5]),
              "img_ids": torch.zeros(16, 3), "txt_ids": torch.zeros(8, 3)}
    want, got = run_flux(model, inputs), run_flux(back, inputs)
    assert torch.nn.functional.cosine_similarity(want.flatten(), got.flatten(), dim=0) > 0.99


def test_bad_quantize_options_exit_2(llama, tmp_path: Path, run_cli) -> None:
    src, _ = llama
    line = assert_one_line_error(run_cli("split", src, tmp_path / "o", "--quantize", "fp8-block", "--dtype",
                                         "fp8_e4m3", "--allow-lossy"))
    assert "--dtype casts the tensors --quantize keeps" in line
    with pytest.raises(shardkit.InvalidInputError, match="expected one of fp8-block"):
        shardkit.split(src, tmp_path / "o", quantize="int4")
    assert run_cli("split", src, tmp_path / "o", "--quantize", "int4").exit_code == 2
    assert not (tmp_path / "o").exists()


def test_the_cli_summary_says_what_was_quantized_and_dequantized(llama, tmp_path: Path, run_cli) -> None:
    result = run_cli("convert", llama[0], tmp_path / "fp8", "--quantize", "fp8-channel")
    assert result.exit_code == 0, result.stderr
    assert "quantized 14 weight(s) to fp8-channel, kept 2 module(s) as they were, largest relative error 0.0" \
        in result.stdout
    result = run_cli("split", tmp_path / "fp8", tmp_path / "bf16", "--dtype", "bf16")
    assert result.exit_code == 0, result.stderr
    assert ("dequantized 14 weight(s) from fp8, per-channel scales, bf16 scales (compressed-tensors float-quantized) "
            "to BF16") in result.stdout


def test_quantizing_an_fp32_checkpoint_keeps_modules_in_bf16_so_fp8_is_smaller(tmp_path: Path, run_cli) -> None:
    from helpers_quant import tiny_llama
    from transformers import AutoModelForCausalLM

    tiny_llama().float().save_pretrained(tmp_path / "f32")
    result = run_cli("convert", tmp_path / "f32", tmp_path / "fp8", "--quantize", "fp8-block")
    assert result.exit_code == 0, result.stderr
    assert "kept 2 module(s) in BF16 (stored wider; the compute dtype: --dtype fp32 keeps them fp32)" in result.stdout
    assert run_cli("convert", tmp_path / "f32", tmp_path / "bf16", "--dtype", "bf16").exit_code == 0
    fp8, bf16 = (shardkit.info(tmp_path / name).total_bytes for name in ("fp8", "bf16"))
    assert fp8 < 0.7 * bf16, (fp8, bf16)
    header = {e.name: e.dtype for e in shardkit.read_header(tmp_path / "fp8" / "model.safetensors").entries}
    assert header["model.embed_tokens.weight"] == header["model.norm.weight"] == "BF16"
    assert header["model.layers.0.mlp.up_proj.weight"] == "F8_E4M3"
    assert header["model.layers.0.mlp.up_proj.weight_scale_inv"] == "F32"
    AutoModelForCausalLM.from_pretrained(tmp_path / "fp8")  # transformers reads it

    kept = run_cli("convert", tmp_path / "f32", tmp_path / "fp8-f32", "--quantize", "fp8-block", "--dtype", "fp32",
                   "--json")
    assert kept.exit_code == 0, kept.stderr
    assert json.loads(kept.stdout)["quantization"]["kept_dtype"] == "F32"
    header = {e.name: e.dtype for e in shardkit.read_header(tmp_path / "fp8-f32" / "model.safetensors").entries}
    assert header["model.norm.weight"] == "F32"


def test_a_plain_fp8_cast_points_to_quantize(llama, tmp_path: Path, run_cli) -> None:
    result = run_cli("convert", llama[0], tmp_path / "fp8", "--dtype", "fp8_e4m3", "--allow-lossy")
    assert result.exit_code == 0, result.stderr
    assert "cannot load as a model" in result.stderr and "--quantize fp8-block" in result.stderr
    quiet = run_cli("convert", llama[0], tmp_path / "q", "--quantize", "fp8-block")
    assert "warning" not in quiet.stderr
