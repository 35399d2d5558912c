"""torch.distributed.checkpoint (DCP) folders: single-process saves, chunked tensors, errors."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_bit_equal, assert_one_line_error, leftovers, load_folder, make_state_dict

import shardkit
from shardkit.errors import ShardkitWarning
from shardkit.sources import open_source
from shardkit.sources.dcp import DCPSource

DCP_CODES = ["BOOL", "U8", "I8", "I16", "F16", "BF16", "I32", "F32", "F64", "I64", "C64", "F8_E4M3", "F8_E5M2"]


def dcp_save(state: dict, folder: Path) -> Path:
    """``dcp.save`` in one process, no process group."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    return folder


@pytest.fixture
def model_sd() -> dict:
    return make_state_dict(DCP_CODES, shapes=[(), (7,), (33, 17), (2, 3, 4)])


@pytest.mark.parametrize("command", ["convert", "split"])
def test_single_process_save_round_trips_bit_equal(model_sd, tmp_path: Path, run_cli, command: str) -> None:
    folder = dcp_save(model_sd, tmp_path / "ckpt")
    result = run_cli(command, folder, tmp_path / "out", "--max-shard-size", "2KB", "-q")
    assert result.exit_code == 0, result.stderr
    assert_bit_equal(load_folder(tmp_path / "out"), model_sd)


def test_matches_torchs_own_consolidation(model_sd, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = dcp_save(model_sd, tmp_path / "ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(str(folder), str(tmp_path / "ref.pt"))
    shardkit.convert(folder, tmp_path / "out")
    assert_bit_equal(load_folder(tmp_path / "out"), torch.load(tmp_path / "ref.pt", weights_only=True))


def test_tensors_are_located_for_kernel_copies(model_sd, tmp_path: Path) -> None:
    folder = dcp_save(model_sd, tmp_path / "ckpt")
    with open_source(str(folder)) as src:
        assert isinstance(src, DCPSource)
        entries = src.entries()
        assert all(e.file is not None and e.file.endswith(".distcp") for e in entries)
        for e in entries:
            with open(e.file, "rb") as f:
                f.seek(e.offset)
                from conftest import tensor_bytes
                assert f.read(e.nbytes) == tensor_bytes(model_sd[e.name])


def test_nested_state_dict_is_auto_selected_and_key_chooses(model_sd, tmp_path: Path, run_cli) -> None:
    small = {k: v for k, v in list(model_sd.items())[:4]}
    folder = dcp_save({"model": small, "optim": {"state": {"w": torch.ones(3)}, "lr": 0.1}, "step": 7},
                      tmp_path / "ckpt")
    with pytest.warns(ShardkitWarning, match="converting the 'model' state dict; also present: optim, step"):
        shardkit.convert(folder, tmp_path / "out")
    assert_bit_equal(load_folder(tmp_path / "out"), small)
    result = run_cli("convert", folder, tmp_path / "optim", "--key", "optim/state", "-q")
    assert result.exit_code == 0, result.stderr
    assert_bit_equal(load_folder(tmp_path / "optim"), {"w": torch.ones(3)})
    line = assert_one_line_error(run_cli("convert", folder, tmp_path / "x", "--key", "ema"), contains="not found")
    assert "model" in line and "optim" in line
    assert_one_line_error(run_cli("convert", folder, tmp_path / "x", "--key", "optim"), contains="not tensors")


def test_missing_metadata_is_a_clear_error(model_sd, tmp_path: Path, run_cli) -> None:
    folder = dcp_save(model_sd, tmp_path / "ckpt")
    (folder / ".metadata").unlink()
    line = assert_one_line_error(run_cli("convert", folder, tmp_path / "out"), contains="no .metadata")
    assert ".distcp" in line
    assert not (tmp_path / "out").exists()


def test_missing_or_truncated_data_file_is_a_clear_error(model_sd, tmp_path: Path, run_cli) -> None:
    folder = dcp_save(model_sd, tmp_path / "ckpt")
    data = next(folder.glob("*.distcp"))
    raw = data.read_bytes()
    data.write_bytes(raw[: len(raw) // 2])
    assert_one_line_error(run_cli("convert", folder, tmp_path / "out"), contains="truncated")
    data.unlink()
    assert_one_line_error(run_cli("convert", folder, tmp_path / "out"), contains="does not exist")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_malicious_metadata_never_runs(model_sd, tmp_path: Path, run_cli) -> None:
    folder = dcp_save(model_sd, tmp_path / "ckpt")
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (folder / ".metadata").write_bytes(pickle.dumps(Payload()))
    assert_one_line_error(run_cli("convert", folder, tmp_path / "out"), contains="refused to unpickle")
    assert not marker.exists()


def _handmade_chunked(folder: Path, full: dict[str, torch.Tensor], cuts: dict[str, list[tuple]]) -> None:
    """A DCP folder whose tensors are cut into chunks (as several ranks write them), built by hand
    with torch's own metadata classes; each chunk is a ``torch.save`` record in one of two files."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    folder.mkdir()
    files = {0: io.BytesIO(), 1: io.BytesIO()}
    sd_meta, storage = {}, {}
    for name, tensor in full.items():
        chunks = []
        for i, (offsets, sizes) in enumerate(cuts[name]):
            piece = tensor[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].clone()
            f = files[i % 2]
            start = f.tell()
            torch.save(piece, f)
            storage[MetadataIndex(name, offsets)] = _StorageInfo(f"__{i % 2}_0.distcp", start, f.tell() - start)
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
        sd_meta[name] = TensorStorageMetadata(TensorProperties(dtype=tensor.dtype), tensor.size(), chunks)
    for rank, f in files.items():
        (folder / f"__{rank}_0.distcp").write_bytes(f.getvalue())
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(Metadata(state_dict_metadata=sd_meta, storage_data=storage), f)


def test_chunked_tensors_are_reassembled(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    full = {
        "rows": torch.randn(9, 5, generator=g),                      # cut along dim 0 (FSDP)
        "cols": torch.randn(4, 10, generator=g).to(torch.bfloat16),  # cut along dim 1 (tensor parallel)
        "grid": torch.randn(6, 4, 3, generator=g),                   # cut along two dims
        "vec": torch.arange(11, dtype=torch.int64),
    }
    cuts = {
        "rows": [((0, 0), (5, 5)), ((5, 0), (4, 5))],
        "cols": [((0, 0), (4, 3)), ((0, 3), (4, 7))],
        "grid": [((0, 0, 0), (3, 4, 3)), ((3, 0, 0), (3, 2, 3)), ((3, 2, 0), (3, 2, 3))],
        "vec": [((0,), (6,)), ((6,), (5,))],
    }
    _handmade_chunked(tmp_path / "ckpt", full, cuts)
    # torch's own loader agrees the folder is valid and holds these tensors
    loaded = {k: torch.empty_like(v) for k, v in full.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(loaded, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert_bit_equal(loaded, full)
    # small writer chunks force reassembly across slab boundaries
    from shardkit.sharding import writer

    old = writer.CHUNK_BYTES
    writer.CHUNK_BYTES = 24
    try:
        shardkit.convert(tmp_path / "ckpt", tmp_path / "out", max_shard_size="100B")
    finally:
        writer.CHUNK_BYTES = old
    assert_bit_equal(load_folder(tmp_path / "out"), full)


MULTI_RANK = """
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp, warnings
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import distribute_tensor, Shard, Replicate
from torch.distributed.device_mesh import init_device_mesh
warnings.simplefilter("ignore")

def full():
    g = torch.Generator().manual_seed(0)
    return {"w0": torch.randn(7, 5, generator=g), "w1": torch.randn(4, 9, generator=g).to(torch.bfloat16),
            "v": torch.randn(11, generator=g), "r": torch.randn(3, 2, generator=g)}

def run(rank, out, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"; os.environ["MASTER_PORT"] = port
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    f = full()
    sd = {"w0": distribute_tensor(f["w0"], mesh, [Shard(0)]), "w1": distribute_tensor(f["w1"], mesh, [Shard(1)]),
          "v": distribute_tensor(f["v"], mesh, [Shard(0)]), "r": distribute_tensor(f["r"], mesh, [Replicate()])}
    dcp.save({"model": sd}, checkpoint_id=out)
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1], sys.argv[2]), nprocs=2)
    torch.save(full(), sys.argv[1] + ".expected.pt")
"""


@pytest.mark.slow
def test_two_rank_fsdp_style_save(tmp_path: Path) -> None:
    import random

    script = tmp_path / "save.py"
    script.write_text(MULTI_RANK)
    folder = tmp_path / "ckpt"
    subprocess.run([sys.executable, str(script), str(folder), str(random.randint(20000, 40000))], check=True,
                   timeout=300, capture_output=True)
    assert len(list(folder.glob("*.distcp"))) == 2
    shardkit.convert(folder, tmp_path / "out")
    assert_bit_equal(load_folder(tmp_path / "out"), torch.load(f"{folder}.expected.pt", weights_only=True))
