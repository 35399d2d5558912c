"""Opening an ``s3://`` store is cheap: one client per store from a session shared per AWS configuration,
no probe client, no HEAD before a listing; a changed configuration is never served from the old session.

Against a real SeaweedFS (the ``s3_env`` fixture); requests counted at the delay proxy.
"""

from __future__ import annotations

import boto3
import botocore.session
import pytest
from conftest import make_state_dict
from helpers_s3 import DelayProxy

import shardkit
from shardkit.errors import ShardkitError
from shardkit.stores import list_folder, open_store, s3_client


@pytest.fixture
def sessions_made(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every botocore session shardkit creates from now on (the cache emptied first)."""
    made: list[object] = []
    real = botocore.session.Session

    def counting(*args: object, **kwargs: object) -> object:
        session = real(*args, **kwargs)
        made.append(session)
        return session

    monkeypatch.setattr(s3_client, "_sessions", type(s3_client._sessions)())
    monkeypatch.setattr(botocore.session, "Session", counting)
    return made


def test_stores_on_one_configuration_share_one_session_and_each_has_its_own_client(s3_env, sessions_made) -> None:
    default_before = boto3.DEFAULT_SESSION
    url = f"s3://{s3_env.bucket}/p"
    with open_store(url) as first, open_store(url) as second:
        assert first.client is not second.client, "one client per store, closed with it"
        assert first.client.meta.config.s3 == {"addressing_style": "path"}, "a local endpoint is path-style"
        assert first.list_objects() == second.list_objects() == []
    with open_store(url):
        pass
    assert len(sessions_made) == 1, "one botocore session (one load of the service model) for three opens"
    assert boto3.DEFAULT_SESSION is default_before, "boto3's default session, which other libraries use, is untouched"


def test_changed_credentials_get_a_new_session_and_are_checked(s3_env, sessions_made, monkeypatch) -> None:
    url = f"s3://{s3_env.bucket}/p"
    with open_store(url):
        pass
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(ShardkitError, match="credentials") as failure:
        open_store(url)
    assert "not-the-secret" not in str(failure.value)
    assert len(sessions_made) == 2, "the first session's cached credentials are not reused"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_env.env["AWS_SECRET_ACCESS_KEY"])
    with open_store(url):
        pass
    assert len(sessions_made) == 2, "the first configuration's session again"


def test_sessions_kept_are_bounded(s3_env, sessions_made, monkeypatch) -> None:
    for i in range(s3_client.MAX_SESSIONS + 3):
        monkeypatch.setenv("AWS_SHARDKIT_TEST_MARKER", str(i))  # another configuration each time
        with open_store(f"s3://{s3_env.bucket}/p"):
            pass
    assert len(sessions_made) == s3_client.MAX_SESSIONS + 3
    assert len(s3_client._sessions) == s3_client.MAX_SESSIONS


def test_an_aws_endpoint_keeps_virtual_addressing(monkeypatch, tmp_path) -> None:
    for key in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a")  # nothing is sent: only the client is made
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "b")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    client = s3_client.make_client(4)
    try:
        assert "amazonaws.com" in client.meta.endpoint_url
        assert client.meta.config.s3 is None or client.meta.config.s3.get("addressing_style") != "path"
    finally:
        client.close()


def test_open_reads_no_more_than_list_index_and_headers(s3_env, tmp_path, monkeypatch) -> None:
    from safetensors.torch import save_file

    src = tmp_path / "one.safetensors"
    state = make_state_dict(["F16"], shapes=[(300, 400)] * 6)
    save_file(state, src)
    shardkit.split(src, tmp_path / "ckpt", max_shard_size="500KB")
    s3_env.put_folder(tmp_path / "ckpt", "ckpt")
    shards = sorted(p.name for p in (tmp_path / "ckpt").glob("*.safetensors"))
    whole = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if not p.name.endswith(".safetensors"))
    assert len(shards) >= 3 and whole
    with DelayProxy(s3_env.server.port, delay_ms=0) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
        with shardkit.open(f"s3://{s3_env.bucket}/ckpt") as ckpt:
            opened = dict(proxy.requests)
            loaded = ckpt.to_state_dict()
    assert opened == {"GET": 1 + len(whole) + len(shards)}, (
        "one listing, each index/config/manifest, one header range per shard; no HEAD of the bucket")
    assert {k: v.numpy().tobytes() for k, v in loaded.items()} == {k: v.numpy().tobytes() for k, v in state.items()}


def test_a_missing_bucket_still_fails_in_one_line_naming_it(s3_env) -> None:
    with pytest.raises(ShardkitError, match=r"s3://no-such-bucket-x1: no such bucket"):
        shardkit.open("s3://no-such-bucket-x1/ckpt")
    with open_store("s3://no-such-bucket-x1/p", check_bucket=False) as store, \
            pytest.raises(ShardkitError, match="no such bucket"):
        list_folder(store)
