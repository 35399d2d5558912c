"""``verify s3://... --against SOURCE`` and ``verify LOCAL --against s3://...``, against a real SeaweedFS.

The local checks run on the header-only mirror and every safetensors object is read by ranged
GETs: the manifest, and every tensor compared with the reference (cast first where the split cast).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from conftest import assert_one_line_error

import shardkit

pytestmark = pytest.mark.filterwarnings("ignore::shardkit.errors.ShardkitWarning")


@pytest.fixture
def ckpt(tmp_path) -> tuple[Path, Path]:
    """``(source, folder)``: 6 float32 tensors (~190 KB) split into 3 shards with an index and a manifest."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(5)
    source = tmp_path / "model.safetensors"
    save_file({f"block.{i}.weight": torch.randn(80, 100, generator=gen) for i in range(6)}, str(source))
    shardkit.split(source, tmp_path / "ckpt", max_shard_size="70KB")
    return source, tmp_path / "ckpt"


def _flip_tensor_byte(shard: Path, tensor: str, at: int = 7) -> None:
    data = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    begin, _ = json.loads(data[8:8 + n])[tensor]["data_offsets"]
    data[8 + n + begin + at] ^= 0x40
    shard.write_bytes(bytes(data))


def _shard_holding(folder: Path, tensor: str) -> Path:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return folder / index["weight_map"][tensor]


def test_bucket_against_a_local_source_reads_every_object_by_range(s3_env, ckpt, run_cli) -> None:
    source, folder = ckpt
    s3_env.put_folder(folder, "good")
    url = f"s3://{s3_env.bucket}/good"
    report = shardkit.verify(url, against=source)
    assert report.ok, report.findings
    assert report.path == url and report.against == str(source)
    assert report.tensors_compared == 6
    weights = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    assert report.bytes_read >= weights
    assert {f.name for f in report.files if f.checked == "manifest"} >= {p.name for p in folder.glob("*.safetensors")}
    result = run_cli("verify", url, "--against", source)
    assert result.exit_code == 0, result.stderr
    assert "6 tensor(s) identical to" in result.stdout and "byte for byte" in result.stdout


def test_a_changed_byte_in_the_bucket_is_named(s3_env, ckpt, tmp_path, run_cli) -> None:
    source, folder = ckpt
    shard = _shard_holding(folder, "block.4.weight")
    _flip_tensor_byte(shard, "block.4.weight")
    s3_env.put_folder(folder, "bad")
    url = f"s3://{s3_env.bucket}/bad"
    report = shardkit.verify(url, against=source)
    hits = [f for f in report.findings if f.tensor == "block.4.weight"]
    assert hits and all(f.file == shard.name for f in hits), report.findings
    assert any("first at byte 7" in f.message for f in hits)  # against the source (one cause, one finding)
    alone = shardkit.verify(url).findings  # without --against: structure only, headers are intact
    assert alone == []
    result = run_cli("verify", url, "--against", source, "-q")
    assert result.exit_code == 1 and "block.4.weight" in result.stdout


def test_local_against_a_bucket_and_a_cast_split(s3_env, ckpt, tmp_path) -> None:
    source, folder = ckpt
    s3_env.put("ref/model.safetensors", source.read_bytes())
    ref = f"s3://{s3_env.bucket}/ref"
    report = shardkit.verify(folder, against=ref)
    assert report.ok and report.tensors_compared == 6 and report.against == ref, report.findings
    shardkit.split(source, tmp_path / "bf16", max_shard_size="70KB", dtype="bf16")
    assert shardkit.verify(tmp_path / "bf16", against=ref).ok  # the reference is cast as the split cast
    _flip_tensor_byte(_shard_holding(folder, "block.1.weight"), "block.1.weight", at=3)
    found = shardkit.verify(folder, against=ref).findings
    assert [f.tensor for f in found] == ["block.1.weight"] and "first at byte 3" in found[0].message, found
    assert "shardkit-s3-" not in str(found)  # never the temporary mirror


def test_bucket_against_a_bucket_pipeline(s3_env, tmp_path) -> None:
    """Pipelines compare component by component, each component of the reference read by range too."""
    from helpers_pipeline import build_tiny_sd_pipeline

    build_tiny_sd_pipeline(tmp_path / "scratch").save_pretrained(tmp_path / "pipe")
    shardkit.split(tmp_path / "pipe", tmp_path / "sharded", max_shard_size="200KB")
    s3_env.put_folder(tmp_path / "pipe", "pipe")
    s3_env.put_folder(tmp_path / "sharded", "sharded")
    report = shardkit.verify(f"s3://{s3_env.bucket}/sharded", against=f"s3://{s3_env.bucket}/pipe")
    assert report.ok, report.findings
    assert set(report.components) == {"unet", "vae", "text_encoder"} and report.tensors_compared > 100
    assert shardkit.verify(tmp_path / "sharded", against=f"s3://{s3_env.bucket}/pipe").ok


def test_missing_reference_prefix_is_one_line(s3_env, ckpt, run_cli) -> None:
    _, folder = ckpt
    result = run_cli("verify", folder, "--against", f"s3://{s3_env.bucket}/nothing-here")
    assert_one_line_error(result, code=2, contains=f"s3://{s3_env.bucket}/nothing-here: no objects under this prefix")
