"""Jobs streamed into ``s3://`` (``shardkit.sharding.store_output``): no local copy, the bytes of a local run.

Against a real SeaweedFS (the ``s3_env`` fixture); nothing is mocked.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from conftest import tiny_bert_config
from helpers_s3 import paused_cli

import shardkit
from shardkit.formats.header import read_header

MANIFEST = "shardkit.manifest.json"
INDEX = "model.safetensors.index.json"


@pytest.fixture
def model_folder(tmp_path) -> Path:
    """A real tiny BERT (transformers' save_pretrained) with side files of every kind beside it."""
    from transformers import BertModel

    folder = tmp_path / "bert"
    BertModel(tiny_bert_config()).save_pretrained(folder)
    (folder / "README.md").write_text("# tiny bert\n")
    (folder / "vocab.txt").write_text("\n".join(f"tok{i}" for i in range(64)) + "\n")
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}\n')
    return folder


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _remote(s3_env, prefix: str) -> dict[str, bytes]:
    return {k[len(prefix) + 1:]: s3_env.get(k) for k in s3_env.keys(prefix + "/")}


def test_a_real_model_streams_into_s3_byte_for_byte_with_no_local_copy(s3_env, model_folder, tmp_path,
                                                                       monkeypatch) -> None:
    local = tmp_path / "local"
    shardkit.split(model_folder, local, max_shard_size="6KB")
    expected = _files(local)
    assert len([n for n in expected if n.endswith(".safetensors")]) >= 3 and MANIFEST in expected
    assert {"README.md", "vocab.txt", "1_Pooling/config.json", "config.json", INDEX} <= set(expected)
    staging = tmp_path / "tmp"
    staging.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(staging))
    staged: list[str] = []
    seen: list[tuple[int, int]] = []

    def progress(done: int, total: int) -> None:
        seen.append((done, total))
        staged.extend(str(p) for p in staging.rglob("*") if p.is_file())

    url = f"s3://{s3_env.bucket}/bert"
    result = shardkit.split(model_folder, url, max_shard_size="6KB", progress=progress)
    assert result.output == url
    assert staged == [], "no shard or side file is written to a local staging folder"
    assert _remote(s3_env, "bert") == expected, "every object equals the local file, the manifest included"
    assert s3_env.uploads() == []
    first = read_header(str(local / "model-00001-of-00005.safetensors")).entries[0]
    total = seen[-1][1]
    assert seen[0][0] == first.nbytes and seen[-1] == (total, total), "one bar over the bytes written, not two halves"
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_an_output_naming_one_file_is_staged_and_equal(s3_env, model_folder, tmp_path, run_cli) -> None:
    local = tmp_path / "one.safetensors"
    assert run_cli("split", model_folder / "model.safetensors", local).exit_code == 0
    result = run_cli("split", model_folder / "model.safetensors", f"s3://{s3_env.bucket}/one/one.safetensors")
    assert result.exit_code == 0, result.stderr
    assert s3_env.keys("one/") == ["one/one.safetensors"]
    assert s3_env.get("one/one.safetensors") == local.read_bytes()


def _killed_at(s3_env, point: str, args: list[str], wait: Path) -> None:
    """Run the CLI with ``args``, paused at the fault ``point``, then SIGKILL it there."""
    proc = paused_cli(s3_env, point, args, wait)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)


@pytest.mark.parametrize("in_place", [False, True])
def test_a_kill_between_manifest_and_index_then_recover_leaves_no_wrong_manifest(s3_env, model_folder, tmp_path,
                                                                                run_cli, in_place) -> None:
    url = f"s3://{s3_env.bucket}/m"
    old: dict[str, bytes] = {}
    if in_place:
        assert run_cli("split", model_folder, url, "--max-shard-size", "6KB").exit_code == 0
        old = _remote(s3_env, "m")
    args = ["split", str(model_folder / "model.safetensors"), url, "--max-shard-size", "16KB", "--overwrite"]
    _killed_at(s3_env, f"store:put:{MANIFEST}", args, tmp_path / "go")
    now = _remote(s3_env, "m")
    assert now.get(INDEX) == old.get(INDEX), "the index is put last: not reached"
    assert now[MANIFEST] != old.get(MANIFEST), "the new manifest is in"
    result = run_cli("recover", url)
    assert result.exit_code == 0, result.stderr
    assert _remote(s3_env, "m") == {k: v for k, v in old.items() if k != MANIFEST}, \
        "the old checkpoint whole, without the manifest that named the killed write's shards"
    assert s3_env.uploads() == []
    if in_place:
        assert run_cli("verify", url).exit_code == 0


def test_a_kill_before_the_publish_keeps_the_old_manifest(s3_env, model_folder, tmp_path, run_cli) -> None:
    url = f"s3://{s3_env.bucket}/k"
    assert run_cli("split", model_folder, url, "--max-shard-size", "6KB").exit_code == 0
    old = _remote(s3_env, "k")
    args = ["split", str(model_folder / "model.safetensors"), url, "--max-shard-size", "16KB", "--overwrite"]
    _killed_at(s3_env, "store:sent:model-00001-of-", args, tmp_path / "go")
    assert run_cli("recover", url).exit_code == 0
    assert _remote(s3_env, "k") == old, "a kill mid-shard: recover leaves the old checkpoint as it was, manifest too"
    assert run_cli("verify", url).exit_code == 0


def test_a_pipeline_folder_streams_into_s3_byte_for_byte(s3_env, tmp_path, monkeypatch) -> None:
    from helpers_pipeline import build_tiny_sd_pipeline

    folder = tmp_path / "sd"
    build_tiny_sd_pipeline(tmp_path).save_pretrained(folder)
    local = tmp_path / "local"
    shardkit.split(folder, local, max_shard_size="200KB")
    expected = _files(local)
    assert any(n.startswith("unet/") and n.endswith(".index.json") for n in expected) and MANIFEST in expected
    staging = tmp_path / "tmp"
    staging.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(staging))
    staged: list[str] = []
    url = f"s3://{s3_env.bucket}/sd"
    shardkit.split(folder, url, max_shard_size="200KB",
                   progress=lambda done, total: staged.extend(str(p) for p in staging.rglob("*") if p.is_file()))
    assert staged == [], "every component streamed: nothing staged"
    assert _remote(s3_env, "sd") == expected
    assert s3_env.uploads() == []
