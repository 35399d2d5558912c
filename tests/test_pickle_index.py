"""Sharded pickle checkpoints (``pytorch_model-0000x-of-0000y.bin`` + index)."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from conftest import assert_bit_equal, assert_one_line_error, load_folder, make_state_dict

import shardkit
from shardkit.sources import open_source, pickle_index
from shardkit.sources.pickle_index import PickleIndexSource


def write_sharded_bin(folder: Path, sd: dict, *, max_shard_size: int = 400) -> Path:
    import huggingface_hub

    folder.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        huggingface_hub.save_torch_state_dict(sd, folder, safe_serialization=False, max_shard_size=max_shard_size)
    assert len(list(folder.glob("pytorch_model-*.bin"))) > 1
    return folder / "pytorch_model.bin.index.json"


@pytest.fixture
def sharded(tmp_path: Path) -> tuple[Path, dict]:
    sd = make_state_dict(shapes=[(), (7,), (33, 17)])
    return write_sharded_bin(tmp_path / "ckpt", sd, max_shard_size=6000), sd


@pytest.mark.parametrize("command", ["convert", "split"])
def test_index_and_folder_convert_bit_equal(sharded, tmp_path: Path, run_cli, command: str) -> None:
    index, sd = sharded
    for i, src in enumerate((index, index.parent)):
        out = tmp_path / f"out{i}"
        result = run_cli(command, src, out, "--max-shard-size", "2KB", "-q")
        assert result.exit_code == 0, result.stderr
        assert_bit_equal(load_folder(out), sd)


def test_entries_carry_file_offsets_for_kernel_copies(sharded) -> None:
    index, _ = sharded
    with open_source(str(index)) as src:
        assert isinstance(src, PickleIndexSource)
        assert all(e.file is not None for e in src.entries() if e.nbytes)
        assert src.naming.prefix == "model"


def test_one_shard_loaded_at_a_time(sharded, tmp_path: Path, monkeypatch) -> None:
    index, sd = sharded
    live: list[str] = []
    peak = 0
    real_open = pickle_index._open_shard

    class Tracked:
        def __init__(self, path: str, **kw) -> None:
            nonlocal peak
            self.inner = real_open(path, **kw)
            self.path = path
            live.append(path)
            peak = max(peak, len(live))

        def __getattr__(self, name: str):
            return getattr(self.inner, name)

        def close(self) -> None:
            self.inner.close()
            live.remove(self.path)

    monkeypatch.setattr(pickle_index, "_open_shard", Tracked)
    # Force reads through the loaded shard (no kernel copy) by casting.
    shardkit.convert(index, tmp_path / "out", dtype="fp32", max_shard_size="1MB")
    assert peak == 1
    assert live == []
    assert_bit_equal(load_folder(tmp_path / "out"), {k: v.float() if v.dtype in (torch.float16, torch.bfloat16, torch.float64) else v for k, v in sd.items()})


def test_missing_shard_is_an_error(sharded, tmp_path: Path, run_cli) -> None:
    index, _ = sharded
    victim = sorted(index.parent.glob("pytorch_model-*.bin"))[-1]
    victim.unlink()
    assert_one_line_error(run_cli("convert", index, tmp_path / "out"), contains="does not exist")
    assert not (tmp_path / "out").exists()


def test_index_that_disagrees_with_shards_is_an_error(sharded, tmp_path: Path, run_cli) -> None:
    index, _ = sharded
    doc = json.loads(index.read_text())
    counts = {s: list(doc["weight_map"].values()).count(s) for s in doc["weight_map"].values()}
    name = next(n for n, s in doc["weight_map"].items() if counts[s] > 1)  # its shard stays indexed
    shards = sorted(set(doc["weight_map"].values()))
    original = dict(doc["weight_map"])
    doc["weight_map"][name] = next(s for s in shards if s != doc["weight_map"][name])
    index.write_text(json.dumps(doc))
    assert_one_line_error(run_cli("convert", index, tmp_path / "out"), contains=repr(name))

    del doc["weight_map"][name]
    index.write_text(json.dumps(doc))
    assert_one_line_error(run_cli("convert", index, tmp_path / "out"), contains="missing from the index")

    doc["weight_map"] = {**original, "ghost.weight": shards[0]}
    index.write_text(json.dumps(doc))
    assert_one_line_error(run_cli("convert", index, tmp_path / "out"), contains="ghost.weight")
    assert not (tmp_path / "out").exists()


def test_unsafe_shard_name_is_refused_before_opening(sharded, tmp_path: Path, run_cli) -> None:
    index, _ = sharded
    doc = json.loads(index.read_text())
    first = next(iter(doc["weight_map"]))
    doc["weight_map"][first] = "../outside.bin"
    index.write_text(json.dumps(doc))
    assert_one_line_error(run_cli("convert", index, tmp_path / "out"), contains="path")


def test_malicious_shard_never_runs(sharded, tmp_path: Path, run_cli) -> None:
    index, _ = sharded
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    victim = sorted(index.parent.glob("pytorch_model-*.bin"))[0]
    torch.save({"x": Payload()}, victim)
    assert_one_line_error(run_cli("convert", index, tmp_path / "out"), contains="refused to unpickle")
    assert not marker.exists()
