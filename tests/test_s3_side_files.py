"""Side files (README, tokenizer, subfolders) travel with an ``s3://`` checkpoint byte for byte, like a local folder's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import make_state_dict


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A model folder with weights, a config, a README, a binary tokenizer and a pooling subfolder."""
    from safetensors.torch import save_file

    out = tmp_path / "src"
    out.mkdir()
    save_file(make_state_dict(["F32", "BF16"], shapes=[(300, 300)]), out / "model.safetensors")
    (out / "config.json").write_text('{"model_type": "bert"}\n')
    (out / "README.md").write_text("# a model card\n" * 50)
    (out / "tokenizer.model").write_bytes(os.urandom(70_000))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}\n')
    return out


def _side_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.endswith((".safetensors", ".index.json")) and p.name != "shardkit.manifest.json"}


COPIED, STREAMED = [], ["--dtype", "bf16"]  # S3 to S3: composed by copies in the store; cast: streamed


@pytest.mark.parametrize(("to_store", "extra"), [(False, []), (True, COPIED), (True, STREAMED)],
                         ids=["s3-to-local", "s3-to-s3-copied", "s3-to-s3-streamed"])
def test_split_from_s3_carries_every_side_file_byte_for_byte(s3_env, folder: Path, tmp_path: Path, run_cli,
                                                             to_store: bool, extra: list[str]) -> None:
    s3_env.put_folder(folder, "src")
    out = f"s3://{s3_env.bucket}/out" if to_store else str(tmp_path / "out")
    result = run_cli("split", f"s3://{s3_env.bucket}/src", out, "--max-shard-size", "200KB", *extra)
    assert result.exit_code == 0, result.stderr
    expected = _side_files(folder)
    if to_store:
        got = {k[len("out/"):]: s3_env.get(k) for k in s3_env.keys("out/")}
        got = {k: v for k, v in got.items() if k in expected}
    else:
        got = _side_files(tmp_path / "out")
    assert got == expected


@pytest.mark.parametrize("extra", [COPIED, STREAMED], ids=["copied", "streamed"])
def test_an_in_place_reshard_in_a_bucket_keeps_the_side_files_where_they_are(s3_env, folder: Path, run_cli,
                                                                             extra: list[str]) -> None:
    s3_env.put_folder(folder, "m")
    before = {k: s3_env.get(k) for k in s3_env.keys("m/") if not k.endswith((".safetensors", ".json"))}
    url = f"s3://{s3_env.bucket}/m"
    result = run_cli("split", url, url, "--max-shard-size", "200KB", "--overwrite", *extra)
    assert result.exit_code == 0, result.stderr
    keys = s3_env.keys("m/")
    assert "m/model.safetensors.index.json" in keys and "m/model.safetensors" not in keys
    assert {k: s3_env.get(k) for k in before} == before
    assert s3_env.uploads() == []
