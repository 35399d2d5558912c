"""``shardkit.split`` and ``shardkit.save_sharded`` through the public Python API."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    TORCH_DTYPE_CODES,
    assert_bit_equal,
    float_state_dict,
    leftovers,
    load_folder,
    make_state_dict,
    snapshot,
    tensor_bytes,
)

import shardkit
from shardkit.errors import InvalidInputError, OutputExistsError, ShardkitError
from shardkit.formats.header import read_header


def _files(folder: Path) -> list[str]:
    """The checkpoint's files (the integrity manifest has its own tests in test_manifest.py)."""
    return sorted(p.name for p in folder.iterdir() if p.name != "shardkit.manifest.json")


def _check_index(folder: Path, index_name: str = "model.safetensors.index.json") -> dict:
    """The index names exactly the shards present, and total_size is the sum of tensor bytes."""
    index = json.loads((folder / index_name).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == sorted(p.name for p in folder.glob("*.safetensors"))
    total = 0
    for shard in shards:
        header = read_header(folder / shard)
        assert {e.name for e in header.entries} == {k for k, v in index["weight_map"].items() if v == shard}
        total += sum(e.nbytes for e in header.entries)
    assert index["metadata"]["total_size"] == total
    return index


@pytest.mark.parametrize("limit", [1, 100, 1000, "10MB"])
def test_round_trip_every_dtype_bit_equal(safetensors_file: Path, state_dict: dict, tmp_path: Path,
                                          limit: int | str) -> None:
    out = tmp_path / "out"
    result = shardkit.split(safetensors_file, out, max_shard_size=limit)
    assert_bit_equal(load_folder(out), state_dict)
    assert [os.path.basename(f) for f in result.files] == _files(out)
    if len(result.plan.shards) > 1:
        _check_index(out)
        for shard in result.plan.shards:
            assert shard.nbytes <= result.plan.max_shard_bytes or len(shard.names) == 1
    else:
        assert _files(out) == ["model.safetensors"]
    assert leftovers(tmp_path) == []


def test_every_torch_dtype_is_covered(state_dict: dict) -> None:
    from shardkit.formats.dtypes import from_torch

    assert {from_torch(t.dtype) for t in state_dict.values()} == set(TORCH_DTYPE_CODES)


def test_sub_byte_dtypes_are_split_at_byte_level(tmp_path: Path) -> None:
    """F4/F6 have no torch dtype: splitting them is pure byte work, checked with the reference reader."""
    from conftest import raw_header, write_raw_safetensors

    specs = [("a.f4", "F4", [5], 3), ("b.f6", "F6_E2M3", [4], 3), ("c.f6", "F6_E3M2", [8], 6),
             ("d.u8", "U8", [4], 4), ("e.e8m0", "F8_E8M0", [3], 3)]
    doc, size = raw_header(specs)
    data = bytes((i * 37 + 11) % 256 for i in range(size))
    src = write_raw_safetensors(tmp_path / "sub.safetensors", doc, data)
    out = tmp_path / "out"
    shardkit.split(src, out, max_shard_size=6)
    index = _check_index(out)
    got = {}
    for shard in set(index["weight_map"].values()):
        header = read_header(out / shard)
        blob = (out / shard).read_bytes()
        for e in header.entries:
            got[e.name] = (e.dtype, e.shape, blob[e.offset:e.offset + e.nbytes])
    cursor = 0
    for name, dtype, shape, nbytes in specs:
        assert got[name] == (dtype, tuple(shape), data[cursor:cursor + nbytes])
        cursor += nbytes


def test_sharded_folder_reshards_and_index_source_too(safetensors_file: Path, state_dict: dict,
                                                      tmp_path: Path) -> None:
    first = tmp_path / "first"
    shardkit.split(safetensors_file, first, max_shard_size=500)
    second = tmp_path / "second"
    shardkit.split(first, second, max_shard_size=3000)
    third = tmp_path / "third"
    shardkit.split(first / "model.safetensors.index.json", third, max_shard_size="1GB")
    assert_bit_equal(load_folder(second), state_dict)
    assert _files(third) == ["model.safetensors"]
    assert_bit_equal(load_folder(third), state_dict)


def test_pickle_sources_round_trip(tmp_path: Path, state_dict: dict) -> None:
    import torch

    zipped = tmp_path / "pytorch_model.bin"
    torch.save(state_dict, zipped)
    out = tmp_path / "from_zip"
    shardkit.split(zipped, out, max_shard_size=2000)
    assert_bit_equal(load_folder(out), state_dict)
    # the legacy format cannot hold uint16+/fp8 storages at all (torch itself cannot read them back)
    classic = {k: v for k, v in state_dict.items() if k.split(".")[1] in
               ("BOOL", "U8", "I8", "I16", "F16", "BF16", "I32", "F32", "C64", "F64", "I64")}
    legacy = tmp_path / "legacy.pt"
    torch.save({"state_dict": classic, "epoch": 1}, legacy, _use_new_zipfile_serialization=False)
    with pytest.warns(shardkit.ShardkitWarning, match="legacy"):
        shardkit.split(legacy, tmp_path / "from_legacy", max_shard_size=2000)
    assert_bit_equal(load_folder(tmp_path / "from_legacy"), classic)


def test_zip_pickle_kernel_copy_gives_the_same_bytes_as_the_memory_path(tmp_path: Path, state_dict: dict,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Located tensors are copied from the zip with copy_file_range; the result equals a pure-memory split."""
    import torch

    from shardkit.sources import pickle as pickle_source

    path = tmp_path / "model.pt"
    torch.save(state_dict, path)
    calls = []
    real = os.copy_file_range
    monkeypatch.setattr(os, "copy_file_range", lambda *a: calls.append(a[2]) or real(*a))
    shardkit.split(path, tmp_path / "kernel", max_shard_size=3000)
    assert sum(calls) > 0.9 * sum(t.nbytes for t in state_dict.values())
    monkeypatch.setattr(pickle_source, "locate_in_file", lambda *a, **k: {})
    shardkit.split(path, tmp_path / "memory", max_shard_size=3000)
    # header padding follows the source's block offsets (copy-on-write clones); all else is equal
    assert unpadded_snapshot(tmp_path / "kernel") == unpadded_snapshot(tmp_path / "memory")
    assert_bit_equal(load_folder(tmp_path / "kernel"), state_dict)


def test_determinism_byte_identical_outputs(tmp_path: Path, safetensors_file: Path) -> None:
    import torch

    for run in ("a", "b"):
        shardkit.split(safetensors_file, tmp_path / f"file-{run}", max_shard_size=700)
        shardkit.split(safetensors_file, tmp_path / f"cast-{run}", max_shard_size=700, dtype="bf16")
        tensors = float_state_dict()
        shardkit.save_sharded(tensors, tmp_path / f"mem-{run}", max_shard_size=2000)
        torch.save(tensors, tmp_path / f"p-{run}.bin")
        shardkit.split(tmp_path / f"p-{run}.bin", tmp_path / f"pickle-{run}", max_shard_size=2000)
    for kind in ("file", "cast", "mem", "pickle"):
        a, b = snapshot(tmp_path / f"{kind}-a"), snapshot(tmp_path / f"{kind}-b")
        assert a == b and len(a) > 2, kind
    assert unpadded_snapshot(tmp_path / "mem-a") == unpadded_snapshot(tmp_path / "pickle-a"), "same tensors → same bytes"


def unpadded_snapshot(folder: Path) -> dict[str, bytes]:
    """File name → bytes, safetensors headers without their trailing-space padding (which follows the source)."""
    out = {}
    for p in sorted(folder.iterdir()):
        if p.name == "shardkit.manifest.json":
            continue  # it records the padded files' sha256, which differ with the padding
        raw = p.read_bytes()
        if p.suffix == ".safetensors":
            n = int.from_bytes(raw[:8], "little")
            raw = raw[8:8 + n].rstrip(b" ") + raw[8 + n:]
        out[p.name] = raw
    return out


@pytest.mark.parametrize("dtype, torch_name", [("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32")])
def test_dtype_cast_matches_torch_and_leaves_ints_alone(tmp_path: Path, dtype: str, torch_name: str) -> None:
    import torch

    tensors = float_state_dict()
    result = shardkit.save_sharded(tensors, tmp_path / "out", max_shard_size=1000, dtype=dtype)
    got = load_folder(tmp_path / "out")
    target = getattr(torch, torch_name)
    for name, t in tensors.items():
        want = t.to(target) if t.is_floating_point() else t
        assert got[name].dtype == want.dtype, name
        assert tensor_bytes(got[name]) == tensor_bytes(want), name
    assert result.plan.total_bytes == sum(v.nbytes for v in got.values())


def test_fp8_cast_needs_allow_lossy(tmp_path: Path) -> None:
    import torch

    tensors = float_state_dict()
    for dtype in ("fp8_e4m3", "fp8_e5m2", "F8_E4M3"):
        with pytest.raises(InvalidInputError, match="allow_lossy=True"):
            shardkit.save_sharded(tensors, tmp_path / "out", dtype=dtype)
    assert not (tmp_path / "out").exists()
    shardkit.save_sharded(tensors, tmp_path / "out", dtype="fp8_e4m3", allow_lossy=True)
    got = load_folder(tmp_path / "out")
    for name, t in tensors.items():
        want = t.to(torch.float8_e4m3fn) if t.is_floating_point() else t
        assert tensor_bytes(got[name]) == tensor_bytes(want), name


def test_unknown_dtype_is_refused(tmp_path: Path, safetensors_file: Path) -> None:
    with pytest.raises(InvalidInputError, match="unknown dtype"):
        shardkit.split(safetensors_file, tmp_path / "out", dtype="int3")


def test_dry_run_writes_nothing(tmp_path: Path, safetensors_file: Path) -> None:
    before = snapshot(tmp_path)
    result = shardkit.split(safetensors_file, tmp_path / "out", max_shard_size=500, dry_run=True)
    assert snapshot(tmp_path) == before
    assert result.dry_run and len(result.plan.shards) > 1
    summary = result.to_dict()
    assert summary["dry_run"] is True
    assert sum(s["bytes"] for s in summary["shards"]) == summary["total_bytes"]
    assert summary["index"] == "model.safetensors.index.json"


def test_source_is_never_modified(tmp_path: Path, safetensors_file: Path) -> None:
    before = snapshot(safetensors_file.parent)
    stat = os.stat(safetensors_file)
    shardkit.split(safetensors_file, tmp_path / "out", max_shard_size=300, dtype="bf16")
    assert snapshot(safetensors_file.parent) == before
    assert os.stat(safetensors_file).st_mtime_ns == stat.st_mtime_ns


def test_naming_follows_source_and_options(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    tensors = make_state_dict(["F32", "I64", "BF16"], shapes=[(20,)])
    unet = tmp_path / "unet"
    unet.mkdir()
    save_file(tensors, str(unet / "diffusion_pytorch_model.safetensors"))
    shardkit.split(unet, tmp_path / "d", max_shard_size=200)
    assert _files(tmp_path / "d") == [
        "diffusion_pytorch_model-00001-of-00002.safetensors", "diffusion_pytorch_model-00002-of-00002.safetensors",
        "diffusion_pytorch_model.safetensors.index.json"]
    shardkit.split(unet, tmp_path / "v", max_shard_size=100, variant="fp16", dtype="fp16")
    assert load_folder(tmp_path / "v")["layers.F32.0"].dtype.itemsize == 2
    assert "diffusion_pytorch_model.safetensors.index.fp16.json" in _files(tmp_path / "v")
    assert "diffusion_pytorch_model.fp16-00001-of-00002.safetensors" in _files(tmp_path / "v")
    shardkit.split(unet, tmp_path / "n", max_shard_size=100, name="model")
    assert "model.safetensors.index.json" in _files(tmp_path / "n")
    shardkit.split(unet / "diffusion_pytorch_model.safetensors", tmp_path / "one", max_shard_size="1GB")
    assert _files(tmp_path / "one") == ["diffusion_pytorch_model.safetensors"]
    fp16 = tmp_path / "fp16src"
    fp16.mkdir()
    save_file(tensors, str(fp16 / "diffusion_pytorch_model.fp16.safetensors"))
    shardkit.split(fp16, tmp_path / "keepvariant", max_shard_size="1GB")
    assert _files(tmp_path / "keepvariant") == ["diffusion_pytorch_model.fp16.safetensors"]


def test_output_exists_is_refused_and_left_alone(tmp_path: Path, safetensors_file: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="overwrite"):
        shardkit.split(safetensors_file, out)
    assert _files(out) == ["keep.txt"]


def test_in_place_reshard_with_overwrite(tmp_path: Path, safetensors_file: Path, state_dict: dict) -> None:
    ckpt = tmp_path / "ckpt"
    shardkit.split(safetensors_file, ckpt, max_shard_size=500)
    (ckpt / "config.json").write_text("{}")
    (ckpt / "vae.safetensors").write_bytes(safetensors_file.read_bytes())
    many = len(list(ckpt.glob("model-*.safetensors")))
    with pytest.raises(OutputExistsError):
        shardkit.split(ckpt, ckpt, max_shard_size=5000)
    shardkit.split(ckpt, ckpt, max_shard_size=5000, overwrite=True)
    shards = list(ckpt.glob("model-*.safetensors"))
    assert 1 < len(shards) < many
    _check_index_and_extras = _files(ckpt)
    assert "config.json" in _check_index_and_extras and "vae.safetensors" in _check_index_and_extras
    from safetensors.torch import load_file

    loaded = {}
    for shard in shards:
        loaded.update(load_file(str(shard)))
    assert_bit_equal(loaded, state_dict)
    shardkit.split(ckpt, ckpt, max_shard_size="1GB", overwrite=True)
    assert sorted(p.name for p in ckpt.glob("model*")) == ["model.safetensors"]
    assert_bit_equal(load_file(str(ckpt / "model.safetensors")), state_dict)
    assert leftovers(tmp_path) == []


def test_save_sharded_module_with_tied_weights_records_aliases(tmp_path: Path) -> None:
    import torch

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(50, 8)
            self.mid = torch.nn.Linear(8, 8)
            self.head = torch.nn.Linear(8, 50, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    result = shardkit.save_sharded(model, tmp_path / "out", max_shard_size=1000)
    assert result.aliases == {"head.weight": "embed.weight"}
    index = _check_index(tmp_path / "out")
    assert "head.weight" not in index["weight_map"]
    for shard in set(index["weight_map"].values()):
        assert read_header(tmp_path / "out" / shard).metadata == {"format": "pt", "head.weight": "embed.weight"}
    # huggingface_hub's loader reads the alias metadata back and ties the weights
    from huggingface_hub import load_torch_model

    fresh = Tied()
    load_torch_model(fresh, tmp_path / "out")
    assert torch.equal(fresh.embed.weight, model.embed.weight)
    assert fresh.head.weight.data_ptr() == fresh.embed.weight.data_ptr()


def test_progress_reaches_the_total(tmp_path: Path, safetensors_file: Path) -> None:
    seen: list[tuple[int, int]] = []
    result = shardkit.split(safetensors_file, tmp_path / "out", max_shard_size=500, dtype="bf16",
                            progress=lambda done, total: seen.append((done, total)))
    assert seen[-1] == (result.plan.total_bytes, result.plan.total_bytes)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


@pytest.mark.parametrize("size", ["5XB", "0", "-1GB", "abc", 0, -1])
def test_bad_sizes(tmp_path: Path, safetensors_file: Path, size: Any) -> None:
    with pytest.raises(ShardkitError):
        shardkit.split(safetensors_file, tmp_path / "out", max_shard_size=size)
    assert not (tmp_path / "out").exists()


def test_bad_name(tmp_path: Path, safetensors_file: Path) -> None:
    with pytest.raises(InvalidInputError, match="name="):
        shardkit.split(safetensors_file, tmp_path / "out", name="../x")
