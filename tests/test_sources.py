"""Sources: safetensors files and sharded folders, pickles, in-memory state dicts and modules."""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_bit_equal, make_state_dict, tensor_bytes

from shardkit.errors import (
    CheckpointIndexError,
    InvalidInputError,
    ShardkitWarning,
    SourceNotFoundError,
    UnsafePickleError,
)
from shardkit.formats.index import Naming
from shardkit.sources import Source, open_source
from shardkit.sources.memory import MemorySource, find_aliases
from shardkit.sources.pickle import load_pickle, locate_in_file, select_state_dict


def read_all(src: Source) -> dict[str, bytes]:
    return {e.name: bytes(src.read(e, 0, e.nbytes)) for e in src.entries()}


def _save_shards(folder: Path, parts: list[dict], prefix: str = "model") -> Path:
    """Hand-make a sharded checkpoint with the reference writer and a matching index."""
    import json

    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, part in enumerate(parts, 1):
        name = f"{prefix}-{i:05d}-of-{len(parts):05d}.safetensors"
        save_file(part, str(folder / name))
        weight_map.update({k: name for k in part})
    index = folder / f"{prefix}.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return index


# ------------------------------------------------------------------ dispatch

def test_open_source_dispatches_every_kind(tmp_path: Path, safetensors_file: Path, state_dict: dict) -> None:
    import torch

    expected = {k: tensor_bytes(v) for k, v in state_dict.items()}
    index = _save_shards(tmp_path / "sharded", [dict(list(state_dict.items())[:40]), dict(list(state_dict.items())[40:])])
    torch.save(state_dict, tmp_path / "model.pt")
    module = torch.nn.Linear(3, 2)
    kinds = {
        "file": safetensors_file,
        "folder-single": safetensors_file.parent,
        "index": index,
        "folder-index": index.parent,
        "pickle": tmp_path / "model.pt",
    }
    for kind, path in kinds.items():
        with open_source(path) as src:
            assert read_all(src) == expected, kind
    with open_source(state_dict) as src:
        assert read_all(src) == expected
    with open_source(module) as src:
        assert sorted(e.name for e in src.entries()) == ["bias", "weight"]
    mem = MemorySource(state_dict)
    assert open_source(mem) is mem


def test_open_source_errors(tmp_path: Path) -> None:
    with pytest.raises(SourceNotFoundError, match="no such file"):
        open_source(tmp_path / "missing.safetensors")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "README.md").write_text("hi")
    with pytest.raises(SourceNotFoundError, match="no checkpoint"):
        open_source(tmp_path / "empty")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(InvalidInputError, match="unsupported"):
        open_source(tmp_path / "notes.txt")
    with pytest.raises(InvalidInputError, match="state dict"):
        open_source(42)


# ------------------------------------------------------------------ safetensors

def test_safetensors_file_entries_are_in_file_order_with_metadata(safetensors_file: Path) -> None:
    with open_source(safetensors_file) as src:
        entries = src.entries()
        assert [e.offset for e in entries] == sorted(e.offset for e in entries)
        assert all(e.file == str(safetensors_file) for e in entries)
        assert src.metadata() == {"format": "pt"}
        assert src.naming == Naming()
        assert src.paths == (str(safetensors_file),)
        big = max(entries, key=lambda e: e.nbytes)
        assert src.read(big, 3, 9) == src.read(big, 0, big.nbytes)[3:9]


def test_sharded_folder_keeps_diffusers_naming_and_variant(tmp_path: Path) -> None:
    tensors = make_state_dict(["F32", "I64"])
    index = _save_shards(tmp_path / "unet", [{"layers.F32.0": tensors["layers.F32.0"]},
                                             {"layers.I64.0": tensors["layers.I64.0"]}],
                         prefix="diffusion_pytorch_model")
    with open_source(index.parent) as src:
        assert src.naming == Naming("diffusion_pytorch_model")
        assert [e.name for e in src.entries()] == ["layers.F32.0", "layers.I64.0"]
    from safetensors.torch import save_file

    save_file(tensors, str(tmp_path / "unet" / "diffusion_pytorch_model.fp16.safetensors"))
    with open_source(tmp_path / "unet", variant="fp16") as src:
        assert src.naming == Naming("diffusion_pytorch_model", "fp16")
        assert len(src.entries()) == 2


def _broken_index_folder(tmp_path: Path, case: str) -> Path:
    import json

    a = make_state_dict(["F32"], seed=1)
    b = make_state_dict(["I64", "U8"], seed=2)
    index = _save_shards(tmp_path / case, [a, b])
    doc = json.loads(index.read_text())
    wm = doc["weight_map"]
    if case == "missing shard":
        wm["layers.I64.0"] = "model-00009-of-00009.safetensors"
    elif case == "tensor not in its shard":
        wm["layers.I64.0"] = "model-00001-of-00002.safetensors"
    elif case == "shard tensor missing from index":
        del wm["layers.U8.0"]
    elif case == "same tensor in two shards":
        from safetensors.torch import save_file

        save_file({**b, **a}, str(index.parent / "model-00002-of-00002.safetensors"))
    elif case == "absolute path":
        wm["layers.I64.0"] = str(index.parent / "model-00002-of-00002.safetensors")
    elif case == "dot dot":
        wm["layers.I64.0"] = "../model-00002-of-00002.safetensors"
    index.write_text(json.dumps(doc))
    return index


@pytest.mark.parametrize("case, fragment", [
    ("missing shard", "does not exist"),
    ("tensor not in its shard", "not in its shard"),
    ("shard tensor missing from index", "missing from the index"),
    ("same tensor in two shards", "appears in both"),
    ("absolute path", "absolute"),
    ("dot dot", "path"),
])
def test_inconsistent_indexes_are_refused(tmp_path: Path, case: str, fragment: str) -> None:
    index = _broken_index_folder(tmp_path, case)
    for path in (index, index.parent):
        with pytest.raises(CheckpointIndexError, match=fragment):
            open_source(path)


# ------------------------------------------------------------------ pickles

def test_zip_pickle_tensors_are_located_in_the_file_for_kernel_copies(tmp_path: Path) -> None:
    import torch

    base = torch.arange(40, dtype=torch.float32)
    tensors = {
        "first_half": base[:20],  # two views into one storage
        "second_half": base[20:],
        "transposed": torch.randn(3, 5).t(),  # not contiguous → read through memory
        "ints": torch.arange(7),
        "bf16": torch.randn(9).to(torch.bfloat16),
        "fp8": torch.randn(6).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
    }
    path = tmp_path / "model.bin"
    torch.save(tensors, path)
    with open_source(path) as src:
        entries = {e.name: e for e in src.entries()}
        located = {name for name, e in entries.items() if e.file == str(path)}
        assert located == {"first_half", "second_half", "ints", "bf16", "fp8", "scalar"}
        blob = path.read_bytes()
        for name in located:
            e = entries[name]
            assert blob[e.offset:e.offset + e.nbytes] == tensor_bytes(tensors[name]), name
        assert read_all(src) == {k: tensor_bytes(v) for k, v in tensors.items()}
        assert src.naming == Naming() and src.paths == (str(path),)


def test_locate_in_file_never_guesses_wrong(tmp_path: Path) -> None:
    """Tensors that are not the file's mapped storages are never located (the bytes are checked)."""
    import torch

    path = tmp_path / "one.pt"
    torch.save({"w": torch.randn(64)}, path)
    assert locate_in_file(str(path), {"w": torch.randn(64)}) == {}
    assert locate_in_file(str(path), {"w": torch.zeros(64)}) == {}
    mapped = torch.load(path, mmap=True, weights_only=True)
    assert set(locate_in_file(str(path), mapped)) == {"w"}


def test_selected_sub_dict_among_other_storages_is_located_correctly(tmp_path: Path) -> None:
    import torch

    ema = {"w": torch.randn(64), "b": torch.randn(8)}
    path = tmp_path / "ckpt.pt"
    torch.save({"optimizer": {"m": torch.randn(64), "v": torch.randn(8)}, "ema": ema,
                "state_dict": {"w": torch.randn(64)}}, path)
    with open_source(path, key="ema") as src:
        assert all(e.file == str(path) for e in src.entries())
        assert read_all(src) == {k: tensor_bytes(v) for k, v in ema.items()}


def test_legacy_pickle_loads_with_a_memory_warning(tmp_path: Path) -> None:
    import torch

    tensors = make_state_dict(["F32", "BF16", "I64", "BOOL"], shapes=[(4,), ()])
    path = tmp_path / "legacy.pt"
    torch.save(tensors, path, _use_new_zipfile_serialization=False)
    with pytest.warns(ShardkitWarning, match="legacy"):
        src = open_source(path)
    with src:
        assert all(e.file is None for e in src.entries())
        assert read_all(src) == {k: tensor_bytes(v) for k, v in tensors.items()}


@pytest.mark.parametrize("wrapper", ["state_dict", "model", "module", "model_state_dict"])
def test_nested_state_dicts_are_unwrapped(tmp_path: Path, wrapper: str) -> None:
    import torch

    tensors = make_state_dict(["F16", "I32"])
    path = tmp_path / "nested.ckpt"
    torch.save({wrapper: tensors, "epoch": 3, "optimizer": {"lr": 0.1}}, path)
    with open_source(path) as src:
        assert read_all(src) == {k: tensor_bytes(v) for k, v in tensors.items()}


def test_key_selects_a_nested_state_dict(tmp_path: Path) -> None:
    import torch

    ema = make_state_dict(["F32"], seed=1)
    path = tmp_path / "two.ckpt"
    torch.save({"state_dict": make_state_dict(["F32"]), "extra": {"ema": ema}}, path)
    with open_source(path, key="extra/ema") as src:
        assert read_all(src) == {k: tensor_bytes(v) for k, v in ema.items()}
    with pytest.raises(InvalidInputError, match="key 'nope' not found; top-level keys are: state_dict, extra"):
        open_source(path, key="nope")


def test_select_state_dict_rejects_non_mappings() -> None:
    with pytest.raises(InvalidInputError, match="expected a dict of tensors, found list"):
        select_state_dict([1, 2])


def test_pickle_with_non_tensor_values_is_refused(tmp_path: Path) -> None:
    import torch

    path = tmp_path / "mixed.pt"
    torch.save({"w": torch.zeros(2), "step": 3, "name": "x"}, path)
    with pytest.raises(InvalidInputError, match="2 value\\(s\\) are not tensors: 'step' \\(int\\), 'name' \\(str\\)"):
        open_source(path)


def test_pickle_with_non_allowlisted_objects_is_refused(tmp_path: Path) -> None:
    import argparse

    import torch

    path = tmp_path / "args.pt"
    torch.save({"w": torch.zeros(2), "args": argparse.Namespace(lr=1)}, path)
    with pytest.raises(UnsafePickleError, match="argparse.Namespace"):
        open_source(path)


class _Payload:
    """Unpickling this runs ``open(marker, 'w')`` — if the loader ever executes pickled code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("zip_format", [True, False])
def test_malicious_reduce_never_runs(tmp_path: Path, zip_format: bool) -> None:
    import torch

    marker = tmp_path / "PWNED"
    path = tmp_path / "evil.bin"
    torch.save({"w": torch.zeros(2), "x": _Payload(str(marker))}, path,
               _use_new_zipfile_serialization=zip_format)
    # the payload is real: a plain unpickler runs it
    with open(tmp_path / "control.pkl", "wb") as f:
        pickle.dump(_Payload(str(tmp_path / "CONTROL")), f)
    with open(tmp_path / "control.pkl", "rb") as f:
        pickle.load(f).close()
    assert (tmp_path / "CONTROL").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(UnsafePickleError, match="never executes"):
            open_source(path)
    assert not marker.exists()


@pytest.mark.parametrize("content, fragment", [
    (b"", "empty"),
    (b"this is not a pickle", "not"),
])
def test_garbage_pickles(tmp_path: Path, content: bytes, fragment: str) -> None:
    path = tmp_path / "junk.ckpt"
    path.write_bytes(content)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(InvalidInputError, match=fragment):
            load_pickle(str(path))


def test_truncated_zip_pickle(tmp_path: Path) -> None:
    import torch

    path = tmp_path / "cut.pt"
    torch.save(make_state_dict(["F32"], shapes=[(1000,)]), path)
    path.write_bytes(path.read_bytes()[:2000])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(InvalidInputError) as info:
            open_source(path)
    assert str(path) in str(info.value)


# ------------------------------------------------------------------ in memory

def test_memory_source_handles_views_and_non_contiguous_tensors() -> None:
    import torch

    base, other = torch.randn(6, 8), torch.randn(6, 8)  # no name covers `other`: every view of it is written
    tensors = {"t": base.t(), "slice": other[2:4], "strided": other[:, ::2], "expand": torch.ones(3, 1).expand(3, 4)}
    with MemorySource(tensors) as src:
        got = read_all(src)
    assert got == {k: tensor_bytes(v) for k, v in tensors.items()}


def test_tied_tensors_are_written_once_with_aliases() -> None:
    import torch

    shared = torch.randn(4, 4)
    tensors = {"lm_head.weight": shared, "embed.weight": shared, "other": shared.clone(), "view": shared[1:]}
    # as huggingface_hub: the first name covering the storage is kept, a view of part of it dropped
    assert find_aliases(tensors) == {"lm_head.weight": "embed.weight", "view": "embed.weight"}
    with MemorySource(tensors) as src:
        assert [e.name for e in src.entries()] == ["embed.weight", "other"]
        assert src.aliases() == {"lm_head.weight": "embed.weight"}  # a partial view is dropped, not aliased
    with MemorySource(tensors, dedupe=False) as src:
        assert len(src.entries()) == 4


def test_module_state_dict_with_tied_weights() -> None:
    import torch

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

    with open_source(Tied()) as src:
        assert src.aliases() == {"head.weight": "embed.weight"}
        assert [e.name for e in src.entries()] == ["embed.weight"]


@pytest.mark.parametrize("bad, fragment", [
    ({"w": 3}, "not tensors"),
    ({}, "no tensors"),
    ({1: "x"}, "not tensors"),
    ("meta", "meta device"),
    ("sparse", "layout"),
    ("int-key", "must be strings"),
])
def test_memory_source_refusals(bad: Any, fragment: str) -> None:
    import torch

    if bad == "meta":
        bad = {"w": torch.empty(3, device="meta")}
    elif bad == "sparse":
        bad = {"w": torch.eye(3).to_sparse()}
    elif bad == "int-key":
        bad = {1: torch.zeros(1)}
    with pytest.raises(InvalidInputError, match=fragment):
        MemorySource(bad)


def test_memory_source_round_trips_every_dtype(state_dict: dict) -> None:
    with MemorySource(state_dict) as src:
        assert read_all(src) == {k: tensor_bytes(v) for k, v in state_dict.items()}
        # key order, except that empty tensors follow the first empty one (as huggingface_hub plans them)
        assert [e.name for e in src.entries() if e.nbytes] == [k for k, v in state_dict.items() if v.numel()]
        assert sorted(e.name for e in src.entries()) == sorted(state_dict)


def test_save_sharded_moves_gpu_tensors_one_at_a_time_cpu_fallback(tmp_path: Path) -> None:
    """On CPU-only machines this is the plain path; the gpu-marked twin covers CUDA."""
    from conftest import load_folder

    import shardkit

    tensors = make_state_dict(["F32", "BF16"], shapes=[(100,)])
    shardkit.save_sharded(tensors, tmp_path / "out", max_shard_size=300)
    assert_bit_equal(load_folder(tmp_path / "out"), tensors)


@pytest.mark.gpu
def test_save_sharded_from_cuda(tmp_path: Path) -> None:
    from conftest import load_folder

    import shardkit

    tensors = make_state_dict(["F32", "BF16", "I64"], shapes=[(100,), (3, 5)])
    on_gpu = {k: v.to("cuda") for k, v in tensors.items()}
    shardkit.save_sharded(on_gpu, tmp_path / "out", max_shard_size=300)
    assert_bit_equal(load_folder(tmp_path / "out"), tensors)
    assert all(v.device.type == "cuda" for v in on_gpu.values())


def test_source_path_and_env_untouched(tmp_path: Path, safetensors_file: Path) -> None:
    before = os.stat(safetensors_file)
    with open_source(safetensors_file) as src:
        read_all(src)
    after = os.stat(safetensors_file)
    assert (before.st_mtime_ns, before.st_size) == (after.st_mtime_ns, after.st_size)
