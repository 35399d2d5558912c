"""``shardkit info`` and ``shardkit verify`` through the real command line."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from conftest import assert_one_line_error, shardkit_subprocess
from helpers_verify import build_pipeline, flip_byte, index_of, make_state_dict, shard_of, tensor_offset, write_index
from safetensors.torch import save_file


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "src.safetensors"
    save_file(make_state_dict(), str(path))
    return path


@pytest.fixture
def out(tmp_path, source, run_cli):
    folder = tmp_path / "out"
    result = run_cli("split", source, folder, "--max-shard-size", "20KB", "--quiet")
    assert result.exit_code == 0, result.stderr
    return folder


def fail_lines(result) -> list[str]:
    return [line for line in result.stdout.splitlines() if line.startswith("FAIL ")]


def assert_failed(result, *expected: str) -> list[str]:
    """Exit 1, a one-line summary on stderr, and each expected text in some FAIL line."""
    assert_one_line_error(result, code=1, contains="verify found")
    lines = fail_lines(result)
    for text in expected:
        assert any(text in line for line in lines), (text, lines)
    return lines


def test_clean_folder_exits_0_and_prints_sha256_per_file(out, run_cli):
    result = run_cli("verify", out, "--quiet")
    assert result.exit_code == 0 and result.stdout == "", result
    result = run_cli("verify", out)
    assert result.exit_code == 0, result.stderr
    for path in out.iterdir():
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        assert any(path.name in line and f"sha256 {digest}" in line for line in result.stdout.splitlines())
    assert result.stdout.splitlines()[-1].startswith("ok: ")


def test_flipped_byte_detected_against_source(out, source, run_cli):
    shard = shard_of(out, "blocks.4.weight")
    flip_byte(shard, tensor_offset(shard, "blocks.4.weight") + 17)
    # the manifest written with the split names the file and the tensor (test_manifest.py has more)
    assert_failed(run_cli("verify", out), f"FAIL {shard.name}: tensor 'blocks.4.weight': data changed since shardkit wrote it")
    result = run_cli("verify", out, "--against", source)
    lines = assert_failed(result, f"FAIL {shard.name}: tensor 'blocks.4.weight': data differs from the source: "
                                  "first at byte 17 of the tensor (element 4)")
    assert len(lines) == 1


def test_truncated_shard(out, run_cli):
    shard = shard_of(out, "blocks.1.weight")
    os.truncate(shard, shard.stat().st_size - 7)
    lines = assert_failed(run_cli("verify", out), f"FAIL {shard.name}: truncated: the file has", "(7 bytes missing)",
                          "tensor(s) lie past the end: ")
    assert len(lines) == 1, lines  # one cause, one line


def test_edited_index_tensor_in_wrong_shard(out, run_cli):
    doc = index_of(out)
    right = doc["weight_map"]["norm.weight"]
    wrong = next(s for s in sorted(set(doc["weight_map"].values())) if s != right)
    doc["weight_map"]["norm.weight"] = wrong
    write_index(out, doc)
    assert_failed(run_cli("verify", out), f"FAIL model.safetensors.index.json: tensor 'norm.weight': the index "
                                          f"places it in {wrong} but it is stored in {right}")


def test_edited_index_total_size(out, run_cli):
    doc = index_of(out)
    doc["metadata"]["total_size"] -= 4
    write_index(out, doc)
    assert_failed(run_cli("verify", out), "FAIL model.safetensors.index.json: metadata.total_size is")


def test_missing_shard(out, run_cli):
    shard = shard_of(out, "blocks.5.weight")
    shard.unlink()
    assert_failed(run_cli("verify", out), f"FAIL {shard.name}: missing: the index places")


def test_against_after_bf16_split(tmp_path, source, run_cli):
    folder = tmp_path / "bf16"
    assert run_cli("split", source, folder, "--max-shard-size", "10KB", "--dtype", "bf16", "-q").exit_code == 0
    result = run_cli("verify", folder, "--against", source)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert f"{len(make_state_dict())} tensor(s) identical to" in result.stdout
    # a modified tensor, rewritten as a valid shard: only the comparison can tell
    shard = shard_of(folder, "blocks.2.weight")
    from safetensors.torch import load_file

    tensors = load_file(str(shard))
    tensors["blocks.2.weight"][0, 1] += 1
    save_file(tensors, str(shard), metadata={"format": "pt"})
    assert run_cli("verify", folder).exit_code == 1  # the manifest sees the rewrite; --against says how
    assert_failed(run_cli("verify", folder, "--against", source),
                  f"FAIL {shard.name}: tensor 'blocks.2.weight': data differs from the source cast from F32 to BF16: "
                  "first at byte 2 of the tensor (element 1)")


def test_json_report(out, source, run_cli):
    result = run_cli("verify", out, "--against", source, "--json")
    report = json.loads(result.stdout)
    assert result.exit_code == 0 and report["ok"] is True
    assert report["tensors_compared"] == len(make_state_dict())
    shard_of(out, "step").unlink()
    result = run_cli("verify", out, "--json")
    report = json.loads(result.stdout)
    assert result.exit_code == 1 and report["ok"] is False
    assert report["findings"][0]["file"] == shard_of(out, "step").name


def test_bad_input_exits_2(tmp_path, out, run_cli):
    assert_one_line_error(run_cli("verify", tmp_path / "nope"), code=2, contains="no such file")
    torch.save({"a": torch.zeros(2)}, tmp_path / "w.bin")
    assert_one_line_error(run_cli("verify", tmp_path / "w.bin"), code=2, contains="not a safetensors checkpoint")
    assert_one_line_error(run_cli("verify", out, "--against", tmp_path / "nope.safetensors"), code=2)
    assert_one_line_error(run_cli("info", tmp_path / "nope"), code=2, contains="no such file")


def test_info_tables_and_json(out, run_cli):
    result = run_cli("info", out)
    assert result.exit_code == 0, result.stderr
    text = result.stdout
    shards = sorted(set(index_of(out)["weight_map"].values()))
    assert f"safetensors-sharded, {len(shards)} shards" in text
    for name in shards:
        assert name in text
    assert "largest tensors" in text and "blocks.0.weight" in text
    params = sum(t.numel() for t in make_state_dict().values())
    assert f"{params:,}" in text
    data = json.loads(run_cli("info", out, "--json").stdout)
    assert data["parameter_count"] == params
    assert data["index_metadata"]["total_size"] == data["total_bytes"]
    assert [s["file"] for s in data["shards"]] == shards


def test_pipeline_info_and_verify(tmp_path, run_cli):
    pipe = build_pipeline(tmp_path / "pipe")
    result = run_cli("info", pipe)
    assert result.exit_code == 0, result.stderr
    assert "[unet]" in result.stdout and "[text_encoder]" in result.stdout and "totals" in result.stdout
    data = json.loads(run_cli("info", pipe, "--json").stdout)
    assert data["tensor_count"] == sum(c["tensor_count"] for c in data["components"].values())
    result = run_cli("verify", pipe)
    assert result.exit_code == 0, result.stderr
    assert "unet/diffusion_pytorch_model.safetensors.index.json" in result.stdout
    flip_byte(pipe / "text_encoder" / "model.safetensors", 3)  # inside the header length
    assert_failed(run_cli("verify", pipe), "FAIL text_encoder/model.safetensors: header length")


def test_real_process(out, source):
    result = shardkit_subprocess("verify", out, "--against", source)
    assert result.returncode == 0, result.stderr
    assert "identical to" in result.stdout


@pytest.mark.parametrize("command", ["info", "split"])
def test_shards_without_an_index_are_named_as_such(out, run_cli, command, tmp_path):
    (out / "model.safetensors.index.json").unlink()
    args = [command, out] + ([tmp_path / "resplit"] if command == "split" else [])
    line = assert_one_line_error(run_cli(*args), code=2, contains="shard file(s)")
    assert "no index file (model.safetensors.index.json)" in line
    assert "no .safetensors checkpoint" not in line


# ------------------------------------------------------------------ one flag vocabulary (issue 14, item 16)

def test_every_command_has_json_and_quiet(run_cli) -> None:
    from shardkit.cli import cli

    for name, command in cli.commands.items():
        flags = {opt for p in command.params for opt in p.opts}
        assert "--json" in flags, f"shardkit {name} has no --json"
        assert "--quiet" in flags and "-q" in flags, f"shardkit {name} has no -q/--quiet"


def test_info_quiet_is_one_line(run_cli, tmp_path) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(2)}, str(tmp_path / "m.safetensors"))
    result = run_cli("info", tmp_path / "m.safetensors", "-q")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.count("\n") == 1 and "2 tensors, 14 parameters, 56 B" in result.stdout


def test_merge_dry_run_checks_and_writes_nothing(run_cli, tmp_path) -> None:
    import torch
    from safetensors.torch import save_file

    import shardkit

    save_file({"a": torch.zeros(30), "b": torch.zeros(30)}, str(tmp_path / "m.safetensors"))
    shardkit.split(tmp_path / "m.safetensors", tmp_path / "sh", max_shard_size="150B")
    result = run_cli("merge", tmp_path / "sh", tmp_path / "merged.safetensors", "--dry-run")
    assert result.exit_code == 0, result.stderr
    assert "would merge 2 shard(s), 2 tensors" in result.stdout
    assert not (tmp_path / "merged.safetensors").exists()
    as_json = run_cli("merge", tmp_path / "sh", tmp_path / "m.safetensors", "--dry-run", "--json")
    assert '"dry_run": true' in as_json.stdout and "the real run needs --overwrite" in as_json.stderr


def test_exclude_help_says_what_it_matches(run_cli) -> None:
    assert "whose name (as stored in SOURCE)" in " ".join(run_cli("convert", "--help").stdout.split())
    assert "whose path inside the folder" in " ".join(run_cli("push", "--help").stdout.split())


def test_verify_help_says_what_the_manifest_holds(out, run_cli):
    """The help's account of shardkit.manifest.json is the manifest's: crc32s for shards, sha256 for other files."""
    manifest = json.loads((out / "shardkit.manifest.json").read_text())
    shards = {name: rec for name, rec in manifest["files"].items() if name.endswith(".safetensors")}
    others = {name: rec for name, rec in manifest["files"].items() if not name.endswith(".safetensors")}
    assert shards and all("header_crc32" in r and "sha256" not in r and all("crc32" in t for t in r["tensors"].values())
                          for r in shards.values())
    assert others and all("sha256" in r for r in others.values())
    help_text = " ".join(run_cli("verify", "--help").stdout.split())
    assert "for a .safetensors file a crc32 of its header and of every tensor; for every other file its sha256" \
        in help_text
    assert "sha256 per file" not in help_text
