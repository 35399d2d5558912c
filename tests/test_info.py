"""info(): numbers checked against values computed independently with safetensors and torch."""

from __future__ import annotations

import json
import math
import struct

import pytest
import torch
from helpers_verify import build_pipeline, index_of, make_state_dict
from safetensors import safe_open
from safetensors.torch import save_file

import shardkit
from shardkit.checking.info import info
from shardkit.errors import SourceNotFoundError

FLOATS = {torch.float64, torch.float32, torch.float16, torch.bfloat16}
_DTYPE_CODE = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
               torch.bool: "BOOL"}


def expected_summary(files: list) -> dict:
    """Everything info reports, computed with safe_open (tensors loaded) and torch."""
    tensors = {}
    for path in files:
        with safe_open(str(path), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    by_dtype: dict[str, int] = {}
    for t in tensors.values():
        code = _DTYPE_CODE[t.dtype]
        by_dtype[code] = by_dtype.get(code, 0) + t.numel() * t.element_size()
    memory = {k: sum(t.numel() * w if t.dtype in FLOATS else t.numel() * t.element_size() for t in tensors.values())
              for k, w in (("fp32", 4), ("bf16", 2), ("fp8", 1))}
    largest = sorted(tensors, key=lambda k: -tensors[k].numel() * tensors[k].element_size())[:10]
    return {
        "tensor_count": len(tensors),
        "parameter_count": sum(t.numel() for t in tensors.values()),
        "total_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "bytes_by_dtype": by_dtype,
        "memory_bytes": memory,
        "largest_sizes": sorted((tensors[k].numel() * tensors[k].element_size() for k in largest), reverse=True),
        "shapes": {k: list(t.shape) for k, t in tensors.items()},
    }


def assert_matches(summary, expected: dict) -> None:
    for key in ("tensor_count", "parameter_count", "total_bytes", "bytes_by_dtype", "memory_bytes"):
        assert getattr(summary, key) == expected[key], key
    assert [t.bytes for t in summary.largest] == expected["largest_sizes"]
    for t in summary.largest:
        assert t.shape == expected["shapes"][t.name.split("/", 1)[-1]]


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "weights.safetensors"
    save_file(make_state_dict(), str(path), metadata={"format": "pt", "note": "hello"})
    return path


def test_single_file(source):
    summary = info(source)
    assert_matches(summary, expected_summary([source]))
    assert summary.format == "safetensors" and summary.index is None
    assert summary.metadata == {"format": "pt", "note": "hello"}
    assert [(s.file, s.tensors, s.file_bytes) for s in summary.shards] == [
        (source.name, len(make_state_dict()), source.stat().st_size)]
    assert len(summary.largest) == 10
    json.dumps(summary.to_dict())


def test_sharded_folder_and_its_index(tmp_path, source):
    out = tmp_path / "out"
    shardkit.split(str(source), str(out), max_shard_size=20_000, variant="fp16")
    index_name = "model.safetensors.index.fp16.json"
    weight_map = index_of(out, index_name)["weight_map"]
    shard_names = sorted(set(weight_map.values()))
    for target in (out, out / index_name):
        summary = info(target)
        assert_matches(summary, expected_summary([out / n for n in shard_names]))
        assert summary.format == "safetensors-sharded"
        assert (summary.naming, summary.variant, summary.index) == ("model", "fp16", index_name)
        assert summary.index_metadata["total_size"] == summary.total_bytes
        assert sorted(s.file for s in summary.shards) == shard_names
        for shard in summary.shards:
            names = [t for t, s in weight_map.items() if s == shard.file]
            assert shard.tensors == len(names)
            assert shard.file_bytes == (out / shard.file).stat().st_size
            with safe_open(str(out / shard.file), "pt") as f:
                assert shard.bytes == sum(f.get_tensor(n).nbytes for n in names)


def test_pickle(tmp_path):
    sd = make_state_dict()
    torch.save({"state_dict": sd, "epoch": 3}, tmp_path / "model.ckpt")
    save_file(sd, str(tmp_path / "same.safetensors"))
    summary = info(tmp_path / "model.ckpt")
    assert summary.format == "pickle"
    assert_matches(summary, expected_summary([tmp_path / "same.safetensors"]))


def test_pipeline_sections_and_totals(tmp_path):
    pipe = build_pipeline(tmp_path / "pipe")
    summary = info(pipe)
    assert summary.format == "diffusers-pipeline"
    assert list(summary.components) == ["unet", "text_encoder"]
    unet_files = sorted((pipe / "unet").glob("*.safetensors"))
    assert len(unet_files) >= 2
    unet, te = summary.components["unet"], summary.components["text_encoder"]
    assert_matches(unet, expected_summary(unet_files))
    assert_matches(te, expected_summary([pipe / "text_encoder" / "model.safetensors"]))
    assert (unet.naming, unet.library, unet.class_name) == ("diffusion_pytorch_model", "diffusers", "UNet2DConditionModel")
    assert (te.naming, te.format) == ("model", "safetensors")
    assert_matches(summary, expected_summary(unet_files + [pipe / "text_encoder" / "model.safetensors"]))
    assert {s.file for s in summary.shards} == {f"unet/{f.name}" for f in unet_files} | {"text_encoder/model.safetensors"}
    assert all("/" in t.name for t in summary.largest)


def test_reads_headers_only(tmp_path, monkeypatch):
    """A 64 GiB sparse file: info must answer from the header without touching the data."""
    from shardkit.sources.safetensors import SafetensorsSource

    numel = 16 * 2**30
    header = json.dumps({"huge": {"dtype": "F32", "shape": [numel], "data_offsets": [0, 4 * numel]}}).encode()
    header += b" " * (-len(header) % 8)
    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + 4 * numel)
    monkeypatch.setattr(SafetensorsSource, "read", lambda *a, **k: pytest.fail("info read tensor data"))
    summary = info(path)
    assert summary.parameter_count == numel
    assert summary.memory_bytes == {"fp32": 4 * numel, "bf16": 2 * numel, "fp8": numel}
    assert math.prod(summary.largest[0].shape) == numel


def test_missing_path(tmp_path):
    with pytest.raises(SourceNotFoundError):
        info(tmp_path / "nope")


def test_dcp_folder(tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp

    state = {"a": torch.randn(4, 4), "b": torch.arange(3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": state}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = info(str(tmp_path / "ck"))
    assert result.format == "dcp"
    assert result.tensor_count == 2
    assert result.parameter_count == 16 + 3
    assert result.total_bytes == 16 * 4 + 3 * 8


def test_shared_extents_are_reported_where_the_filesystem_tells(tmp_path, run_cli) -> None:
    """A plain copy shares nothing; the figure is None only where FIEMAP is unsupported (tmpfs)."""
    from shardkit.atomic.extents import shared_bytes

    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(4096)}, str(path))
    summary = info(path)
    known = shared_bytes(path)
    assert summary.shared_bytes == known and summary.shards[0].shared_bytes == known
    assert known in (0, None)
    result = run_cli("info", path)
    assert result.exit_code == 0
    assert ("shared extents  none" in result.stdout) == (known == 0)
    assert json.loads(run_cli("info", path, "--json").stdout)["shared_bytes"] == known
