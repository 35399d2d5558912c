"""``verify`` checks each manifest record against its file's own header before reading a byte (issue 27).

A shardkit.manifest.json is a record, not an authority: a record whose offsets, tensors or
data_start disagree with the shard's header is reported as not trustworthy, naming the tensor
(exit 1), and that file is checked by its header alone, never by offsets nothing vouches for.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers_verify import make_state_dict, read_raw_header
from safetensors.torch import save_file

from shardkit.checking.verify import verify
from shardkit.formats.manifest import MANIFEST_NAME

SHARD = 20_000
FIRST = "model-00001-of-00003.safetensors"


@pytest.fixture
def out(tmp_path: Path, run_cli) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    save_file(make_state_dict(), str(src / "model.safetensors"), metadata={"format": "pt"})
    (src / "config.json").write_text(json.dumps({"hidden_size": 40}))
    result = run_cli("split", src, tmp_path / "out", "--max-shard-size", str(SHARD), "-q")
    assert result.exit_code == 0, result.stderr
    assert min(p.name for p in (tmp_path / "out").glob("model-*.safetensors")) == FIRST
    return tmp_path / "out"


def edit_manifest(folder: Path, change: Callable[[dict[str, Any]], None]) -> None:
    path = folder / MANIFEST_NAME
    doc = json.loads(path.read_text())
    change(doc["files"])
    path.write_text(json.dumps(doc))


def first_tensors(folder: Path) -> list[str]:
    """The tensors of the first shard, in data order."""
    header, _ = read_raw_header(folder / FIRST)
    return sorted((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][0])


def _offsets(value: Callable[[list[int], int], list[int]]) -> Callable[[Path], tuple[Callable, str]]:
    """A case that rewrites the first tensor's data_offsets with ``value(offsets, data_start)``."""
    def case(folder: Path) -> tuple[Callable, str]:
        tensor = first_tensors(folder)[0]

        def change(files: dict[str, Any]) -> None:
            record = files[FIRST]
            spec = record["tensors"][tensor]
            spec["data_offsets"] = value(spec["data_offsets"], record["data_start"])
        return change, tensor
    return case


def _extra(folder: Path) -> tuple[Callable, str]:
    def change(files: dict[str, Any]) -> None:
        files[FIRST]["tensors"]["planted.weight"] = {"data_offsets": [0, 4], "crc32": "00000000"}
    return change, "planted.weight"


def _dropped(folder: Path) -> tuple[Callable, str]:
    tensor = first_tensors(folder)[-1]
    return (lambda files: files[FIRST]["tensors"].pop(tensor)), tensor


def _swapped(folder: Path) -> tuple[Callable, str]:
    a, b = first_tensors(folder)[:2]

    def change(files: dict[str, Any]) -> None:
        tensors = files[FIRST]["tensors"]
        tensors[a]["data_offsets"], tensors[b]["data_offsets"] = tensors[b]["data_offsets"], tensors[a]["data_offsets"]
    return change, a


def _data_start(folder: Path) -> tuple[Callable, None]:
    def change(files: dict[str, Any]) -> None:
        files[FIRST]["data_start"] -= 8
    return change, None


CASES = {
    "reaches-10**18": (_offsets(lambda o, start: [0, 10**18]), "past the end"),
    "negative-begin": (_offsets(lambda o, start: [-100, o[1]]), "not a byte range"),
    "reaches-into-the-header": (_offsets(lambda o, start: [o[0] - start, o[1]]), "not a byte range"),
    "end-before-begin": (_offsets(lambda o, start: [o[1], o[0]]), "not a byte range"),
    "shifted-inside-the-file": (_offsets(lambda o, start: [o[0] + 4, o[1] + 4]), "header says"),
    "swapped-with-another-tensor": (_swapped, "header says"),
    "tensor-the-header-lacks": (_extra, "does not have"),
    "tensor-the-manifest-lacks": (_dropped, "does not list it"),
    "data-start-moved": (_data_start, "data_start"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_record_disagreeing_with_the_header_is_an_untrustworthy_manifest(case: str, out: Path, run_cli) -> None:
    build, expect = CASES[case]
    change, tensor = build(out)
    edit_manifest(out, change)
    result = run_cli("verify", out)
    assert result.exit_code == 1, result.stdout
    fails = [line for line in result.stdout.splitlines() if line.startswith("FAIL")]
    where = f"FAIL {FIRST}: tensor {tensor!r}: " if tensor else f"FAIL {FIRST}: "
    assert len(fails) == 1 and fails[0].startswith(where + f"{MANIFEST_NAME} is not trustworthy"), fails
    assert expect in fails[0] and "Traceback" not in result.stderr
    assert "bit rot" not in result.stdout and "byte for byte" not in result.stdout  # intact bytes never blamed or blessed

    report = verify(out)  # the other files are still checked against the manifest; this one by its header only
    assert [(f.file, f.tensor) for f in report.findings] == [(FIRST, tensor)]
    assert report.structure_only == [FIRST]
    checked = {f.name for f in report.files if f.checked == "manifest"}
    assert "config.json" in checked and "model-00002-of-00003.safetensors" in checked


def test_the_manifests_offsets_are_never_used_to_read_a_file_it_disagrees_with(out: Path, monkeypatch) -> None:
    from shardkit.checking import verify as verify_module

    seen: dict[str, Any] = {}
    real = verify_module.scan_file

    def spy(path: str, entries: Any, **kwargs: Any) -> Any:
        seen[Path(path).name] = kwargs.get("crc_ranges")
        return real(path, entries, **kwargs)

    monkeypatch.setattr(verify_module, "scan_file", spy)
    edit_manifest(out, _offsets(lambda o, start: [-100, o[1]])(out)[0])
    verify(out)
    assert seen[FIRST] is None  # read by its header's offsets only
    assert seen["model-00002-of-00003.safetensors"] is not None  # a record that agrees is still used


def test_a_sha256_record_given_tensor_offsets_is_untrustworthy(out: Path, run_cli) -> None:
    def change(files: dict[str, Any]) -> None:
        files["config.json"].update(data_start=0, header_crc32="00000000",
                                    tensors={"w": {"data_offsets": [0, 10], "crc32": "00000000"}})

    edit_manifest(out, change)
    result = run_cli("verify", out)
    fails = [line for line in result.stdout.splitlines() if line.startswith("FAIL")]
    assert result.exit_code == 1 and len(fails) == 1, result.stdout
    assert fails[0].startswith(f"FAIL config.json: {MANIFEST_NAME} is not trustworthy") and "no safetensors header" in fails[0]


def test_an_edited_header_says_the_file_may_have_changed(tmp_path: Path, run_cli) -> None:
    """A tensor renamed in a single file (same length, so it still parses): the record disagrees with the
    header, and the header's crc32 says the file, not only the manifest, may be what changed."""
    src = tmp_path / "model.safetensors"
    save_file(make_state_dict(), str(src))
    assert run_cli("split", src, tmp_path / "out", "--max-shard-size", "10MB", "-q").exit_code == 0
    shard = tmp_path / "out" / "model.safetensors"
    shard.write_bytes(shard.read_bytes().replace(b'"step"', b'"stex"', 1))
    result = run_cli("verify", tmp_path / "out")
    fails = [line for line in result.stdout.splitlines() if line.startswith("FAIL")]
    assert result.exit_code == 1 and len(fails) == 1, result.stdout
    assert fails[0].startswith("FAIL model.safetensors: tensor ") and "not trustworthy" in fails[0]
    assert "may have been edited since" in fails[0]


def test_a_header_edit_the_structure_checks_report_gets_no_second_line(out: Path, run_cli) -> None:
    shard = out / FIRST
    tensor = first_tensors(out)[0]
    renamed = tensor[:-1] + ("X" if tensor[-1] != "X" else "Y")
    shard.write_bytes(shard.read_bytes().replace(json.dumps(tensor).encode(), json.dumps(renamed).encode(), 1))
    result = run_cli("verify", out)
    assert result.exit_code == 1 and "orphan tensor" in result.stdout
    assert "not trustworthy" not in result.stdout and "bit rot" not in result.stdout


def test_a_truncated_shard_with_an_honest_manifest_is_blamed_on_the_file(out: Path, run_cli) -> None:
    shard = out / FIRST
    shard.write_bytes(shard.read_bytes()[:-10])
    result = run_cli("verify", out)
    assert result.exit_code == 1
    assert "truncated" in result.stdout and "not trustworthy" not in result.stdout


def test_an_honest_manifest_still_matches_every_file(out: Path, run_cli) -> None:
    result = run_cli("verify", out)
    assert result.exit_code == 0, result.stdout
    assert f"file(s) match {MANIFEST_NAME} byte for byte" in result.stdout and "structure only" not in result.stdout
