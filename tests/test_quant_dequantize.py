"""split/convert of fp8-with-scales checkpoints: dequantized whole with --dtype, copied whole without,
refused when inconsistent; ``--to diffusers`` of a ComfyUI scaled-fp8 Flux file applies the scales first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import assert_one_line_error, leftovers, load_folder, snapshot
from helpers_quant import comfy_scaled, flux_bfl_state_dict, flux_config, quantize, reference_dequant
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_quant_layouts import LAYOUTS, _layout_folder

import shardkit


def _expected(src: Path, out_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The test's own dequantization of every scaled weight of ``src``; other tensors as stored."""
    stored = load_file(src / "model.safetensors")
    expected = {}
    for name, t in stored.items():
        if name == "scaled_fp8" or name.endswith(("_scale_inv", "weight_scale", "scale_weight", "input_scale",
                                                  "scale_input")):
            continue
        scale = next((stored[name[: -len("weight")] + s] for s in ("weight_scale_inv", "weight_scale", "scale_weight")
                      if name[: -len("weight")] + s in stored), None)
        expected[name] = reference_dequant(t, scale, out_dtype) if scale is not None else t.to(out_dtype)
    return expected


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_convert_dtype_dequantizes_every_layout_exactly(kind: str, llama, tmp_path: Path, run_cli) -> None:
    src = _layout_folder(kind, llama, tmp_path)
    before = snapshot(src)
    result = run_cli("convert", src, tmp_path / "out", "--dtype", "bf16", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["quantization"]["dequantized"] == LAYOUTS[kind]
    written = load_file(tmp_path / "out" / "model.safetensors")
    expected = _expected(src, torch.bfloat16)
    assert set(written) == set(expected) == set(llama[1])  # scales, input scales and markers gone
    for name, tensor in expected.items():
        assert written[name].dtype == torch.bfloat16 and torch.equal(written[name], tensor), name
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert "_quantization_metadata" not in (f.metadata() or {})
    if (src / "config.json").exists():
        config = json.loads((tmp_path / "out" / "config.json").read_text())
        assert "quantization_config" not in config and config["hidden_size"] == 256
    assert snapshot(src) == before


def test_dequantized_llama_loads_in_transformers_close_to_the_original(llama, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    src = _layout_folder("finegrained-F32", llama, tmp_path)
    result = shardkit.convert(src, tmp_path / "out", dtype="bf16")
    assert result.quantization["weights"] == 14 and result.dtype == "BF16"
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(llama[0]).eval()(ids).logits.float()
        dequantized = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()(ids).logits.float()
    assert torch.nn.functional.cosine_similarity(plain.flatten(), dequantized.flatten(), dim=0) > 0.99


def test_without_dtype_a_scaled_checkpoint_is_copied_whole(llama, tmp_path: Path, run_cli) -> None:
    src = _layout_folder("finegrained-F32", llama, tmp_path)
    result = run_cli("split", src, tmp_path / "out", "--max-shard-size", "200KB")
    assert result.exit_code == 0, result.stderr
    written = load_folder(tmp_path / "out")
    stored = load_file(src / "model.safetensors")
    assert set(written) == set(stored)
    for name, tensor in stored.items():
        assert written[name].dtype == tensor.dtype, name  # float32 scales stay float32
        assert torch.equal(written[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"


def test_bands_cover_a_weight_larger_than_one_band(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory is bounded by the band, not the tensor: with a tiny band, many bands give the same bytes."""
    import shardkit.layouts.fp8_math as fp8

    weights = {"l.weight": torch.randn(300, 200) * 0.1, "c.weight": torch.randn(300, 200) * 0.1}
    state = {}
    for name, w in weights.items():
        granularity = "block" if name == "l.weight" else "channel"
        q, scale = quantize(w, granularity)
        state[name], state[name[: -len("weight")] + "weight_scale"] = q, scale
    src = tmp_path / "fp8"
    src.mkdir()
    save_file(state, src / "model.safetensors")
    monkeypatch.setattr(fp8, "BAND_BYTES", 200 * 4 * 3)  # block: one 128-row band; channel: 3 rows a band
    shardkit.convert(src, tmp_path / "out", dtype="fp32")
    written = load_file(tmp_path / "out" / "model.safetensors")
    with shardkit.open_source(src) as source:
        from shardkit.sharding.options import WriteOptions
        from shardkit.sharding.quant import quant_view

        view, _ = quant_view(source, options=WriteOptions(dtype="fp32"))
        entry = next(e for e in view.entries() if e.name == "l.weight")
        assert view.read(entry, 130 * 800 + 12, 260 * 800 + 4) == written["l.weight"].numpy().tobytes()[
            130 * 800 + 12: 260 * 800 + 4]  # a range across bands
    for name in weights:
        scale_name = next(n for n in state if n.startswith(name[:2]) and n != name)
        assert torch.equal(written[name], reference_dequant(state[name], state[scale_name], torch.float32)), name


def test_e4m3fnuz_weights_nan_byte_and_max(tmp_path: Path) -> None:
    raw = torch.tensor([[0x80, 0x7F, 0x01, 0x00]], dtype=torch.uint8).repeat(2, 1)
    src = tmp_path / "fnuz.safetensors"
    save_file({"l.weight": raw.view(torch.float8_e4m3fnuz), "l.weight_scale": torch.tensor([2.0]),
               "n.bias": torch.ones(2)}, src)
    shardkit.convert(src, tmp_path / "out", dtype="fp32")
    out = load_file(tmp_path / "out" / "model.safetensors")["l.weight"]
    assert torch.isnan(out[:, 0]).all()  # 0x80 is fnuz's NaN, not -0
    assert out[0, 1:].tolist() == [480.0, 2 * 2.0 ** -10, 0.0]  # 0x7F = 240, the largest, × 2


def test_fused_per_tensor_scales_must_agree(tmp_path: Path, run_cli) -> None:
    w = torch.randn(384, 128) * 0.1
    q, _ = quantize(w, "tensor")
    for values, ok in (([0.5, 0.5, 0.5], True), ([0.5, 0.25, 0.5], False)):
        src = tmp_path / f"fused-{ok}.safetensors"
        save_file({"qkv.weight": q, "qkv.weight_scale": torch.tensor(values)}, src)
        result = run_cli("convert", src, tmp_path / f"out-{ok}", "--dtype", "bf16")
        if ok:
            assert result.exit_code == 0, result.stderr
            assert torch.equal(load_file(tmp_path / f"out-{ok}" / "model.safetensors")["qkv.weight"],
                               (q.float() * 0.5).bfloat16())
        else:
            line = assert_one_line_error(result)
            assert "fused per-tensor scales disagree (qkv.weight_scale [0.5, 0.25, 0.5])" in line
            assert not (tmp_path / f"out-{ok}").exists() and not leftovers(tmp_path)


def test_verify_reports_the_fp8_scales_convert_refuses(tmp_path: Path, run_cli) -> None:
    """A NaN scale or fused per-tensor scales that disagree: convert refuses them, verify names them (read through
    the layout's strategy, as fp4 scales are)."""
    q, _ = quantize(torch.randn(384, 128) * 0.1, "tensor")
    cases = {"ok": ([0.5, 0.5, 0.5], None), "fused": ([0.5, 0.25, 0.5], "fused per-tensor scales qkv.weight_scale"),
             "nan": ([float("nan")], "scale qkv.weight_scale of qkv.weight holds non-finite values")}
    for case, (values, problem) in cases.items():
        src = tmp_path / case
        src.mkdir()
        save_file({"qkv.weight": q, "qkv.weight_scale": torch.tensor(values)}, src / "model.safetensors")
        verify = run_cli("verify", src)
        convert = run_cli("convert", src, tmp_path / f"out-{case}", "--dtype", "bf16")
        if problem is None:
            assert verify.exit_code == 0 and convert.exit_code == 0, verify.stdout + convert.stderr
            continue
        assert verify.exit_code == 1 and problem in verify.stdout, verify.stdout
        assert_one_line_error(convert)


def test_fp8_dtype_or_quantize_of_a_scaled_checkpoint_is_refused(llama, tmp_path: Path, run_cli) -> None:
    src = _layout_folder("comfy-scaled", llama, tmp_path)
    line = assert_one_line_error(run_cli("convert", src, tmp_path / "out", "--dtype", "fp8_e4m3", "--allow-lossy"))
    assert "would drop its scales" in line and "ComfyUI scaled_fp8" in line
    line = assert_one_line_error(run_cli("split", src, tmp_path / "out", "--quantize", "fp8-block"))
    assert "already quantized" in line
    assert not (tmp_path / "out").exists()


def _scaled_and_reference(tmp_path: Path, plain: dict[str, torch.Tensor]) -> None:
    """``scaled.safetensors`` (ComfyUI scaled_fp8 of ``plain``) and ``reference.safetensors`` (the test's own
    weight × scale of it, bf16): converting either must give the same diffusers model."""
    scaled = comfy_scaled({k: v.to(torch.bfloat16) for k, v in plain.items()},
                          quantized=lambda name, t: name.endswith(".weight") and t.dim() >= 2)
    save_file(scaled, tmp_path / "scaled.safetensors")
    reference = {n: t for n, t in scaled.items() if n != "scaled_fp8" and not n.endswith(("scale_weight", "scale_input"))}
    for name, t in list(reference.items()):
        if t.dtype == torch.float8_e4m3fn:
            reference[name] = reference_dequant(t, scaled[name[: -len("weight")] + "scale_weight"])
    save_file(reference, tmp_path / "reference.safetensors")


def _assert_same_conversion(tmp_path: Path, config: Path, run_cli) -> dict[str, torch.Tensor]:
    for name in ("scaled", "reference"):
        result = run_cli("convert", tmp_path / f"{name}.safetensors", tmp_path / name, "--to", "diffusers",
                         "--config", config, "--dtype", "bf16")
        assert result.exit_code == 0, result.stderr
    got = load_file(tmp_path / "scaled" / "diffusion_pytorch_model.safetensors")
    want = load_file(tmp_path / "reference" / "diffusion_pytorch_model.safetensors")
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    return got


def test_to_diffusers_applies_comfy_scales_before_the_unet_key_mapping(tmp_path: Path, run_cli) -> None:
    from diffusers import UNet2DConditionModel
    from test_convert_diffusers import SD_LIKE_UNET, unet_to_ldm

    torch.manual_seed(0)
    unet = UNet2DConditionModel(**SD_LIKE_UNET).eval()
    _scaled_and_reference(tmp_path, unet_to_ldm(unet.state_dict()))
    unet.save_config(tmp_path / "unet-config")
    got = _assert_same_conversion(tmp_path, tmp_path / "unet-config", run_cli)
    fp8 = [n for n, t in load_file(tmp_path / "scaled.safetensors").items() if t.dtype == torch.float8_e4m3fn]
    assert len(fp8) > 20  # the comparison covers dequantized convolutions and projections
    loaded = UNet2DConditionModel.from_pretrained(tmp_path / "scaled")
    assert set(loaded.state_dict()) == set(got)
    line = assert_one_line_error(run_cli("convert", tmp_path / "scaled.safetensors", tmp_path / "fp8", "--to",
                                         "diffusers", "--config", tmp_path / "unet-config", "--dtype", "fp8_e4m3",
                                         "--allow-lossy"))
    assert "diffusers models hold plain weights" in line and not (tmp_path / "fp8").exists()


@pytest.mark.slow
def test_to_diffusers_applies_comfy_scales_before_the_flux_key_mapping(tmp_path: Path, run_cli) -> None:
    """diffusers' Flux mapping fixes the width at 3072: one double and one single block of the real width."""
    from diffusers import FluxTransformer2DModel

    config = {**flux_config(), "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 128,
              "num_attention_heads": 24, "in_channels": 64, "joint_attention_dim": 64, "pooled_projection_dim": 64,
              "axes_dims_rope": [16, 56, 56]}
    with torch.device("meta"):
        FluxTransformer2DModel(**config).save_config(tmp_path / "transformer")
    _scaled_and_reference(tmp_path, flux_bfl_state_dict(config))
    _assert_same_conversion(tmp_path, tmp_path / "transformer", run_cli)


def test_a_pipeline_component_is_dequantized_with_its_config(llama, tmp_path: Path, run_cli) -> None:
    import shutil

    pipe = tmp_path / "pipe"
    pipe.mkdir()
    shutil.copytree(_layout_folder("finegrained-F32", llama, tmp_path), pipe / "text_encoder")
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": "X", "text_encoder": ["transformers",
                                                                                            "LlamaForCausalLM"]}))
    result = run_cli("split", pipe, tmp_path / "out", "--dtype", "bf16", "--json")
    assert result.exit_code == 0, result.stderr
    component = json.loads(result.stdout)["components"]["text_encoder"]
    assert component["quantization"]["dequantized"] == LAYOUTS["finegrained-F32"]
    assert "quantization_config" not in json.loads((tmp_path / "out" / "text_encoder" / "config.json").read_text())
    written = load_file(tmp_path / "out" / "text_encoder" / "model.safetensors")
    assert set(written) == set(llama[1]) and all(t.dtype == torch.bfloat16 for t in written.values())


def test_an_in_place_reshard_dequantizes_the_config_too(llama, tmp_path: Path, run_cli) -> None:
    src = _layout_folder("compressed-channel", llama, tmp_path)
    result = run_cli("split", src, src, "--overwrite", "--dtype", "bf16")
    assert result.exit_code == 0, result.stderr
    assert "quantization_config" not in json.loads((src / "config.json").read_text())
    assert shardkit.info(src).quantization is None and shardkit.info(src).bytes_by_dtype.keys() == {"BF16"}



@pytest.mark.hub
def test_a_streamed_hub_repo_is_dequantized_like_a_local_one(llama, hub, tmp_path: Path) -> None:
    """hf:// --no-cache: scales and fp8 bands come from range-read windows, in whatever order they are asked."""
    from helpers_hub import folder_files, hub_env, hub_files, run_shardkit

    src = _layout_folder("finegrained-F32", llama, tmp_path)
    shardkit.split(src, tmp_path / "sharded", max_shard_size="400KB")  # weights and scales over several shards
    hub.state.add_repo("alice/fp8", hub_files(tmp_path / "sharded"))
    proc = run_shardkit(hub_env(hub, tmp_path / "home"), "convert", "hf://alice/fp8", tmp_path / "streamed",
                        "--dtype", "bf16", "--no-cache", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["quantization"]["dequantized"] == LAYOUTS["finegrained-F32"]
    shardkit.convert(tmp_path / "sharded", tmp_path / "local", dtype="bf16")
    assert folder_files(tmp_path / "streamed") == folder_files(tmp_path / "local")


def test_torchrun_convert_dequantizes_like_one_process(llama, tmp_path: Path) -> None:
    """The collective writer takes the same job (dequantized view, edited config.json) as one process."""
    from test_distributed import _folder_bytes, _torchrun_convert

    src = _layout_folder("finegrained-F32", llama, tmp_path)
    shardkit.convert(src, tmp_path / "ref", max_shard_size="10KB", dtype="bf16")
    run = _torchrun_convert(src, tmp_path / "out", 2, "--dtype", "bf16")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    assert _folder_bytes(tmp_path / "out") == _folder_bytes(tmp_path / "ref")
