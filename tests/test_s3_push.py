"""``shardkit push s3://BUCKET/PREFIX org/model`` and ``split ... s3://... --push-to``: a bucket to the Hub.

Against a real SeaweedFS (``s3_env``) and the offline Hub (``tests/hub_server.py``); every push runs
the real CLI or Python API in a subprocess (huggingface_hub reads its endpoint at import), with the
standard AWS_* variables naming the S3 server and HF_* naming the Hub.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from helpers_hub import download, hub_env, index_problems, run_python, run_shardkit

import shardkit

pytestmark = pytest.mark.hub

REPO = "alice/from-bucket"


def _checkpoint(tmp_path: Path) -> tuple[Path, Path]:
    """``(source file, folder)``: 8 float32 tensors split into 4 shards with an index and a manifest."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(3)
    source = tmp_path / "src" / "model.safetensors"
    source.parent.mkdir()
    save_file({f"layer.{i}.weight": torch.randn(64, 64, generator=gen) for i in range(8)}, str(source))
    shardkit.split(source, tmp_path / "ckpt", max_shard_size="40KB")
    (tmp_path / "ckpt" / "config.json").write_text('{"model_type": "tiny"}')
    return source, tmp_path / "ckpt"


def _env(hub, s3_env, tmp_path: Path, *, xet: bool = False) -> dict[str, str]:
    return {**hub_env(hub, tmp_path / "home", xet=xet), **s3_env.env}


def _bucket_files(s3_env, prefix: str) -> dict[str, bytes]:
    return {key[len(prefix) + 1:]: s3_env.get(key) for key in s3_env.keys(prefix + "/")}


def _hub_files(env: dict[str, str], dest: Path) -> dict[str, bytes]:
    """The repository's files at main, downloaded with the real client."""
    download(env, REPO, dest)
    return {p.relative_to(dest).as_posix(): p.read_bytes() for p in sorted(dest.rglob("*"))
            if p.is_file() and ".cache" not in p.parts and p.name != ".gitattributes"}


@pytest.mark.parametrize("xet", [False, True], ids=["lfs", "xet"])
def test_push_from_a_bucket_puts_its_objects_on_the_hub_byte_for_byte(hub, s3_env, tmp_path, xet) -> None:
    _, folder = _checkpoint(tmp_path)
    s3_env.put_folder(folder, "run/ckpt")
    s3_env.put("run/ckpt/.shardkit-write-dead.json", b"{}")  # a journal: never pushed
    env = _env(hub, s3_env, tmp_path, xet=xet)

    proc = run_shardkit(env, "push", f"s3://{s3_env.bucket}/run/ckpt", REPO, "-m", "from the bucket")
    assert proc.returncode == 0, proc.stderr
    bucket = _bucket_files(s3_env, "run/ckpt")
    del bucket[".shardkit-write-dead.json"]
    repo = hub.state.repo(REPO)
    assert repo.commits[repo.refs["main"]].message == "from the bucket" and len(repo.history) == 2
    assert len(bucket) == 7 and _hub_files(env, tmp_path / "down") == bucket
    assert index_problems(hub.state, REPO) == []

    again = run_shardkit(env, "push", f"s3://{s3_env.bucket}/run/ckpt", REPO)  # unchanged: no commit
    assert again.returncode == 0 and "nothing to upload" in again.stdout, again.stdout + again.stderr
    assert len(hub.state.repo(REPO).history) == 2
    assert shardkit.verify(tmp_path / "down", against=folder).ok


def test_a_read_failure_mid_push_leaves_no_commit(hub, s3_env, tmp_path) -> None:
    _, folder = _checkpoint(tmp_path)
    s3_env.put_folder(folder, "ckpt")
    code = """
import sys, boto3, shardkit
from shardkit.errors import ShardkitError
bucket, repo = sys.argv[1:3]
client, gone = boto3.client("s3"), []
def progress(done, total):  # after the first upload, a shard the push has not read yet disappears
    if done and not gone:
        client.delete_object(Bucket=bucket, Key="ckpt/model-00004-of-00004.safetensors")
        gone.append(done)
try:
    shardkit.push(f"s3://{bucket}/ckpt", repo, progress=progress)
except ShardkitError as e:
    print(type(e).__name__, e)
"""
    out = run_python(code, _env(hub, s3_env, tmp_path), s3_env.bucket, REPO).stdout
    assert "model-00004-of-00004.safetensors" in out and out.split()[0].endswith("Error"), out
    assert len(hub.state.repo(REPO).history) == 1  # created, never committed to


def test_a_broken_checkpoint_in_a_bucket_is_refused_before_anything_is_sent(hub, s3_env, tmp_path) -> None:
    _, folder = _checkpoint(tmp_path)
    (folder / "model-00002-of-00004.safetensors").unlink()
    s3_env.put_folder(folder, "broken")
    env = _env(hub, s3_env, tmp_path)
    proc = run_shardkit(env, "push", f"s3://{s3_env.bucket}/broken", REPO)
    assert proc.returncode == 1 and "refusing to push" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and f"s3://{s3_env.bucket}/broken" in proc.stderr
    assert ("model", REPO) not in hub.state.repos
    ok = run_shardkit(env, "push", f"s3://{s3_env.bucket}/broken", REPO, "--no-verify", "--include", "*.json")
    assert ok.returncode == 0, ok.stderr
    assert sorted(_hub_files(env, tmp_path / "down")) == ["config.json", "model.safetensors.index.json",
                                                         "shardkit.manifest.json"]


def test_split_to_a_bucket_then_push_streams_from_the_bucket(hub, s3_env, tmp_path) -> None:
    source, _ = _checkpoint(tmp_path)
    env = _env(hub, s3_env, tmp_path)
    url = f"s3://{s3_env.bucket}/split-out"
    proc = run_shardkit(env, "split", source, url, "--max-shard-size", "60KB", "--push-to", REPO, "-q")
    assert proc.returncode == 0, proc.stderr
    bucket = _bucket_files(s3_env, "split-out")
    assert any(n.endswith("-of-00003.safetensors") for n in bucket)
    assert _hub_files(env, tmp_path / "down") == bucket


def test_objects_stream_by_range_with_no_local_copy(s3_env, tmp_path) -> None:
    """The stream the upload reads: seekable, every byte from the object, in ranged reads."""
    from shardkit.hub.store_files import collect_store_files, open_object
    from shardkit.stores import open_store

    data = hashlib.sha256(b"x").digest() * 40_000  # 1.28 MB
    s3_env.put("p/a.bin", data)
    s3_env.put("p/.hidden/b.bin", b"no")
    with open_store(f"s3://{s3_env.bucket}/p") as store:
        assert [o.name for o in collect_store_files(store)] == ["a.bin"]
        with open_object(store, "a.bin", len(data)) as f:
            assert f.read(5) == data[:5]
            f.seek(1_000_000)
            assert f.read() == data[1_000_000:]
            f.seek(0)
            assert hashlib.sha256(f.read()).digest() == hashlib.sha256(data).digest()
            assert f.tell() == len(data)
