"""``verify`` of a GGUF, split ones whole: every part's header, bytes and values, through the CLI and the Python API.

The split is what ``convert --to gguf --max-shard-size`` writes (llama.cpp's gguf-split layout, judged against
``convert_hf_to_gguf.py --split-max-size`` in test_gguf_split.py).
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import pytest
from conftest import assert_one_line_error
from helpers_gguf import tiny_llama_folder

import shardkit
from shardkit.formats.gguf import read_gguf


@pytest.fixture(scope="module")
def split_gguf(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """A tiny Llama as a q8_0 GGUF in three or more parts (no tokenizer: the no-vocabulary warning is expected)."""
    root = tmp_path_factory.mktemp("split")
    tiny_llama_folder(root / "llama")
    (root / "out").mkdir()
    with pytest.warns(shardkit.ShardkitWarning, match="no vocabulary"):
        result = shardkit.convert(root / "llama", root / "out" / "m.gguf", to="gguf", quantize="q8_0",
                                  max_shard_size="40KB")
    parts = [Path(f) for f in result.files]
    assert len(parts) >= 3 and [p.name for p in parts] == [f"m-{i:05d}-of-{len(parts):05d}.gguf"
                                                          for i in range(1, len(parts) + 1)]
    return parts


@pytest.fixture
def parts(split_gguf: list[Path], tmp_path: Path) -> list[Path]:
    """A copy of the split to damage."""
    copies = [tmp_path / p.name for p in split_gguf]
    for source, copy in zip(split_gguf, copies, strict=True):
        copy.write_bytes(source.read_bytes())
    return copies


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_verify_reads_every_part(parts: list[Path], run_cli) -> None:
    report = shardkit.verify(parts[0])
    assert report.ok, report.findings
    assert [(f.name, f.bytes, f.sha256, f.checked) for f in report.files] == [
        (p.name, p.stat().st_size, _sha256(p), "gguf-values") for p in parts]
    assert report.bytes_read == sum(p.stat().st_size for p in parts)
    assert report.tensors_checked == sum(len(read_gguf(p).tensors) for p in parts) == 21
    result = run_cli("verify", parts[0])
    assert result.exit_code == 0, result.stderr
    for p in parts:
        assert f"sha256 {_sha256(p)}" in result.stdout and p.name in result.stdout
    assert f"ok: {len(parts)} file(s), 21 tensor(s)" in result.stdout


def test_a_missing_part_is_a_finding_naming_it(parts: list[Path], run_cli) -> None:
    parts[1].unlink()
    report = shardkit.verify(parts[0])
    assert not report.ok
    assert [(f.file, f.tensor) for f in report.findings] == [(parts[1].name, None)]
    assert report.findings[0].message.startswith(f"missing: part 2 of this {len(parts)}-part split GGUF")
    assert [f.name for f in report.files] == [p.name for p in parts if p != parts[1]]  # the others still hashed
    assert all(f.checked == "structure" for f in report.files) and report.tensors_checked == 0
    result = run_cli("verify", parts[0])
    assert result.exit_code == 1
    assert f"FAIL {parts[1].name}: missing: part 2" in result.stdout


def test_a_truncated_part_is_a_finding_naming_it(parts: list[Path], run_cli) -> None:
    last = parts[-1]
    last.write_bytes(last.read_bytes()[:-100])
    result = run_cli("verify", parts[0])
    assert result.exit_code == 1
    fails = [line for line in result.stdout.splitlines() if line.startswith("FAIL")]
    assert len(fails) == 1 and fails[0].startswith(f"FAIL {last.name}: tensor ") and "truncated" in fails[0]
    report = shardkit.verify(parts[0])
    assert [f.file for f in report.findings] == [last.name]


def test_a_damaged_value_in_a_later_part_names_that_part(parts: list[Path], run_cli) -> None:
    header = read_gguf(parts[-1])
    norm = next(t for t in header.tensors if t.kind.name == "F32")  # a norm: F32 whatever the quantize type
    with parts[-1].open("r+b") as f:
        f.seek(norm.offset + 4)
        f.write(struct.pack("<f", float("nan")))
    report = shardkit.verify(parts[0])
    assert len(report.findings) == 1 and report.findings[0].file == parts[-1].name
    assert report.findings[0].message.startswith("1 NaN/infinite value(s) once read as F32")
    result = run_cli("verify", parts[0])
    assert result.exit_code == 1 and f"FAIL {parts[-1].name}: tensor " in result.stdout


def test_parts_swapped_are_a_finding(parts: list[Path]) -> None:
    second, third = parts[1].read_bytes(), parts[2].read_bytes()
    parts[1].write_bytes(third)
    parts[2].write_bytes(second)
    report = shardkit.verify(parts[0])
    assert [(f.file, f.message) for f in report.findings] == [
        (parts[1].name, f"split.no/split.count say 2/{len(parts)}, not 1/{len(parts)}"),
        (parts[2].name, f"split.no/split.count say 1/{len(parts)}, not 2/{len(parts)}")]


def test_a_later_part_is_bad_input_naming_the_first(parts: list[Path], run_cli) -> None:
    line = assert_one_line_error(run_cli("verify", parts[1]), code=2, contains=f"give the first part, {parts[0].name}")
    assert line.startswith(f"error: {parts[1]}: part 2 of a {len(parts)}-part split GGUF")
    with pytest.raises(shardkit.InvalidInputError, match=parts[0].name):
        shardkit.verify(parts[1])


def test_a_whole_gguf_is_one_file(split_gguf: list[Path], tmp_path: Path) -> None:
    shardkit.convert(split_gguf[0], tmp_path / "one.gguf", to="gguf")  # the split merged back
    report = shardkit.verify(tmp_path / "one.gguf")
    assert report.ok and [f.name for f in report.files] == ["one.gguf"] and report.tensors_checked == 21
