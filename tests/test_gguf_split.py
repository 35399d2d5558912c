"""Split GGUF both ways: ``max_shard_size`` with ``to='gguf'`` writes llama.cpp's gguf-split layout, and a split GGUF
is a source.

Judges: ``convert_hf_to_gguf.py --split-max-size`` on the same folder (the same files, each with the same tensors and
keys, ``split.*`` included), and llama.cpp's runtime, which loads the model from the first file and runs it as it
runs the single file.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import assert_one_line_error
from helpers_llama_cpp import fixture_pre, gguf_fields, gguf_tensors, run_converter, run_llama_cpp, tiny_model_folder

import shardkit
from shardkit.layouts import gguf_pre
from shardkit.layouts.gguf_vocab import probe_hash

gguf = pytest.importorskip("gguf")
PARTS = [f"m-{i:05d}-of-00004.gguf" for i in range(1, 5)]


def _llama(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tiny_model_folder(tmp_path / "llama", "llama")
    monkeypatch.setitem(gguf_pre.PRE_TOKENIZERS, probe_hash(str(folder / "tokenizer.json")), fixture_pre("llama"))
    return folder


def _split_fields(path: Path) -> dict[str, object]:
    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("split.")}


def test_max_shard_size_writes_the_converters_split_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _llama(tmp_path, monkeypatch)
    (tmp_path / "ref").mkdir()
    (tmp_path / "ours").mkdir()
    run_converter(folder, tmp_path / "ref" / "m.gguf", outtype="q8_0", pre_fallback="gpt-2",
                  extra=("--split-max-size", "40K"))
    result = shardkit.convert(folder, tmp_path / "ours" / "m.gguf", to="gguf", quantize="q8_0", max_shard_size="40KB")
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == PARTS == sorted(
        p.name for p in (tmp_path / "ref").iterdir())
    assert [Path(f).name for f in result.files] == PARTS
    for name in PARTS:
        ours, theirs = tmp_path / "ours" / name, tmp_path / "ref" / name
        assert gguf_tensors(ours) == gguf_tensors(theirs), name
        assert gguf_fields(ours) == gguf_fields(theirs), name
    assert _split_fields(tmp_path / "ours" / PARTS[1]) == {"split.no": 1, "split.count": 4, "split.tensors.count": 21}


def test_llama_cpp_loads_the_split_from_its_first_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _llama(tmp_path, monkeypatch)
    shardkit.convert(folder, tmp_path / "one.gguf", to="gguf", quantize="q8_0")
    shardkit.convert(folder, tmp_path / "m.gguf", to="gguf", quantize="q8_0", max_shard_size="40KB")
    assert not (tmp_path / "m.gguf").exists()
    text = "Hello world, the quick brown fox"
    assert run_llama_cpp(tmp_path / PARTS[0], "generate", text) == run_llama_cpp(tmp_path / "one.gguf", "generate", text)


def test_a_split_gguf_is_a_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Merged back into one GGUF: byte-equal to the single-file conversion; into a folder: the same weights."""
    folder = _llama(tmp_path, monkeypatch)
    shardkit.convert(folder, tmp_path / "one.gguf", to="gguf", quantize="q8_0")
    shardkit.convert(folder, tmp_path / "m.gguf", to="gguf", quantize="q8_0", max_shard_size="40KB")
    shardkit.convert(tmp_path / PARTS[0], tmp_path / "merged.gguf", to="gguf")
    assert (tmp_path / "merged.gguf").read_bytes() == (tmp_path / "one.gguf").read_bytes()
    shardkit.convert(tmp_path / PARTS[0], tmp_path / "a", dtype="fp32")
    shardkit.convert(tmp_path / "one.gguf", tmp_path / "b", dtype="fp32")
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert "Q8_0" in shardkit.info(tmp_path / PARTS[0]).quantization["description"]


def test_a_later_part_or_a_missing_one_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run_cli) -> None:
    folder = _llama(tmp_path, monkeypatch)
    shardkit.convert(folder, tmp_path / "m.gguf", to="gguf", quantize="q8_0", max_shard_size="40KB")
    assert_one_line_error(run_cli("convert", tmp_path / PARTS[1], tmp_path / "x.gguf", "--to", "gguf"),
                          contains="give the first part")
    (tmp_path / PARTS[2]).unlink()
    assert_one_line_error(run_cli("convert", tmp_path / PARTS[0], tmp_path / "x.gguf", "--to", "gguf"),
                          contains=PARTS[2])
    assert not (tmp_path / "x.gguf").exists()


def test_the_default_shard_size_writes_one_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _llama(tmp_path, monkeypatch)
    result = shardkit.convert(folder, tmp_path / "m.gguf", to="gguf", quantize="q8_0")
    assert [Path(f).name for f in result.files] == ["m.gguf"]
    assert _split_fields(tmp_path / "m.gguf") == {}
