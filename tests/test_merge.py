"""``shardkit merge``: sharded folder → one .safetensors, byte for byte when shardkit wrote the original."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from conftest import assert_bit_equal, assert_one_line_error, leftovers, load_folder, make_state_dict, snapshot
from safetensors.torch import load_file

import shardkit


@pytest.fixture
def original(tmp_path: Path) -> tuple[Path, dict]:
    """A single file written by shardkit (with extra metadata), tensors in non-alphabetical order."""
    sd = make_state_dict(shapes=[(), (0,), (7,), (33, 17)])
    sd = dict(reversed(list(sd.items())))
    shardkit.save_sharded(sd, tmp_path / "orig", max_shard_size="1GB", metadata={"origin": "test", "step": "12"})
    return tmp_path / "orig" / "model.safetensors", sd


def test_merge_of_a_split_equals_the_original_byte_for_byte(original, tmp_path: Path, run_cli) -> None:
    path, sd = original
    assert run_cli("split", path, tmp_path / "sharded", "--max-shard-size", "1KB", "-q").exit_code == 0
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 3
    result = run_cli("merge", tmp_path / "sharded", tmp_path / "merged.safetensors")
    assert result.exit_code == 0, result.stderr
    assert "merged" in result.stdout
    assert (tmp_path / "merged.safetensors").read_bytes() == path.read_bytes()
    assert_bit_equal(load_file(str(tmp_path / "merged.safetensors")), sd)


def test_merge_of_a_dtype_preserving_convert_with_pickle_source(tmp_path: Path) -> None:
    sd = make_state_dict(["F32", "BF16", "I64"], shapes=[(5, 3), (100,)])
    torch.save(sd, tmp_path / "m.bin")
    shardkit.convert(tmp_path / "m.bin", tmp_path / "single", max_shard_size="1GB")
    shardkit.convert(tmp_path / "m.bin", tmp_path / "sharded", max_shard_size="100B")
    shardkit.merge(tmp_path / "sharded" / "model.safetensors.index.json", tmp_path / "merged.safetensors")
    assert (tmp_path / "merged.safetensors").read_bytes() == (tmp_path / "single" / "model.safetensors").read_bytes()


def test_merge_of_foreign_shards_loads_equal(tmp_path: Path) -> None:
    import huggingface_hub

    sd = make_state_dict(shapes=[(7,), (33, 17)])
    (tmp_path / "hub").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        huggingface_hub.save_torch_state_dict(sd, tmp_path / "hub", max_shard_size=2000)
    result = shardkit.merge(tmp_path / "hub", tmp_path / "merged.safetensors")
    assert result.shards > 1 and result.tensors == len(sd)
    assert_bit_equal(load_file(str(tmp_path / "merged.safetensors")), load_folder(tmp_path / "hub"))


def test_existing_output_needs_overwrite(original, tmp_path: Path, run_cli) -> None:
    path, _ = original
    shardkit.split(path, tmp_path / "sharded", max_shard_size="1KB")
    target = tmp_path / "merged.safetensors"
    target.write_bytes(b"keep me")
    assert_one_line_error(run_cli("merge", tmp_path / "sharded", target), contains="--overwrite")
    assert target.read_bytes() == b"keep me"
    assert run_cli("merge", tmp_path / "sharded", target, "--overwrite", "-q").exit_code == 0
    assert target.read_bytes() == path.read_bytes()
    assert leftovers(tmp_path) == []


def test_refuses_to_write_onto_a_shard(original, tmp_path: Path, run_cli) -> None:
    path, _ = original
    shardkit.split(path, tmp_path / "sharded", max_shard_size="1KB")
    before = snapshot(tmp_path / "sharded")
    shard = sorted((tmp_path / "sharded").glob("model-*.safetensors"))[0]
    assert_one_line_error(run_cli("merge", tmp_path / "sharded", shard, "--overwrite"), contains="is a shard")
    assert snapshot(tmp_path / "sharded") == before


def test_broken_folder_leaves_nothing(original, tmp_path: Path, run_cli) -> None:
    path, _ = original
    shardkit.split(path, tmp_path / "sharded", max_shard_size="1KB")
    sorted((tmp_path / "sharded").glob("model-*.safetensors"))[1].unlink()
    assert_one_line_error(run_cli("merge", tmp_path / "sharded", tmp_path / "m.safetensors"), contains="does not exist")
    assert not (tmp_path / "m.safetensors").exists() and leftovers(tmp_path) == []


def test_truncated_shard_leaves_nothing(original, tmp_path: Path, run_cli) -> None:
    path, _ = original
    shardkit.split(path, tmp_path / "sharded", max_shard_size="1KB")
    shard = sorted((tmp_path / "sharded").glob("model-*.safetensors"))[2]
    shard.write_bytes(shard.read_bytes()[:-3])
    assert_one_line_error(run_cli("merge", tmp_path / "sharded", tmp_path / "m.safetensors"), contains="truncated")
    assert not (tmp_path / "m.safetensors").exists() and leftovers(tmp_path) == []


def test_bad_arguments(tmp_path: Path, run_cli) -> None:
    (tmp_path / "pipe").mkdir()
    (tmp_path / "pipe" / "model_index.json").write_text(json.dumps({"_class_name": "X", "unet": ["diffusers", "U"]}))
    assert_one_line_error(run_cli("merge", tmp_path / "pipe", tmp_path / "m.safetensors"), contains="pipeline")
    assert_one_line_error(run_cli("merge", tmp_path / "pipe", tmp_path / "m.bin"), contains=".safetensors")
    assert_one_line_error(run_cli("merge", tmp_path / "nothing", tmp_path / "m.safetensors"))


def test_merge_of_a_split_of_a_padded_file_is_byte_for_byte_too(tmp_path: Path) -> None:
    """Copy-on-write padding (headers padded to the source's block offsets) survives split → merge."""
    from safetensors.torch import save_file

    sd = make_state_dict(["F32", "BF16", "I64", "U8"], shapes=[(1000,), (3, 999), (5,)])
    save_file(sd, str(tmp_path / "ref.safetensors"))
    shardkit.split(tmp_path / "ref.safetensors", tmp_path / "orig", max_shard_size="1GB")
    original = tmp_path / "orig" / "model.safetensors"
    shardkit.split(original, tmp_path / "sharded", max_shard_size="10KB")
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 2
    result = shardkit.merge(tmp_path / "sharded", tmp_path / "merged.safetensors")
    assert (tmp_path / "merged.safetensors").read_bytes() == original.read_bytes()
    doc = result.to_dict()
    assert doc["cloned_bytes"] + doc["copied_bytes"] == doc["total_bytes"] == sum(t.nbytes for t in sd.values())
