"""S3 → S3 reshards composed by copies inside the store (``UploadPartCopy``): shardkit.api.store_copy.

Against a real SeaweedFS (the ``s3_env`` fixture). The output must equal a local split of the same
source byte for byte, move only a header's worth of bytes per shard through the client, keep the
manifest honest (carried crc32s, or ``null`` for bytes never seen) and leave nothing on failure.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from conftest import random_tensor
from helpers_s3 import paused_cli

import shardkit
from shardkit.stores.copy_plan import CopyRefusedError

MiB = 1 << 20
INDEX = "model.safetensors.index.json"


@pytest.fixture
def source(tmp_path) -> Path:
    """A checkpoint of 4 shards (with a config and shardkit's manifest): four 6 MiB bf16 tensors and small ones."""
    from safetensors.torch import save_file

    state = {f"layers.{i}.weight": random_tensor("BF16", (1536, 2048), seed=i) for i in range(4)}
    state.update({f"layers.{i}.bias": random_tensor("F32", (2048,), seed=10 + i) for i in range(3)})
    single = tmp_path / "single" / "model.safetensors"
    single.parent.mkdir()
    save_file(state, single)
    (single.parent / "config.json").write_text('{"model_type": "test"}\n')
    folder = tmp_path / "src"
    shardkit.split(single.parent, folder, max_shard_size="10MB")
    assert len(list(folder.glob("*.safetensors"))) >= 3
    return folder


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _remote(s3_env, prefix: str) -> dict[str, bytes]:
    return {k[len(prefix) + 1:]: s3_env.get(k) for k in s3_env.keys(prefix + "/")}


def _upload(s3_env, folder: Path, prefix: str, *, manifest: bool = True) -> str:
    for name, data in _files(folder).items():
        if manifest or name != "shardkit.manifest.json":
            s3_env.put(f"{prefix}/{name}", data)
    return f"s3://{s3_env.bucket}/{prefix}"


def test_reshard_in_the_store_equals_a_local_split_byte_for_byte(s3_env, source, tmp_path) -> None:
    url = _upload(s3_env, source, "src")
    result = shardkit.split(url, f"s3://{s3_env.bucket}/out", max_shard_size="20MB")
    local = tmp_path / "local"
    shardkit.split(source, local, max_shard_size="20MB")
    got, want = _remote(s3_env, "out"), _files(local)
    assert sorted(got) == sorted(want) == sorted(["config.json", INDEX, "shardkit.manifest.json",
                                                  "model-00001-of-00002.safetensors",
                                                  "model-00002-of-00002.safetensors"])
    for name in want:
        assert got[name] == want[name], name  # the manifest too: every crc32 carried from the source's
    total = result.plan.total_bytes
    # each shard's first tensor tops its first part up to 5 MiB; the 6 MiB tensors after it are copied
    assert result.cloned_bytes >= 2 * 6 * MiB and result.cloned_bytes < total
    assert s3_env.uploads() == []
    assert shardkit.verify(local).ok


def test_only_the_first_part_of_each_shard_crosses_the_client(s3_env, source, monkeypatch) -> None:
    from helpers_s3 import DelayProxy

    url = _upload(s3_env, source.parent / "single", "src")  # one object: each output shard is one run of it
    with DelayProxy(s3_env.server.port, delay_ms=0) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
        result = shardkit.split(url, f"s3://{s3_env.bucket}/out", max_shard_size="13MB")
        moved = proxy.sent_bytes + proxy.received_bytes
    total = result.plan.total_bytes
    # per shard, only its first part (header + tensor bytes up to 5 MiB) comes down (GET) and goes up
    # (UploadPart); the rest is copied in the store: the bytes through the proxy are twice what was not copied
    assert len(result.plan.shards) == 2 and result.cloned_bytes >= total - 2 * 5 * MiB, (result.cloned_bytes, total)
    assert moved < 2 * (total - result.cloned_bytes) + MiB, (moved, total)


def test_without_a_source_manifest_copied_tensors_are_recorded_not_hashed(s3_env, source, tmp_path, run_cli) -> None:
    url = _upload(s3_env, source, "src", manifest=False)
    shardkit.split(url, f"s3://{s3_env.bucket}/out", max_shard_size="20MB")
    manifest = json.loads(s3_env.get("out/shardkit.manifest.json"))
    local = tmp_path / "local"
    shardkit.split(source, local, max_shard_size="20MB")
    truth = json.loads((local / "shardkit.manifest.json").read_bytes())
    crcs = {(f, t): r["crc32"] for f, e in manifest["files"].items() for t, r in e.get("tensors", {}).items()}
    unhashed = [k for k, v in crcs.items() if v is None]
    assert unhashed, "tensors copied in the store without a source manifest have no crc32"
    for (f, t), crc in crcs.items():
        assert crc is None or crc == truth["files"][f]["tensors"][t]["crc32"], "never a wrong crc32"
    down = tmp_path / "down"
    for name, data in _remote(s3_env, "out").items():
        (down / name).parent.mkdir(parents=True, exist_ok=True)
        (down / name).write_bytes(data)
    report = shardkit.verify(down)
    assert report.ok and report.unhashed == len(unhashed)
    result = run_cli("verify", down)
    assert result.exit_code == 0, result.stderr
    assert f"{len(unhashed)} tensor(s) not hashed (copied in the store)" in result.stdout
    assert shardkit.verify(f"s3://{s3_env.bucket}/out").unhashed == len(unhashed)
    # a changed byte in a hashed tensor is still caught; the manifest without nulls is unchanged in format
    assert all(v is not None for v in crcs.values() if v) and len(unhashed) < len(crcs)


def test_a_store_that_refuses_copies_gets_the_bytes_streamed(s3_env, source, tmp_path, monkeypatch) -> None:
    from shardkit.stores import s3_writer

    def refuse(self, *args, **kwargs):
        raise CopyRefusedError("refused for the test")

    monkeypatch.setattr(s3_writer.S3Writer, "copy_range", refuse)
    url = _upload(s3_env, source, "src")
    result = shardkit.split(url, f"s3://{s3_env.bucket}/out", max_shard_size="20MB")
    assert result.cloned_bytes == 0
    local = tmp_path / "local"
    shardkit.split(source, local, max_shard_size="20MB")
    assert _remote(s3_env, "out") == _files(local)
    assert s3_env.uploads() == []


def test_a_cast_is_not_copied_but_still_equals_a_local_split(s3_env, source, tmp_path) -> None:
    url = _upload(s3_env, source, "src")
    result = shardkit.split(url, f"s3://{s3_env.bucket}/out", max_shard_size="20MB", dtype="fp16")
    assert result.cloned_bytes == 0
    local = tmp_path / "local"
    shardkit.split(source, local, max_shard_size="20MB", dtype="fp16")
    assert _remote(s3_env, "out") == _files(local)


def test_sigkill_mid_copy_leaves_no_index_and_recover_aborts_the_upload(s3_env, source, tmp_path, run_cli) -> None:
    url = _upload(s3_env, source, "src")
    out = f"s3://{s3_env.bucket}/kill"
    wait = tmp_path / "go"
    proc = paused_cli(s3_env, "store:part:model-00001-of-00002.safetensors:2",
                      ["split", url, out, "--max-shard-size", "20MB"], wait)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    keys = s3_env.keys("kill/")
    assert f"kill/{INDEX}" not in keys and keys, "a journal, no index"
    assert s3_env.uploads() == ["kill/model-00001-of-00002.safetensors"]
    result = run_cli("recover", out)
    assert result.exit_code == 0, result.stderr
    assert s3_env.uploads() == [] and s3_env.keys("kill/") == []
    assert len(s3_env.keys("src/")) == len(_files(source)), "the source is untouched"


def test_a_manifest_with_unhashed_tensors_is_read_and_reported_without_a_store(source, run_cli) -> None:
    """``"crc32": null`` (no server needed): verify passes, counts it, and still checks every hashed tensor."""
    path = source / "shardkit.manifest.json"
    doc = json.loads(path.read_bytes())
    shard = sorted(n for n in doc["files"] if n.endswith(".safetensors"))[0]
    tensors = doc["files"][shard]["tensors"]
    unhashed, hashed = sorted(tensors)[:2]
    tensors[unhashed]["crc32"] = None
    path.write_text(json.dumps(doc))
    report = shardkit.verify(source)
    assert report.ok and report.unhashed == 1, report.findings
    assert "1 tensor(s) not hashed (copied in the store)" in run_cli("verify", source).stdout
    start = doc["files"][shard]["data_start"]
    with open(source / shard, "r+b") as f:
        f.seek(start + tensors[hashed]["data_offsets"][0])
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    found = shardkit.verify(source).findings
    assert [f.tensor for f in found] == [hashed]
