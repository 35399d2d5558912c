"""A ``scheme://`` path is never taken for a local folder: unknown schemes and unwired ones exit 2 in one line."""

from __future__ import annotations

import pytest
from conftest import assert_one_line_error


def _without_aws(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """No AWS credentials, whatever this machine has (and no metadata-service lookups)."""
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path.parent / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path.parent / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.mark.parametrize("output", ["s3://models/up", "gs://models/up", "ftp://host/x", "hf://org/repo"])
@pytest.mark.parametrize("command", ["split", "convert"])
def test_a_url_output_is_refused_not_written_as_a_local_folder(run_cli, safetensors_file, tmp_path, monkeypatch,
                                                                command, output) -> None:
    monkeypatch.chdir(tmp_path)
    _without_aws(monkeypatch, tmp_path)  # s3:// outputs are wired: with no credentials the store refuses in one line
    before = sorted(p.name for p in tmp_path.iterdir())
    line = assert_one_line_error(run_cli(command, safetensors_file, output), contains=output.rsplit("/", 1)[0])
    assert ("unknown scheme" in line) != output.startswith(("s3://", "hf://"))
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "no ./s3:/... folder"


@pytest.mark.parametrize("args", [["info", "gs://bucket/x"], ["verify", "az://container/x"], ["info", "file:///x"]])
def test_unknown_scheme_sources_name_the_scheme(run_cli, args) -> None:
    assert_one_line_error(run_cli(*args), contains="unknown scheme")


def test_the_library_refuses_too(safetensors_file, tmp_path, monkeypatch) -> None:
    import shardkit
    from shardkit.errors import InvalidInputError, ShardkitError

    monkeypatch.chdir(tmp_path)
    _without_aws(monkeypatch, tmp_path)
    with pytest.raises(InvalidInputError, match="unknown scheme gs://"):
        shardkit.split(safetensors_file, "gs://bucket/out")
    with pytest.raises(ShardkitError, match="s3://bucket"):  # a wired source: the store refuses (no credentials)
        shardkit.split("s3://bucket/in", "out")
    assert not (tmp_path / "gs:").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize(("path", "hint"), [("gs://bucket/x", "AWS_ENDPOINT_URL=https://storage.googleapis.com"),
                                            ("az://container/x", "blobfuse2"),
                                            ("ftp://host/x", "use a local path, hf://ORG/REPO or s3://BUCKET/PREFIX")])
def test_unread_schemes_say_where_the_bytes_can_be_reached(run_cli, path: str, hint: str) -> None:
    assert_one_line_error(run_cli("info", path), contains=hint)
