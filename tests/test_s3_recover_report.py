"""``shardkit recover s3://...`` reports a store's leftovers without a byte count it does not have."""

from __future__ import annotations

import json

import pytest


def test_recover_of_a_bucket_prints_no_zero_byte_count(s3_env, run_cli) -> None:
    s3_env.put("ckpt/model-00001-of-00002.safetensors", b"x" * 1000)  # a shard no index names
    s3_env.put("ckpt/.shardkit-write-0123456789abcdef.json",
               json.dumps({"created": ["model-00001-of-00002.safetensors"], "stale": []}).encode())
    url = f"s3://{s3_env.bucket}/ckpt"
    result = run_cli("recover", url)
    assert result.exit_code == 0, result.stderr
    first = result.stdout.splitlines()[0]
    assert first == f"{url}: removed 2 leftover(s) of dead writers", result.stdout
    assert " B" not in result.stdout.replace(f"{url}/", "")  # no "0 B": a store reports no sizes
    assert f"  {url}/model-00001-of-00002.safetensors" in result.stdout
    assert s3_env.keys("ckpt/") == []


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b'{"created": "model.safetensors"}'],
                         ids=["not-json", "not-an-object", "names-not-a-list"])
def test_a_foreign_journal_is_refused_in_one_line_and_nothing_is_deleted(s3_env, run_cli, body: bytes) -> None:
    from conftest import assert_one_line_error

    s3_env.put("m/model.safetensors", b"weights")
    s3_env.put("m/.shardkit-write-0123456789abcdef.json", body)
    line = assert_one_line_error(run_cli("recover", f"s3://{s3_env.bucket}/m"), code=2)
    assert "not a shardkit write journal" in line and "delete it by hand" in line
    assert s3_env.get("m/model.safetensors") == b"weights"
