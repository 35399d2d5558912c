"""verify(): structural checks, byte reads, comparison with a source — through the Python API."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import torch
from helpers_verify import (
    build_pipeline,
    flip_byte,
    index_of,
    make_state_dict,
    read_raw_header,
    shard_of,
    tensor_offset,
    write_index,
)
from safetensors import safe_open
from safetensors.torch import save_file

import shardkit
from shardkit.checking.verify import Finding, VerifyReport, verify
from shardkit.errors import InvalidInputError, ShardkitError, SourceNotFoundError


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "src.safetensors"
    save_file(make_state_dict(), str(path), metadata={"format": "pt"})
    return path


@pytest.fixture
def sharded(tmp_path, source):
    out = tmp_path / "out"
    shardkit.split(str(source), str(out), max_shard_size=20_000)
    return out


def messages(report: VerifyReport) -> list[str]:
    return [str(f) for f in report.findings]


def test_clean_checkpoint_reads_every_byte_and_hashes_each_file(sharded):
    progress = []
    report = verify(sharded, progress=lambda done, total: progress.append((done, total)))
    assert report.ok, messages(report)
    on_disk = sorted(p.name for p in sharded.iterdir())
    assert sorted(f.name for f in report.files) == on_disk
    for f in report.files:
        data = (sharded / f.name).read_bytes()
        assert f.bytes == len(data)
        assert f.sha256 == hashlib.sha256(data).hexdigest()
    assert report.bytes_read == sum(p.stat().st_size for p in sharded.iterdir())
    assert report.tensors_checked == len(make_state_dict())
    assert progress[-1] == (report.bytes_read, report.bytes_read)
    d = report.to_dict()
    assert d["ok"] is True and d["findings"] == [] and len(d["files"]) == len(on_disk)
    json.dumps(d)


def test_single_file_and_index_paths(source, sharded):
    assert verify(source).ok
    report = verify(sharded / "model.safetensors.index.json")
    assert report.ok and len(report.files) == len(list(sharded.iterdir()))


def test_against_same_source_compares_every_tensor(source, sharded):
    report = verify(sharded, against=source)
    assert report.ok, messages(report)
    assert report.tensors_compared == len(make_state_dict())


def test_flipped_byte_found_by_the_manifest_and_against_source(source, sharded):
    shard = shard_of(sharded, "blocks.3.weight")
    flip_byte(shard, tensor_offset(shard, "blocks.3.weight") + 4 * 100 + 1)
    report = verify(sharded)  # the structure is intact; the manifest written with the split is not
    assert [(f.file, f.tensor) for f in report.findings] == [(shard.name, "blocks.3.weight")]
    assert "data changed since shardkit wrote it" in report.findings[0].message
    report = verify(sharded, against=source)  # one line per cause: the comparison says where
    assert [(f.file, f.tensor) for f in report.findings] == [(shard.name, "blocks.3.weight")]
    assert "first at byte 401 of the tensor (element 100)" in report.findings[0].message


def test_cast_split_compares_after_casting_the_source(tmp_path, source):
    out = tmp_path / "bf16"
    shardkit.split(str(source), str(out), max_shard_size=10_000, dtype="bf16")
    with safe_open(str(out / index_of(out)["weight_map"]["blocks.1.weight"]), "pt") as f:
        assert f.get_tensor("blocks.1.weight").dtype == torch.bfloat16
    report = verify(out, against=source)
    assert report.ok, messages(report)
    assert report.tensors_compared == len(make_state_dict())
    shard = shard_of(out, "blocks.1.weight")
    flip_byte(shard, tensor_offset(shard, "blocks.1.weight") + 2 * 5)
    report = verify(out, against=source)
    assert [f.tensor for f in report.findings] == ["blocks.1.weight"]
    assert "cast from F32 to BF16" in report.findings[0].message and "element 5" in report.findings[0].message


def test_against_a_pickle_and_in_memory_state_dict(tmp_path, sharded):
    pickle_path = tmp_path / "model.bin"
    torch.save(make_state_dict(), pickle_path)
    assert verify(sharded, against=pickle_path).ok
    other = make_state_dict()
    other["blocks.2.weight"][3, 4] += 1.0
    report = verify(sharded, against=other)
    assert [f.tensor for f in report.findings] == ["blocks.2.weight"]


def test_missing_extra_shape_and_dtype_mismatches_against_source(tmp_path, sharded):
    other = make_state_dict()
    del other["blocks.5.weight"]                       # extra in the checkpoint
    other["new.weight"] = torch.zeros(4)               # missing from the checkpoint
    other["blocks.4.weight"] = torch.zeros(40, 48)     # shape mismatch
    other["step"] = torch.tensor([7], dtype=torch.int32)  # integer dtype: not a cast
    save_file(other, str(tmp_path / "other.safetensors"))
    report = verify(sharded, against=tmp_path / "other.safetensors")
    by_tensor = {f.tensor: f.message for f in report.findings}
    assert set(by_tensor) == {"blocks.5.weight", "new.weight", "blocks.4.weight", "step"}
    assert "extra tensor" in by_tensor["blocks.5.weight"]
    assert by_tensor["new.weight"].startswith("missing: in ")
    assert "shape [48, 40]" in by_tensor["blocks.4.weight"] and "[40, 48]" in by_tensor["blocks.4.weight"]
    assert "dtype I64" in by_tensor["step"] and "I32" in by_tensor["step"]


def test_tied_tensors_match_either_name(tmp_path):
    weight = torch.randn(8, 4)
    sd = {"embed.weight": weight, "lm_head.weight": weight, "bias": torch.zeros(4)}
    shardkit.save_sharded(sd, str(tmp_path / "out"), max_shard_size=10_000)
    report = verify(tmp_path / "out", against=sd)
    assert report.ok, messages(report)


def test_truncated_shard_names_the_lost_tensors(sharded):
    shard = shard_of(sharded, "blocks.2.weight")
    os.truncate(shard, shard.stat().st_size - 10)
    report = verify(sharded)
    names = safe_open_names(sharded, shard.name)
    last = max(names, key=lambda n: tensor_offset(shard, n))
    assert report.findings == [Finding(shard.name, None, "truncated: the file has "
                               f"{shard.stat().st_size} bytes but its tensors end at byte {shard.stat().st_size + 10} "
                               f"(10 bytes missing); 1 of its {len(names)} tensor(s) lie past the end: {last}")]


def test_a_truncation_is_one_finding_however_many_tensors_it_cuts(sharded):
    shard = shard_of(sharded, "blocks.2.weight")
    names = safe_open_names(sharded, shard.name)
    assert len(names) > 1
    os.truncate(shard, read_raw_header(shard)[1] + 1)  # one byte of data left: every tensor cut
    report = verify(sharded)
    assert [f.file for f in report.findings] == [shard.name], [str(f) for f in report.findings]
    assert f"{len(names)} of its {len(names)} tensor(s) lie past the end" in report.findings[0].message
    total = len(index_of(sharded)["weight_map"])
    assert report.tensors_checked == total - len(names)  # the cut ones are a finding, not checked tensors


def safe_open_names(folder, shard_name: str) -> list[str]:
    return [t for t, s in index_of(folder)["weight_map"].items() if s == shard_name]


def test_trailing_bytes_and_garbage_header(sharded):
    names = sorted(set(index_of(sharded)["weight_map"].values()))
    with open(sharded / names[0], "ab") as f:
        f.write(b"\0" * 3)
    (sharded / names[1]).write_bytes(b"\xff" * 64)
    report = verify(sharded)
    text = messages(report)
    assert any(m.startswith(f"{names[0]}: 3 bytes of trailing data") for m in text), text
    assert any(m.startswith(f"{names[1]}: header length") for m in text), text


def test_missing_shard(sharded):
    shard = shard_of(sharded, "blocks.0.weight")
    shard.unlink()
    report = verify(sharded)
    assert len(report.findings) == 1
    assert report.findings[0].file == shard.name
    assert report.findings[0].message.startswith("missing: the index places")
    assert shard.name not in [f.name for f in report.files]


def test_tensor_moved_to_wrong_shard_in_index(sharded):
    doc = index_of(sharded)
    shards = sorted(set(doc["weight_map"].values()))
    right = doc["weight_map"]["blocks.0.weight"]
    wrong = next(s for s in shards if s != right)
    doc["weight_map"]["blocks.0.weight"] = wrong
    write_index(sharded, doc)
    report = verify(sharded)
    assert Finding("model.safetensors.index.json", "blocks.0.weight",
                   f"the index places it in {wrong} but it is stored in {right}") in report.findings


def test_total_size_wrong(sharded):
    doc = index_of(sharded)
    real = doc["metadata"]["total_size"]
    doc["metadata"]["total_size"] = real + 1
    write_index(sharded, doc)
    report = verify(sharded)
    assert messages(report) == [f"model.safetensors.index.json: metadata.total_size is {real + 1} but the "
                                f"tensors it indexes hold {real} bytes"]


def test_orphan_tensor_duplicate_and_unsafe_names_all_reported(sharded):
    doc = index_of(sharded)
    del doc["weight_map"]["step"]                     # orphan: in a shard, not in the index
    doc["weight_map"]["ghost"] = "../evil.safetensors"  # unsafe name
    write_index(sharded, doc)
    extra = sharded / "model-00009-of-00009.safetensors"   # orphan shard file, same naming
    save_file({"blocks.0.weight": torch.zeros(2)}, str(extra))
    report = verify(sharded)
    by = {(f.file, f.tensor): f.message for f in report.findings}
    step_shard = [k for k in by if k[1] == "step"]
    assert step_shard and "orphan tensor" in by[step_shard[0]]
    assert "contains a path" in by[("model.safetensors.index.json", "ghost")]
    assert "orphan shard file" in by[(extra.name, None)]
    # step's 8 bytes are no longer indexed, so total_size is off too: all four found in one run
    assert "metadata.total_size is" in by[("model.safetensors.index.json", None)]
    assert len(report.findings) == 4


def test_duplicate_tensor_across_shards(sharded):
    doc = index_of(sharded)
    shard = shard_of(sharded, "blocks.0.weight")
    other = next(sharded / s for s in set(doc["weight_map"].values()) if s != shard.name)
    with safe_open(str(other), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["blocks.0.weight"] = torch.zeros(48, 40)
    save_file(tensors, str(other), metadata={"format": "pt"})
    report = verify(sharded)
    assert messages(report) == [f"{other.name}: tensor 'blocks.0.weight': duplicate: also stored in {shard.name}"]


def test_stale_single_file_next_to_index(sharded, source):
    (sharded / "model.safetensors").write_bytes(source.read_bytes())
    report = verify(sharded)
    assert [f.file for f in report.findings] == ["model.safetensors"]
    assert "transformers loads the single file" in report.findings[0].message


def test_shards_without_index(sharded):
    (sharded / "model.safetensors.index.json").unlink()
    report = verify(sharded)
    assert len(report.findings) == 2 and "no index file" in report.findings[0].message
    assert report.findings[1].file == "model.safetensors.index.json"
    assert report.findings[1].message.startswith("missing: shardkit.manifest.json lists it")
    assert len(report.files) == len(list(sharded.iterdir()))


def test_broken_index_json(sharded):
    (sharded / "model.safetensors.index.json").write_text("{not json")
    report = verify(sharded)
    assert report.findings[0].file == "model.safetensors.index.json"
    assert "unreadable index" in report.findings[0].message
    assert len(report.findings) == 1  # the shards are still read, and are fine
    assert len(report.files) == len(list(sharded.iterdir()))  # the index is hashed too


def test_hub_cache_blob_name_is_checked(tmp_path, source):
    data = source.read_bytes()
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    good = blobs / hashlib.sha256(data).hexdigest()
    good.write_bytes(data)
    (snap / "model.safetensors").symlink_to(good)
    assert verify(snap).ok
    bad = blobs / ("0" * 64)
    bad.write_bytes(data)
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors").symlink_to(bad)
    report = verify(snap)
    assert len(report.findings) == 1 and "Hugging Face cache blob" in report.findings[0].message


def test_unusable_input_raises(tmp_path, sharded):
    with pytest.raises(SourceNotFoundError):
        verify(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceNotFoundError, match="no .safetensors checkpoint"):
        verify(tmp_path / "empty")
    torch.save({"a": torch.zeros(1)}, tmp_path / "x.bin")
    with pytest.raises(InvalidInputError, match="not a safetensors checkpoint"):
        verify(tmp_path / "x.bin")
    with pytest.raises(ShardkitError):
        verify(sharded, against=tmp_path / "nope.safetensors")


def test_large_tensor_spanning_many_read_chunks(tmp_path):
    from shardkit.checking import bytescan

    big = {"big": torch.randn(3, 1 << 19).to(torch.float32), "tail": torch.randn(5).to(torch.float16)}  # 6 MiB
    save_file(big, str(tmp_path / "big.safetensors"))
    shardkit.split(str(tmp_path / "big.safetensors"), str(tmp_path / "out"), max_shard_size=10**9, dtype="fp16")
    assert os.path.getsize(tmp_path / "out" / "model.safetensors") > 2 * bytescan.CHUNK_BYTES
    assert verify(tmp_path / "out", against=tmp_path / "big.safetensors").ok
    path = tmp_path / "out" / "model.safetensors"
    at = tensor_offset(path, "big") + 2 * bytescan.CHUNK_BYTES + 6
    flip_byte(path, at)
    report = verify(tmp_path / "out", against=tmp_path / "big.safetensors")
    assert [f.tensor for f in report.findings] == ["big"]
    assert f"byte {2 * bytescan.CHUNK_BYTES + 6} " in report.findings[0].message


# ----------------------------------------------------------------------------- pipeline folders

def test_pipeline_folder_verifies_each_component(tmp_path):
    pipe = build_pipeline(tmp_path / "pipe")
    report = verify(pipe)
    assert report.ok, messages(report)
    assert report.components == ["unet", "text_encoder"]
    names = {f.name for f in report.files}
    assert "unet/diffusion_pytorch_model.safetensors.index.json" in names
    assert "text_encoder/model.safetensors" in names
    assert sum(n.startswith("unet/diffusion_pytorch_model-") for n in names) >= 2
    for f in report.files:
        assert f.sha256 == hashlib.sha256((pipe / f.name).read_bytes()).hexdigest()


def test_pipeline_against_pipeline_compares_component_by_component(tmp_path):
    pipe = build_pipeline(tmp_path / "pipe")
    resharded = tmp_path / "resharded"
    shutil.copytree(pipe, resharded)
    shutil.rmtree(resharded / "unet")
    shardkit.split(str(pipe / "unet"), str(resharded / "unet"), max_shard_size="60KB")
    shutil.copy(pipe / "unet" / "config.json", resharded / "unet")
    report = verify(resharded, against=pipe)
    assert report.ok, messages(report)
    assert report.tensors_compared == report.tensors_checked > 100
    unet_index = "diffusion_pytorch_model.safetensors.index.json"
    shard = shard_of(resharded / "unet", "conv_in.weight", unet_index)
    flip_byte(shard, tensor_offset(shard, "conv_in.weight") + 3)
    te = resharded / "text_encoder" / "model.safetensors"
    os.truncate(te, te.stat().st_size - 1)
    report = verify(resharded, against=pipe)
    found = {(f.file, f.tensor) for f in report.findings}
    assert (f"unet/{shard.name}", "conv_in.weight") in found
    assert ("text_encoder/model.safetensors", None) in found


def test_pipeline_component_problems(tmp_path):
    pipe = build_pipeline(tmp_path / "pipe")
    other = build_pipeline(tmp_path / "other")
    for f in (pipe / "text_encoder").glob("*.safetensors"):
        f.unlink()
    report = verify(pipe, against=other)
    assert messages(report) == ["text_encoder/: component has config.json but no weight files"]
    with pytest.raises(InvalidInputError, match="must be a pipeline folder too"):
        verify(pipe, against=other / "unet")
