"""fp4 checkpoints (NVFP4 ModelOpt and compressed-tensors, gpt-oss MXFP4): named by ``info`` from headers,
dequantized by ``convert --dtype`` bit-equal to each reference, refused when a scale or the recipe is missing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import assert_one_line_error, snapshot
from helpers_fp4 import (
    ct_nvfp4_decompress,
    modelopt_reference,
    save_ct_nvfp4,
    save_gpt_oss_mxfp4,
    save_modelopt_nvfp4,
)
from safetensors.torch import load_file, save_file

import shardkit
from shardkit.layouts.fp4 import COMPRESSED_NVFP4, MODELOPT_NVFP4, MXFP4

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _nvfp4(kind: str, llama: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> Path:
    folder, state = llama
    config = json.loads((folder / "config.json").read_text())
    out = tmp_path / kind
    if kind == "ct":
        save_ct_nvfp4(out, state, config)
    elif kind == "ct-w4a4":
        save_ct_nvfp4(out, state, config, activations=True)
    elif kind == "modelopt":
        save_modelopt_nvfp4(out, state, config)
    else:  # the recipe in config.json only
        save_modelopt_nvfp4(out, state, config, hf_quant_config=False, in_config=True)
    return out


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    folder = tmp_path_factory.mktemp("gptoss") / "mxfp4"
    return folder, save_gpt_oss_mxfp4(folder)


@pytest.mark.parametrize("kind,scheme", [("ct", COMPRESSED_NVFP4), ("ct-w4a4", COMPRESSED_NVFP4),
                                         ("modelopt", MODELOPT_NVFP4), ("modelopt-config", MODELOPT_NVFP4)])
def test_info_names_nvfp4_layouts_from_headers(kind: str, scheme: str, llama, tmp_path: Path, run_cli) -> None:
    src = _nvfp4(kind, llama, tmp_path)
    result = run_cli("info", src, "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    quant = summary["quantization"]
    assert quant["scheme"] == scheme and quant["block_size"] == 16 and quant["scale_dtype"] == "F8_E4M3"
    assert quant["scaled_weights"] == 14 and "error" not in quant
    q = next(w for w in quant["weights"] if w["dequantized"] == "model.layers.0.self_attn.q_proj.weight")
    assert q["shape"] == [256, 256] and q["weight"].endswith(("q_proj.weight", "q_proj.weight_packed"))
    assert len(q["scales"]) == 2
    assert summary["parameter_count"] == sum(t.numel() for t in llama[1].values())
    assert summary["memory_bytes"]["bf16"] == sum(t.numel() * 2 for t in llama[1].values())  # dequantized size
    text = run_cli("info", src)
    assert f"nvfp4 (e2m1), 16-value blocks, fp8 (e4m3) scales + float32 global scale ({scheme})" in text.stdout


def test_info_names_gpt_oss_mxfp4(gpt_oss, run_cli) -> None:
    folder, state = gpt_oss
    result = run_cli("info", folder, "--json")
    assert result.exit_code == 0, result.stderr
    quant = json.loads(result.stdout)["quantization"]
    assert quant["scheme"] == MXFP4 and quant["block_size"] == 32 and quant["scaled_weights"] == 4
    gate_up = next(w for w in quant["weights"] if w["dequantized"] == "model.layers.0.mlp.experts.gate_up_proj")
    assert gate_up["shape"] == list(state["model.layers.0.mlp.experts.gate_up_proj"].shape)
    assert gate_up["scales"] == ["model.layers.0.mlp.experts.gate_up_proj_scales"]


@pytest.mark.parametrize("kind", ["ct", "ct-w4a4"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_convert_dequantizes_compressed_tensors_nvfp4_as_compressed_tensors_does(kind: str, dtype: str, llama,
                                                                                 tmp_path: Path, run_cli) -> None:
    src = _nvfp4(kind, llama, tmp_path)
    before = snapshot(src)
    result = run_cli("convert", src, tmp_path / "out", "--dtype", dtype, "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["quantization"]["dequantized"].endswith(f"({COMPRESSED_NVFP4})")
    stored, written = load_file(src / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert set(written) == set(llama[1])  # packed names, scales and input scales gone
    for name, tensor in written.items():
        prefix = name[: -len("weight")]
        if prefix + "weight_packed" in stored:
            module = {k: stored[prefix + k] for k in ("weight_packed", "weight_scale", "weight_global_scale")}
            expected = ct_nvfp4_decompress(module, dtype=TORCH_DTYPES[dtype])
            assert tensor.dtype == TORCH_DTYPES[dtype] and torch.equal(tensor, expected), name
        else:
            assert torch.equal(tensor, stored[name].to(TORCH_DTYPES[dtype])), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and config["hidden_size"] == 256
    assert snapshot(src) == before


@pytest.mark.parametrize("kind", ["modelopt", "modelopt-config"])
def test_convert_dequantizes_modelopt_nvfp4_with_its_formula(kind: str, llama, tmp_path: Path, run_cli) -> None:
    src = _nvfp4(kind, llama, tmp_path)
    result = run_cli("convert", src, tmp_path / "out", "--dtype", "bf16")
    assert result.exit_code == 0, result.stderr
    stored, written = load_file(src / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert set(written) == set(llama[1])  # weight_scale, weight_scale_2 and input_scale gone
    quantized = 0
    for name, tensor in written.items():
        prefix = name[: -len("weight")]
        if prefix + "weight_scale_2" not in stored:
            assert torch.equal(tensor, stored[name]), name
            continue
        quantized += 1
        expected = modelopt_reference(stored[name], stored[prefix + "weight_scale"], stored[prefix + "weight_scale_2"])
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected), name
        # compressed-tensors, after inverting the global scale: the same up to one bf16 ulp in a few elements
        inverted = {"weight_packed": stored[name], "weight_scale": stored[prefix + "weight_scale"],
                    "weight_global_scale": (1 / stored[prefix + "weight_scale_2"]).reshape(1)}
        theirs = ct_nvfp4_decompress(inverted)
        assert torch.allclose(theirs.float(), tensor.float(), rtol=2**-7, atol=0), name
        assert (theirs != tensor).float().mean() < 0.05, name
        assert (tensor.float() - llama[1][name].float()).abs().max() < 0.1, name  # it is the weight, not codes
    assert quantized == 14
    assert not (tmp_path / "out" / "hf_quant_config.json").exists()
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_convert_dequantizes_gpt_oss_mxfp4_as_transformers_does(dtype: str, gpt_oss, tmp_path: Path,
                                                                run_cli) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    folder, state = gpt_oss
    result = run_cli("convert", folder, tmp_path / "out", "--dtype", dtype)
    assert result.exit_code == 0, result.stderr
    stored, written = load_file(folder / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert set(written) == set(state)  # dense names, no blocks or scales
    for name, tensor in written.items():
        if name + "_blocks" in stored:
            expected = convert_moe_packed_tensors(stored[name + "_blocks"], stored[name + "_scales"],
                                                  dtype=TORCH_DTYPES[dtype])
            assert tensor.shape == state[name].shape and torch.equal(tensor, expected), name
        else:
            assert torch.equal(tensor, stored[name].to(TORCH_DTYPES[dtype])), name


def test_dequantized_gpt_oss_loads_in_transformers(gpt_oss, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder, state = gpt_oss
    shardkit.convert(folder, tmp_path / "out", dtype="bf16")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    loaded = model.state_dict()
    written = load_file(tmp_path / "out" / "model.safetensors")
    for name, tensor in written.items():
        assert torch.equal(loaded[name], tensor), name
    gate_up = "model.layers.0.mlp.experts.gate_up_proj"
    assert (loaded[gate_up].float() - state[gate_up].float()).abs().max() < 0.05  # close to the unquantized one


def test_bands_give_the_same_bytes_as_one_pass(gpt_oss, llama, tmp_path: Path, monkeypatch) -> None:
    import shardkit.layouts.fp4_math as fp4_source

    folder, _ = gpt_oss
    nvfp4 = _nvfp4("modelopt", llama, tmp_path)
    shardkit.convert(folder, tmp_path / "whole-mx", dtype="bf16")
    shardkit.convert(nvfp4, tmp_path / "whole-nv", dtype="bf16")
    monkeypatch.setattr(fp4_source, "BAND_BYTES", 4096)  # many bands of rows / of expert columns
    shardkit.convert(folder, tmp_path / "bands-mx", dtype="bf16", max_shard_size="20KB")
    shardkit.convert(nvfp4, tmp_path / "bands-nv", dtype="bf16", max_shard_size="100KB")
    for kind in ("mx", "nv"):
        whole = load_file(tmp_path / f"whole-{kind}" / "model.safetensors")
        bands: dict[str, torch.Tensor] = {}
        for path in sorted((tmp_path / f"bands-{kind}").glob("*.safetensors")):
            bands.update(load_file(path))
        assert bands.keys() == whole.keys() and all(torch.equal(bands[k], whole[k]) for k in whole)


def test_modelopt_without_its_recipe_is_refused_not_misread(llama, tmp_path: Path, run_cli) -> None:
    src = _nvfp4("modelopt", llama, tmp_path)
    (src / "hf_quant_config.json").unlink()
    result = run_cli("convert", src, tmp_path / "out", "--dtype", "bf16")
    assert_one_line_error(result, code=2, contains="hf_quant_config.json")
    assert not (tmp_path / "out").exists()
    verify = run_cli("verify", src)
    assert verify.exit_code == 1 and "quantization metadata" in verify.stdout + verify.stderr


def test_nvfp4_without_quantization_config_is_refused(llama, tmp_path: Path, run_cli) -> None:
    src = _nvfp4("ct", llama, tmp_path)
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    (src / "config.json").write_text(json.dumps(config))
    for command in (["convert", src, tmp_path / "out", "--dtype", "bf16"], ["split", src, tmp_path / "out2"]):
        assert_one_line_error(run_cli(*command), code=2, contains="quantization_config")
    assert run_cli("verify", src).exit_code == 1


def test_nvfp4_with_a_scale_removed_is_refused_naming_it(llama, tmp_path: Path, run_cli) -> None:
    src = _nvfp4("ct", llama, tmp_path)
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight_scale"]
    save_file(tensors, src / "model.safetensors")
    line = assert_one_line_error(run_cli("convert", src, tmp_path / "out", "--dtype", "bf16"), code=2)
    assert "model.layers.1.mlp.down_proj.weight_scale" in line
    verify = run_cli("verify", src)
    assert verify.exit_code == 1 and "model.layers.1.mlp.down_proj.weight_scale" in verify.stdout
    info = json.loads(run_cli("info", src, "--json").stdout)["quantization"]
    assert "model.layers.1.mlp.down_proj.weight_scale" in info["error"]


def test_mxfp4_missing_one_scales_tensor_does_not_convert(gpt_oss, tmp_path: Path, run_cli) -> None:
    folder, _ = gpt_oss
    src = tmp_path / "broken"
    src.mkdir()
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, src / "model.safetensors")
    (src / "config.json").write_text((folder / "config.json").read_text())
    for command in (["convert", src, tmp_path / "out", "--dtype", "bf16"], ["convert", src, tmp_path / "out"],
                    ["split", src, tmp_path / "out"]):
        line = assert_one_line_error(run_cli(*command), code=2)
        assert "model.layers.1.mlp.experts.down_proj_scales" in line
    assert not (tmp_path / "out").exists()
    verify = run_cli("verify", src)
    assert verify.exit_code == 1 and "down_proj_scales" in verify.stdout
    lossy = run_cli("convert", src, tmp_path / "lossy", "--dtype", "bf16", "--allow-lossy")
    assert lossy.exit_code == 0, lossy.stderr
    written = load_file(tmp_path / "lossy" / "model.safetensors")
    assert torch.equal(written["model.layers.1.mlp.experts.down_proj_blocks"],
                       tensors["model.layers.1.mlp.experts.down_proj_blocks"])  # kept as stored, not lost
    assert written["model.layers.0.mlp.experts.down_proj"].dtype == torch.bfloat16


def test_non_finite_scale_is_flagged_and_refused(llama, tmp_path: Path, run_cli) -> None:
    src = _nvfp4("modelopt", llama, tmp_path)
    tensors = load_file(src / "model.safetensors")
    scale = tensors["model.layers.0.mlp.up_proj.weight_scale"]
    scale.view(torch.uint8)[3, 2] = 0x7F  # e4m3fn NaN
    save_file(tensors, src / "model.safetensors")
    verify = run_cli("verify", src)
    assert verify.exit_code == 1 and "model.layers.0.mlp.up_proj.weight_scale" in verify.stdout
    line = assert_one_line_error(run_cli("convert", src, tmp_path / "out", "--dtype", "bf16"), code=2)
    assert "model.layers.0.mlp.up_proj.weight_scale" in line
    lossy = run_cli("convert", src, tmp_path / "lossy", "--dtype", "bf16", "--allow-lossy")
    assert lossy.exit_code == 0, lossy.stderr
    written = load_file(tmp_path / "lossy" / "model.safetensors")
    assert written["model.layers.0.mlp.up_proj.weight"].dtype == torch.uint8  # kept packed, with its scales
    assert "model.layers.0.mlp.up_proj.weight_scale" in written
    assert written["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16


def test_a_consistent_fp4_checkpoint_verifies_and_copies_whole(gpt_oss, tmp_path: Path, run_cli) -> None:
    folder, _ = gpt_oss
    assert run_cli("verify", folder).exit_code == 0
    result = run_cli("split", folder, tmp_path / "out", "--max-shard-size", "50KB")
    assert result.exit_code == 0, result.stderr
    written: dict[str, torch.Tensor] = {}
    for path in sorted((tmp_path / "out").glob("*.safetensors")):
        written.update(load_file(path))
    stored = load_file(folder / "model.safetensors")
    assert written.keys() == stored.keys() and all(torch.equal(written[k], stored[k]) for k in stored)


@pytest.mark.hub
def test_push_refuses_an_mxfp4_checkpoint_missing_scales_unless_allow_lossy(gpt_oss, hub, tmp_path: Path) -> None:
    from helpers_hub import hub_env, run_shardkit

    folder, _ = gpt_oss
    src = tmp_path / "broken"
    src.mkdir()
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.0.mlp.experts.gate_up_proj_scales"]
    save_file(tensors, src / "model.safetensors")
    (src / "config.json").write_text((folder / "config.json").read_text())
    env = hub_env(hub, tmp_path / "home")
    refused = run_shardkit(env, "push", src, "alice/fp4")
    line = assert_one_line_error(refused, code=2, contains="--allow-lossy")
    assert "model.layers.0.mlp.experts.gate_up_proj_scales" in line and ("model", "alice/fp4") not in hub.state.repos
    pushed = run_shardkit(env, "push", src, "alice/fp4", "--allow-lossy", "-q")
    assert pushed.returncode == 0, pushed.stderr
    assert "model.safetensors" in hub.state.files_at("alice/fp4")


@pytest.mark.hub
def test_info_over_hf_names_modelopt_nvfp4_from_headers_and_hf_quant_config(llama, hub, tmp_path: Path) -> None:
    from helpers_hub import hub_env, run_shardkit

    src = _nvfp4("modelopt", llama, tmp_path)
    hub.state.add_repo("nvidia/tiny-nvfp4", {p.name: p.read_bytes() for p in src.iterdir()})
    proc = run_shardkit(hub_env(hub, tmp_path / "home"), "info", "hf://nvidia/tiny-nvfp4", "--json")
    assert proc.returncode == 0, proc.stderr
    quant = json.loads(proc.stdout)["quantization"]
    assert quant["scheme"] == MODELOPT_NVFP4 and quant["scaled_weights"] == 14 and "error" not in quant


def test_hostile_hf_quant_config_is_one_line(llama, tmp_path: Path, run_cli) -> None:
    src = _nvfp4("modelopt", llama, tmp_path)
    for hostile in (b"{" * 100, b"[" * 200_000):
        (src / "hf_quant_config.json").write_bytes(hostile)
        assert_one_line_error(run_cli("convert", src, tmp_path / "out", "--dtype", "bf16"), code=2,
                              contains="hf_quant_config.json")
    (src / "hf_quant_config.json").write_text(json.dumps({"quantization": "NVFP4"}))  # not an object: no recipe
    assert_one_line_error(run_cli("convert", src, tmp_path / "out", "--dtype", "bf16"), code=2,
                          contains="quantization metadata")
