"""``merge`` with ``s3://`` on either side: the same bytes as a local merge, tensor bytes read by range."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import make_state_dict


@pytest.fixture
def sharded(tmp_path: Path, run_cli) -> Path:
    """A 3-shard checkpoint with an index and a manifest, and its local merge beside it."""
    from safetensors.torch import save_file

    save_file(make_state_dict(["F32", "BF16", "I64"], shapes=[(400, 400), (7, 3)]), tmp_path / "one.safetensors")
    out = tmp_path / "ckpt"
    assert run_cli("split", tmp_path / "one.safetensors", out, "--max-shard-size", "300KB").exit_code == 0
    assert run_cli("merge", out, tmp_path / "local.safetensors").exit_code == 0
    return out


def test_merge_from_a_bucket_equals_the_local_merge(s3_env, sharded: Path, tmp_path: Path, run_cli) -> None:
    s3_env.put_folder(sharded, "ckpt")
    result = run_cli("merge", f"s3://{s3_env.bucket}/ckpt", tmp_path / "merged.safetensors")
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "merged.safetensors").read_bytes() == (tmp_path / "local.safetensors").read_bytes()


def test_merge_into_a_bucket_publishes_one_object(s3_env, sharded: Path, tmp_path: Path, run_cli) -> None:
    import shardkit

    result = shardkit.merge(sharded, f"s3://{s3_env.bucket}/merged/model.safetensors")
    assert result.output == f"s3://{s3_env.bucket}/merged/model.safetensors"
    assert s3_env.keys("merged/") == ["merged/model.safetensors"]
    assert s3_env.get("merged/model.safetensors") == (tmp_path / "local.safetensors").read_bytes()
    assert s3_env.uploads() == []


def test_merge_into_a_bucket_that_holds_the_file_needs_overwrite(s3_env, sharded: Path, run_cli) -> None:
    from conftest import assert_one_line_error

    s3_env.put("m/model.safetensors", b"old")
    line = assert_one_line_error(run_cli("merge", sharded, f"s3://{s3_env.bucket}/m/model.safetensors"), code=2)
    assert "--overwrite" in line
    assert s3_env.get("m/model.safetensors") == b"old"
