"""``shardkit info`` / ``verify`` of ``s3://`` checkpoints: headers only, by ranged reads, counted at the proxy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import assert_one_line_error
from helpers_s3 import SECRET_KEY, DelayProxy, sharded_checkpoint


def _without_paths(value: object) -> object:
    """An info report less what differs by place: the path, and shared bytes (None for remote files)."""
    if isinstance(value, dict):
        return {k: _without_paths(v) for k, v in value.items() if k not in ("path", "shared_bytes")}
    if isinstance(value, list):
        return [_without_paths(v) for v in value]
    return value


@pytest.fixture
def sharded(tmp_path, run_cli) -> Path:
    """A 3-shard checkpoint of ~12 MB (random bytes) with an index and a manifest."""
    return sharded_checkpoint(tmp_path, run_cli)


def test_info_and_verify_read_headers_only(s3_env, sharded, run_cli, monkeypatch) -> None:
    total = s3_env.put_folder(sharded, "run/ckpt")
    assert total > 10_000_000
    local = json.loads(run_cli("info", sharded, "--json").stdout)
    with DelayProxy(s3_env.server.port, delay_ms=0) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
        result = run_cli("info", f"s3://{s3_env.bucket}/run/ckpt", "--json")
        assert result.exit_code == 0, result.stderr
        info_bytes, proxy.sent_bytes = proxy.sent_bytes, 0
        verified = run_cli("verify", f"s3://{s3_env.bucket}/run/ckpt")
        verify_bytes = proxy.sent_bytes
    remote = json.loads(result.stdout)
    assert remote["path"] == f"s3://{s3_env.bucket}/run/ckpt"
    assert _without_paths(remote) == _without_paths(local), "the same answer as a local info, from headers only"
    assert remote["tensor_count"] == 6 and len(remote["shards"]) == 3
    assert verified.exit_code == 0, verified.stdout + verified.stderr
    assert info_bytes < 2_000_000 and verify_bytes < 2_000_000, (info_bytes, verify_bytes)
    assert info_bytes < total / 20
    print(f"info moved {info_bytes} bytes, verify {verify_bytes}, of a {total}-byte checkpoint")


def test_verify_finds_a_truncated_shard(s3_env, sharded, run_cli) -> None:
    s3_env.put_folder(sharded, "ckpt")
    shard = sorted(p.name for p in sharded.glob("*.safetensors"))[1]
    data = (sharded / shard).read_bytes()
    s3_env.put(f"ckpt/{shard}", data[:-100])
    result = run_cli("verify", f"s3://{s3_env.bucket}/ckpt")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert shard in result.stdout + result.stderr


def test_missing_prefix_bucket_and_wrong_secret_exit_2(s3_env, sharded, run_cli, monkeypatch) -> None:
    s3_env.put_folder(sharded, "ckpt")
    line = assert_one_line_error(run_cli("info", f"s3://{s3_env.bucket}/nothing-here"), contains="no objects")
    assert f"s3://{s3_env.bucket}/nothing-here" in line
    assert_one_line_error(run_cli("info", "s3://no-such-bucket-x/ckpt"), contains="no such bucket")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "a-wrong-secret")
    result = run_cli("verify", f"s3://{s3_env.bucket}/ckpt")
    line = assert_one_line_error(result, contains=s3_env.bucket)
    assert "a-wrong-secret" not in result.stdout + result.stderr and SECRET_KEY not in line


@pytest.mark.parametrize("name", ["../escape.json", "a/../../escape.json", "/abs.json", "a//b.json", "a\\b.json"])
def test_a_hostile_listing_never_writes_outside_the_mirror(s3_env, tmp_path, name) -> None:
    """S3 keys may hold '..' parts (SeaweedFS refuses them, AWS does not): a listing is checked before use."""
    from shardkit.errors import StoreError
    from shardkit.stores import ObjectInfo, open_store
    from shardkit.stores.mirror import build_header_mirror

    root = tmp_path / "mirror" / "root"
    root.mkdir(parents=True)
    with open_store(f"s3://{s3_env.bucket}") as store, pytest.raises(StoreError, match="not a plain relative path"):
        build_header_mirror(store, str(root), [ObjectInfo("config.json", 2), ObjectInfo(name, 2)],
                            whole=lambda n: True)
    assert list((tmp_path / "mirror").rglob("*")) == [root], "nothing fetched or written"
