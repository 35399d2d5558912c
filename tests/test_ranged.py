"""A RangedCheckpoint: headers in a local folder, tensor bytes read by range through RangeFile objects
(what hf:// streaming is, and what s3:// plugs into); the writer sees an ordinary source."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import shardkit
from shardkit.errors import InvalidInputError, ShardkitError
from shardkit.formats.header import read_header
from shardkit.sources import RangedCheckpoint, open_source
from shardkit.sources.ranged import beneath, shown


class FileBytes:
    """A RangeFile serving the real bytes of a local file (the 'remote object'), counting what it served."""

    def __init__(self, real: Path, name: str) -> None:
        self.data, self._name = real.read_bytes(), name
        self.served = 0
        self.closed = False
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self._name

    @property
    def size_bytes(self) -> int:
        return len(self.data)

    def read_into(self, offset: int, out: memoryview) -> None:
        if offset + len(out) > len(self.data):
            raise ShardkitError(f"{self.name}: past the end")
        out[:] = self.data[offset:offset + len(out)]
        with self._lock:
            self.served += len(out)

    def close(self) -> None:
        self.closed = True


def _header_only_copy(real: Path, mirror: Path) -> None:
    """What an hf:// mirror holds: every file, safetensors ones as their header and a hole of the right size."""
    shutil.copytree(real, mirror)
    for path in mirror.glob("*.safetensors"):
        start = read_header(str(path)).data_start
        size = path.stat().st_size
        with open(path, "r+b") as f:
            f.truncate(start)
            f.truncate(size)


def _checkpoint(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    tensors = {f"blocks.{i}.weight": torch.randn(64, 33) for i in range(8)}
    tensors["blocks.0.bias"] = torch.randn(64).to(torch.float16)
    shardkit.split(_single(tmp_path, tensors), tmp_path / "real", max_shard_size="20KB")
    (tmp_path / "real" / "config.json").write_text('{"model_type": "toy"}')
    return tmp_path / "real", tensors


def _single(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    save_file(tensors, str(tmp_path / "one.safetensors"))
    return tmp_path / "one.safetensors"


@pytest.mark.parametrize("read_ahead", [True, False])
def test_a_split_of_a_ranged_checkpoint_reads_every_byte_by_range_and_equals_a_local_split(
        tmp_path: Path, read_ahead: bool) -> None:
    real, tensors = _checkpoint(tmp_path)
    mirror = tmp_path / "mirror"
    _header_only_copy(real, mirror)
    files: dict[str, FileBytes] = {}

    def open_file(path: str) -> FileBytes:
        rel = os.path.relpath(path, mirror)
        files[rel] = FileBytes(real / rel, f"remote://bucket/{rel}")
        return files[rel]

    ckpt = RangedCheckpoint(str(mirror), open_file, name="remote://bucket", read_ahead=read_ahead)
    result = shardkit.split(ckpt, tmp_path / "out", max_shard_size="1GB")
    shardkit.split(real, tmp_path / "local", max_shard_size="1GB")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "local" / "model.safetensors").read_bytes()
    assert (tmp_path / "out" / "config.json").exists(), "side files come from the local folder"
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    data_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert sum(f.served for f in files.values()) == data_bytes, "every tensor byte came by range, once"
    assert all(f.closed for f in files.values())
    assert "remote://bucket" in result.source and str(mirror) not in result.source


def test_a_ranged_checkpoint_names_itself_and_its_parts_by_name() -> None:
    ckpt = RangedCheckpoint("/tmp/m123", lambda p: None, name="hf://org/pipe")  # type: ignore[arg-type,return-value]
    part = beneath(ckpt, "/tmp/m123/unet")
    assert isinstance(part, RangedCheckpoint) and part.root == "/tmp/m123" and os.fspath(part) == "/tmp/m123/unet"
    assert shown(part) == "hf://org/pipe/unet" and str(ckpt) == "hf://org/pipe"
    assert beneath("pipe", "pipe/unet") == "pipe/unet"


def test_only_safetensors_weights_are_read_by_range(tmp_path: Path) -> None:
    folder = tmp_path / "pickled"
    folder.mkdir()
    torch.save({"w": torch.randn(3)}, folder / "pytorch_model.bin")
    ckpt = RangedCheckpoint(str(folder), lambda p: None, name="remote://x")  # type: ignore[arg-type,return-value]
    with pytest.raises(InvalidInputError, match="only safetensors files are read by range"):
        open_source(ckpt)
