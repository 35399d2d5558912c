"""``shardkit recover s3://...`` reports a store's leftovers without a byte count it does not have."""

from __future__ import annotations

import json


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
