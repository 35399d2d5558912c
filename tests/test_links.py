"""The one symlink rule (shardkit/formats/links.py) that ``shardkit.open``, ``split`` and ``push`` share.

A link is followed inside the folder or into a Hugging Face cache's ``blobs/``: the snapshot's
own repo, or any cache repo (``models--org--name/blobs/``), which ``hf download --local-dir`` and
user scripts link to from folders outside the cache. A folder that is merely called ``blobs`` is
not a cache.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import helpers_reliability as h
import pytest
from conftest import assert_one_line_error, invoke_cli

import shardkit
from shardkit.errors import CheckpointIndexError


def _local_dir_with_a_link_to(blob: Path, folder: Path) -> Path:
    """A sharded folder whose first shard is a symlink to ``blob`` (holding that shard's bytes)."""
    h.write_checkpoint(folder, h.make_tensors(8, total_bytes=4000), shard_bytes=2000)
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    blob.parent.mkdir(parents=True, exist_ok=True)
    shard.rename(blob)
    shard.symlink_to(blob)
    return folder


def test_a_link_from_a_local_dir_into_any_hf_cache_blob_is_followed(tmp_path: Path) -> None:
    data = b"placeholder"
    blob = tmp_path / "cache" / "hub" / "models--org--tiny" / "blobs" / hashlib.sha256(data).hexdigest()
    folder = _local_dir_with_a_link_to(blob, tmp_path / "local-dir")
    with shardkit.open(str(folder)) as checkpoint:
        assert len(list(checkpoint.keys())) == 8
    result = invoke_cli("split", folder, tmp_path / "out", "-q")
    assert result.exit_code == 0, result.stderr


@pytest.mark.parametrize("where", ["blobs", "not-a-cache/blobs", "models--org--tiny/other"])
def test_a_look_alike_blobs_folder_is_outside(where: str, tmp_path: Path) -> None:
    folder = _local_dir_with_a_link_to(tmp_path / "elsewhere" / where / "shard", tmp_path / "ckpt")
    with pytest.raises(CheckpointIndexError, match="outside the checkpoint folder"):
        shardkit.open(str(folder))
    assert_one_line_error(invoke_cli("split", folder, tmp_path / "out", "-q"), code=2,
                          contains="Hugging Face cache's blobs/")
    assert not (tmp_path / "out").exists()


def test_verify_reports_a_shard_linked_outside_and_reads_nothing_behind_it(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere" / "shard"
    folder = _local_dir_with_a_link_to(target, tmp_path / "ckpt")
    result = invoke_cli("verify", folder)
    assert result.exit_code == 1, (result.stdout, result.stderr)
    assert "symlink leading outside the checkpoint folder (to " in result.stdout + result.stderr
    inside = _local_dir_with_a_link_to(tmp_path / "ok" / "blobs-inside" / "shard", tmp_path / "ok")
    assert invoke_cli("verify", inside).exit_code == 0


# ----------------------------------------------------------------------------- write_fd: the one checked write loop


@pytest.mark.parametrize("offset", [None, 3])
def test_write_fd_continues_short_writes_and_refuses_one_that_writes_nothing(tmp_path: Path, offset: int | None,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Short writes are continued (the bytes exact, each call's count reported); a call that writes nothing is
    ``OSError(EIO)`` naming the file and how far it got, never a loop that spins."""
    import errno
    import os

    from shardkit.formats.links import write_fd

    data = bytes(range(256)) * 40
    path = tmp_path / "f"
    real_write, real_pwrite = os.write, os.pwrite
    monkeypatch.setattr(os, "write", lambda fd, b: real_write(fd, bytes(b)[:4093]))
    monkeypatch.setattr(os, "pwrite", lambda fd, b, at: real_pwrite(fd, bytes(b)[:4093], at))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        counts: list[int] = []
        write_fd(fd, data, path=str(path), offset=offset, wrote=counts.append)
        assert counts == [4093, 4093, len(data) - 2 * 4093]
        calls = [0]

        def nothing(*_: object) -> int:
            calls[0] += 1
            assert calls[0] < 100, "a write loop kept calling after a write that wrote nothing"
            return 0

        monkeypatch.setattr(os, "write", nothing)
        monkeypatch.setattr(os, "pwrite", nothing)
        with pytest.raises(OSError) as e:
            write_fd(fd, memoryview(data)[:10], path=str(path), offset=offset)
    finally:
        os.close(fd)
    assert (e.value.errno, e.value.filename, calls[0]) == (errno.EIO, str(path), 1)
    assert e.value.strerror == "took 0 of 10 bytes" + ("" if offset is None else " at offset 3")
    assert path.read_bytes() == b"\0" * (offset or 0) + data
