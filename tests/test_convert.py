"""``shardkit convert`` / ``shardkit.convert``: every source kind, .ckpt key handling, errors."""

from __future__ import annotations

import json
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from conftest import (
    assert_bit_equal,
    assert_one_line_error,
    float_state_dict,
    leftovers,
    load_folder,
    make_state_dict,
    snapshot,
)
from safetensors.torch import save_file

import shardkit
from shardkit.errors import InvalidInputError, ShardkitWarning


def sd_checkpoint(seed: int = 0) -> dict:
    """A Lightning / Stable Diffusion style .ckpt: nested state_dict, EMA copies, training extras."""
    g = torch.Generator().manual_seed(seed)
    unet = {
        "conv_in.weight": torch.randn(8, 4, 3, 3, generator=g),
        "conv_in.bias": torch.randn(8, generator=g),
        "time_embed.0.weight": torch.randn(16, 8, generator=g),
        "out.2.weight": torch.randn(4, 8, 3, 3, generator=g),
    }
    state = {f"model.diffusion_model.{k}": v for k, v in unet.items()}
    state["first_stage_model.encoder.conv_in.weight"] = torch.randn(4, 3, generator=g)
    state["cond_stage_model.transformer.embeddings.weight"] = torch.randn(10, 4, generator=g)
    state["model_ema.decay"] = torch.tensor(0.9999)
    state["model_ema.num_updates"] = torch.tensor(10, dtype=torch.int32)
    state["model_ema.diffusion_modelconv_inweight"] = unet["conv_in.weight"].clone()
    return {"state_dict": state, "epoch": 3, "global_step": 1200, "callbacks": {}}, unet


# ----------------------------------------------------------------------------- .ckpt

def test_ckpt_nested_state_dict_with_prefix_and_fp16(tmp_path: Path, run_cli) -> None:
    ckpt, unet = sd_checkpoint()
    src = tmp_path / "v1-5-pruned.ckpt"
    torch.save(ckpt, src)
    out = tmp_path / "unet-out"
    result = run_cli("convert", src, out, "--key", "state_dict", "--strip-prefix", "model.diffusion_model.",
                     "--dtype", "fp16", "--max-shard-size", "600B")
    assert result.exit_code == 0, result.stderr
    assert "also holds 3 EMA tensors" in result.stderr
    assert (out / "model.safetensors.index.json").exists()
    got = load_folder(out)
    assert_bit_equal(got, {k: v.to(torch.float16) for k, v in unet.items()})


def test_ckpt_key_is_auto_detected_and_ema_reported(tmp_path: Path) -> None:
    ckpt, unet = sd_checkpoint()
    src = tmp_path / "model.ckpt"
    torch.save(ckpt, src)
    with pytest.warns(ShardkitWarning, match=r"3 EMA tensors \(model_ema\.\*\) are included.*exclude=\['model_ema\.\*'\]"):
        result = shardkit.convert(src, tmp_path / "all", max_shard_size="1MB")
    assert result.ema_tensors == 3
    assert_bit_equal(load_folder(tmp_path / "all"), ckpt["state_dict"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no EMA warning once they are excluded... but one saying they exist
        with pytest.raises(ShardkitWarning, match="not selected"):
            shardkit.convert(src, tmp_path / "no-ema", exclude=["model_ema.*"], dry_run=True)


def test_missing_key_lists_the_keys_that_exist(tmp_path: Path, run_cli) -> None:
    ckpt, _ = sd_checkpoint()
    src = tmp_path / "model.ckpt"
    torch.save(ckpt, src)
    line = assert_one_line_error(run_cli("convert", src, tmp_path / "out", "--key", "ema"), contains="'ema' not found")
    for key in ("state_dict", "epoch", "global_step"):
        assert key in line
    assert not (tmp_path / "out").exists()


def test_non_tensor_values_are_an_error_naming_them(tmp_path: Path, run_cli) -> None:
    src = tmp_path / "mixed.pt"
    torch.save({"w": torch.ones(2), "step": 5, "lr": 0.1}, src)
    line = assert_one_line_error(run_cli("convert", src, tmp_path / "out"), contains="not tensors")
    assert "'step'" in line and "'lr'" in line
    assert not (tmp_path / "out").exists()


class _Payload:
    def __reduce__(self):  # runs os.system on a plain pickle.load
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_and_its_payload_never_runs(tmp_path: Path, run_cli) -> None:
    marker = tmp_path / "pwned"
    payload = _Payload()
    payload.marker = marker
    src = tmp_path / "evil.bin"
    torch.save({"w": torch.ones(2), "x": payload}, src)
    assert_one_line_error(run_cli("convert", src, tmp_path / "out"), contains="refused to unpickle")
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_corrupt_pickle_is_a_one_line_error(tmp_path: Path, run_cli) -> None:
    src = tmp_path / "broken.bin"
    torch.save({"w": torch.randn(100)}, src)
    src.write_bytes(src.read_bytes()[:200])
    result = run_cli("convert", src, tmp_path / "out")
    # A truncated zip no longer looks like one: a legacy-pickle warning may precede the error line.
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    assert result.error_lines[-1].startswith("error:") and "not a readable PyTorch checkpoint" in result.error_lines[-1]
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- every source kind

def _sources(tmp: Path, sd: dict) -> dict[str, Path]:

    kinds = {}
    save_file(sd, str(tmp / "model.safetensors"))
    kinds["safetensors file"] = tmp / "model.safetensors"
    (tmp / "zip").mkdir()
    torch.save(sd, tmp / "zip" / "pytorch_model.bin")
    kinds["zip pickle"] = tmp / "zip" / "pytorch_model.bin"
    kinds["folder with pytorch_model.bin"] = tmp / "zip"
    torch.save({"state_dict": sd}, tmp / "nested.pt")
    kinds["nested .pt"] = tmp / "nested.pt"
    return kinds


def _more_sources(tmp: Path, sd: dict) -> dict[str, Path]:
    import huggingface_hub

    kinds = {}
    for name, safe in (("st-sharded", True), ("bin-sharded", False)):
        (tmp / name).mkdir()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            huggingface_hub.save_torch_state_dict(sd, tmp / name, safe_serialization=safe, max_shard_size=300)
    kinds["sharded safetensors folder"] = tmp / "st-sharded"
    kinds["sharded safetensors index"] = tmp / "st-sharded" / "model.safetensors.index.json"
    kinds["sharded pickle folder"] = tmp / "bin-sharded"
    kinds["sharded pickle index"] = tmp / "bin-sharded" / "pytorch_model.bin.index.json"
    return kinds


def test_legacy_pickle_round_trips_bit_equal(tmp_path: Path) -> None:
    # torch cannot read unsigned or fp8 tensors back from its legacy format at all: classic dtypes only
    sd = make_state_dict(["BOOL", "U8", "I8", "I16", "F16", "BF16", "I32", "F32", "F64", "I64", "C64"],
                         shapes=[(), (0,), (33, 17)])
    torch.save(sd, tmp_path / "legacy.pth", _use_new_zipfile_serialization=False)
    with pytest.warns(ShardkitWarning, match="legacy"):
        shardkit.convert(tmp_path / "legacy.pth", tmp_path / "out", max_shard_size="1KB")
    assert_bit_equal(load_folder(tmp_path / "out"), sd)


def test_every_source_kind_round_trips_bit_equal(tmp_path: Path, run_cli) -> None:
    sd = make_state_dict(shapes=[(), (0,), (7,), (5, 3), (33, 17)])
    (tmp_path / "src").mkdir()
    kinds = {**_sources(tmp_path / "src", sd), **_more_sources(tmp_path / "src", sd)}
    assert len(list((tmp_path / "src" / "bin-sharded").glob("pytorch_model-*.bin"))) > 1
    for i, (kind, path) in enumerate(kinds.items()):
        out = tmp_path / f"out{i}"
        result = run_cli("convert", path, out, "--max-shard-size", "500B", "--quiet")
        assert result.exit_code == 0, (kind, result.stderr)
        assert_bit_equal(load_folder(out), sd)
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(sd), kind


def test_dtype_cast_matches_torch(tmp_path: Path) -> None:
    sd = float_state_dict()
    torch.save(sd, tmp_path / "m.bin")
    shardkit.convert(tmp_path / "m.bin", tmp_path / "out", dtype="bf16")
    expected = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in sd.items()}
    assert_bit_equal(load_folder(tmp_path / "out"), expected)


def test_dry_run_writes_nothing_and_json_reports_the_plan(tmp_path: Path, run_cli) -> None:
    ckpt, unet = sd_checkpoint()
    torch.save(ckpt, tmp_path / "m.ckpt")
    result = run_cli("convert", tmp_path / "m.ckpt", tmp_path / "out", "--strip-prefix", "model.diffusion_model.",
                     "--dry-run", "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["dry_run"] is True and doc["dropped"] == len(ckpt["state_dict"]) - len(unet)
    assert sum(s["tensors"] for s in doc["shards"]) == len(unet)
    assert not (tmp_path / "out").exists()


def test_dry_run_warns_when_the_real_run_would_need_overwrite(tmp_path: Path, run_cli) -> None:
    """convert --dry-run says what split --dry-run says: one job, so the two cannot drift apart."""
    torch.save({"w": torch.ones(3)}, tmp_path / "m.bin")
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = run_cli("convert", tmp_path / "m.bin", out, "--dry-run")
    assert result.exit_code == 0, result.stderr
    assert "needs --overwrite" in result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert "needs --overwrite" not in run_cli("convert", tmp_path / "m.bin", out, "--dry-run", "--overwrite").stderr
    assert "needs --overwrite" not in run_cli("convert", tmp_path / "m.bin", tmp_path / "new", "--dry-run").stderr
    with pytest.warns(ShardkitWarning, match="needs overwrite=True"):
        shardkit.convert(tmp_path / "m.bin", out, dry_run=True, rename={"w": "v"})


def test_existing_output_is_refused_and_left_alone(tmp_path: Path, run_cli) -> None:
    torch.save({"w": torch.ones(3)}, tmp_path / "m.bin")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    before = snapshot(out)
    assert_one_line_error(run_cli("convert", tmp_path / "m.bin", out), contains="--overwrite")
    assert snapshot(out) == before
    assert run_cli("convert", tmp_path / "m.bin", out, "--overwrite", "-q").exit_code == 0
    assert (out / "keep.txt").read_text() == "mine" and (out / "model.safetensors").exists()
    assert leftovers(tmp_path) == []


def test_python_api_accepts_rename_mapping(tmp_path: Path) -> None:
    sd = {"text_model.a": torch.ones(2), "text_model.b": torch.zeros(3)}
    save_file(sd, str(tmp_path / "m.safetensors"))
    result = shardkit.convert(tmp_path / "m.safetensors", tmp_path / "out", rename={"text_model.": "model."})
    assert sorted(load_folder(tmp_path / "out")) == ["model.a", "model.b"]
    assert result.dropped == 0
    with pytest.raises(InvalidInputError):
        shardkit.convert(tmp_path / "m.safetensors", tmp_path / "out2", strip_prefix="nope.")


def test_unsupported_source_is_a_one_line_error(tmp_path: Path, run_cli) -> None:
    (tmp_path / "weights.npz").write_bytes(b"not a checkpoint")
    assert_one_line_error(run_cli("convert", tmp_path / "weights.npz", tmp_path / "out"), contains="unsupported")
    assert_one_line_error(run_cli("convert", tmp_path / "missing", tmp_path / "out"), contains="no such")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(run_cli("convert", tmp_path / "empty", tmp_path / "out"), contains="no checkpoint")


def test_plain_pickle_payload_never_runs(tmp_path: Path, run_cli) -> None:
    marker = tmp_path / "pwned-plain"
    payload = _Payload()
    payload.marker = marker
    src = tmp_path / "raw.bin"
    with open(src, "wb") as f:
        pickle.dump({"w": payload}, f)  # not even a torch file: a bare pickle with a payload
    result = run_cli("convert", src, tmp_path / "out")
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    assert "refused to unpickle" in result.error_lines[-1]
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_strip_prefix_without_the_trailing_dot_strips_the_whole_component(tmp_path: Path, run_cli) -> None:
    ckpt, unet = sd_checkpoint()
    torch.save(ckpt, tmp_path / "m.ckpt")
    for prefix, out in (("model.diffusion_model", "a"), ("model.diffusion_model.", "b")):
        result = run_cli("convert", tmp_path / "m.ckpt", tmp_path / out, "--strip-prefix", prefix, "-q")
        assert result.exit_code == 0, result.stderr
    a, b = load_folder(tmp_path / "a"), load_folder(tmp_path / "b")
    assert sorted(a) == sorted(b) == sorted(unet)
    assert not any(name.startswith(".") for name in a)
