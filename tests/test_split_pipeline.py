"""diffusers pipeline folders: split/convert every component in one transaction; same image out."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_bit_equal, assert_one_line_error, leftovers, load_folder, snapshot
from helpers_pipeline import build_tiny_sd_pipeline, generate

import shardkit
from shardkit.errors import ShardkitWarning


@pytest.fixture(scope="module")
def pipeline_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    scratch = tmp_path_factory.mktemp("pipe")
    pipe = build_tiny_sd_pipeline(scratch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe.save_pretrained(scratch / "pipe")
    (scratch / "pipe" / "README.md").write_text("tiny test pipeline\n")
    return scratch / "pipe"


def _load(folder: Path):
    from diffusers import DiffusionPipeline

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DiffusionPipeline.from_pretrained(str(folder))


def test_split_pipeline_generates_the_same_image(pipeline_dir: Path, tmp_path: Path, run_shardkit) -> None:
    out = tmp_path / "sharded"
    result = run_shardkit("split", pipeline_dir, out, "--max-shard-size", "100KB", "--quiet")
    assert result.returncode == 0, result.stderr
    # every weight-bearing component is sharded with its own naming; other files are copied unchanged
    assert len(list((out / "unet").glob("diffusion_pytorch_model-*-of-*.safetensors"))) > 1
    assert (out / "unet" / "diffusion_pytorch_model.safetensors.index.json").exists()
    assert (out / "vae" / "diffusion_pytorch_model.safetensors.index.json").exists()
    assert (out / "text_encoder" / "model.safetensors.index.json").exists()
    assert not (out / "unet" / "diffusion_pytorch_model.safetensors").exists()
    src, dst = snapshot(pipeline_dir), snapshot(out)
    for rel, digest in src.items():
        if not rel.endswith((".safetensors", ".json")) or rel.endswith(("config.json", "model_index.json")) \
                or rel.startswith("tokenizer"):
            assert dst.get(rel) == digest, rel
    for component in ("unet", "vae", "text_encoder"):
        assert_bit_equal(load_folder(out / component), load_folder(pipeline_dir / component))
    expected = generate(_load(pipeline_dir), seed=7)
    got = generate(_load(out), seed=7)
    assert np.array_equal(expected, got)


def test_convert_pipeline_json_and_dry_run(pipeline_dir: Path, tmp_path: Path, run_cli) -> None:
    result = run_cli("convert", pipeline_dir, tmp_path / "out", "--max-shard-size", "200KB", "--dry-run", "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert set(doc["components"]) == {"unet", "vae", "text_encoder"}
    assert doc["components"]["unet"]["index"] == "diffusion_pytorch_model.safetensors.index.json"
    assert all(s["file"].split("/")[0] in doc["components"] for s in doc["shards"])
    assert not (tmp_path / "out").exists()


def test_convert_pipeline_with_cast(pipeline_dir: Path, tmp_path: Path) -> None:
    import torch

    shardkit.convert(pipeline_dir, tmp_path / "bf16", dtype="bf16", max_shard_size="1MB", variant="bf16")
    unet = load_folder(tmp_path / "bf16" / "unet")
    assert (tmp_path / "bf16" / "unet" / "diffusion_pytorch_model.bf16-00001-of-00002.safetensors").exists() or \
        (tmp_path / "bf16" / "unet" / "diffusion_pytorch_model.bf16.safetensors").exists()
    assert all(t.dtype == torch.bfloat16 for t in unet.values())
    assert (tmp_path / "bf16" / "tokenizer" / "tokenizer_config.json").exists()


def test_options_that_do_not_apply_are_refused(pipeline_dir: Path, tmp_path: Path, run_cli) -> None:
    assert_one_line_error(run_cli("split", pipeline_dir, tmp_path / "o", "--name", "model"), contains="pipeline")
    assert_one_line_error(run_cli("convert", pipeline_dir, tmp_path / "o", "--strip-prefix", "x."), contains="pipeline")
    assert not (tmp_path / "o").exists()


def test_a_broken_component_leaves_no_output(pipeline_dir: Path, tmp_path: Path, run_cli) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(pipeline_dir, broken)
    vae = broken / "vae" / "diffusion_pytorch_model.safetensors"
    vae.write_bytes(vae.read_bytes()[:-10])
    assert_one_line_error(run_cli("split", broken, tmp_path / "out", "--max-shard-size", "100KB"), contains="vae")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_other_weight_files_are_left_out_with_a_warning(pipeline_dir: Path, tmp_path: Path) -> None:
    import shutil

    import torch

    twin = tmp_path / "twin"
    shutil.copytree(pipeline_dir, twin)
    torch.save({"x": torch.ones(1)}, twin / "unet" / "diffusion_pytorch_model.bin")
    with pytest.warns(ShardkitWarning, match="unet: left out diffusion_pytorch_model.bin"):
        shardkit.split(twin, tmp_path / "out", max_shard_size="1MB")
    assert not (tmp_path / "out" / "unet" / "diffusion_pytorch_model.bin").exists()


def test_overwrite_in_place_reshards_every_component(pipeline_dir: Path, tmp_path: Path) -> None:
    import shutil

    work = tmp_path / "work"
    shutil.copytree(pipeline_dir, work)
    before = {c: load_folder(work / c) for c in ("unet", "vae", "text_encoder")}
    shardkit.split(work, work, max_shard_size="150KB", overwrite=True)
    assert not (work / "unet" / "diffusion_pytorch_model.safetensors").exists()
    for component, tensors in before.items():
        assert_bit_equal(load_folder(work / component), tensors)
    assert (work / "tokenizer" / "tokenizer_config.json").exists() and leftovers(work) == []
