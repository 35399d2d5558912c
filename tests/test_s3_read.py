"""``s3://`` as a source: ``split``/``convert`` to a local folder, ``shardkit.open``, ``load_model``, planning.

Against a real SeaweedFS (fixtures ``s3_server``/``s3_env``); bytes moved are counted at the
:class:`DelayProxy` between the client and the server.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import assert_one_line_error, tensor_bytes, tiny_unet
from helpers_s3 import SECRET_KEY, DelayProxy, sharded_checkpoint


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _mirrors() -> set[str]:
    import tempfile

    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("shardkit-s3-")}


@pytest.fixture(autouse=True)
def _own_tmp(tmp_path, monkeypatch) -> None:
    """A temporary folder of this test's own: another process's mirrors never count as this test's leftovers."""
    import tempfile

    own = tmp_path / "tmp"
    own.mkdir()
    monkeypatch.setenv("TMPDIR", str(own))
    monkeypatch.setattr(tempfile, "tempdir", str(own))


@pytest.fixture
def sharded(tmp_path, run_cli) -> Path:
    """A 3-shard checkpoint of ~12 MB (random bytes) with an index and a manifest."""
    return sharded_checkpoint(tmp_path, run_cli)


def test_split_from_s3_is_byte_identical_to_a_local_split(s3_env, sharded, tmp_path, run_cli) -> None:
    s3_env.put_folder(sharded, "run/ckpt")
    url = f"s3://{s3_env.bucket}/run/ckpt"
    before = _mirrors()
    local = run_cli("split", sharded, tmp_path / "local", "--max-shard-size", "3MB")
    remote = run_cli("split", url, tmp_path / "remote", "--max-shard-size", "3MB")
    assert local.exit_code == 0 and remote.exit_code == 0, local.stderr + remote.stderr
    expected, got = _files(tmp_path / "local"), _files(tmp_path / "remote")
    assert len([n for n in got if n.endswith(".safetensors")]) >= 4
    assert got == expected, "the same shards, index and manifest as splitting a local copy"
    assert _mirrors() == before, "the header-only mirror is removed"


def test_convert_from_s3_with_the_python_api(s3_env, sharded, tmp_path) -> None:
    import shardkit

    s3_env.put_folder(sharded, "ckpt")
    kwargs = dict(dtype="fp16", strip_prefix="", max_shard_size="4MB")
    shardkit.convert(sharded, tmp_path / "local", **kwargs)
    result = shardkit.convert(f"s3://{s3_env.bucket}/ckpt", tmp_path / "remote", **kwargs)
    assert result.plan.shards, result
    assert _files(tmp_path / "remote") == _files(tmp_path / "local")


def test_open_reads_each_tensor_byte_once(s3_env, sharded, monkeypatch) -> None:
    import shardkit

    total = s3_env.put_folder(sharded, "ckpt")
    with shardkit.open(sharded) as local:
        expected = {n: tensor_bytes(t) for n, t in local.to_state_dict(copy=True).items()}
        data_bytes = local.nbytes()
    with DelayProxy(s3_env.server.port, delay_ms=1) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
        with shardkit.open(f"s3://{s3_env.bucket}/ckpt") as ckpt:
            header_bytes, proxy.sent_bytes = proxy.sent_bytes, 0
            assert f"s3://{s3_env.bucket}/ckpt" in ckpt.description
            assert {r["backend"] for r in ckpt.read_report()} == {"range"}
            got = {n: tensor_bytes(t) for n, t in ckpt.to_state_dict().items()}
            data_moved = proxy.sent_bytes
            one = ckpt.get_tensor(next(iter(ckpt)), dtype=__import__("torch").float64)  # a host cast: by range too
    assert got == expected, "every tensor's bytes exactly as in the local checkpoint"
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env.env["AWS_ENDPOINT_URL"])
    before = _mirrors()
    forgotten = shardkit.open(f"s3://{s3_env.bucket}/ckpt")
    assert len(_mirrors() - before) == 1
    del forgotten
    __import__("gc").collect()
    assert _mirrors() == before, "a checkpoint never closed leaves no mirror behind once collected"
    assert one.dtype.is_floating_point
    assert header_bytes < 300_000, header_bytes
    assert data_bytes <= data_moved < data_bytes * 1.02 + 100_000, (data_moved, data_bytes, total)
    print(f"open: headers {header_bytes} bytes, tensors {data_moved} bytes moved for {data_bytes}")


def test_load_model_from_s3_matches_the_local_load(s3_env, tmp_path) -> None:
    import torch

    import shardkit

    model = tiny_unet()
    model.save_pretrained(tmp_path / "unet", max_shard_size="100KB")
    assert len(list((tmp_path / "unet").glob("*.safetensors"))) > 1
    s3_env.put_folder(tmp_path / "unet", "models/unet")
    url = f"s3://{s3_env.bucket}/models/unet"
    loaded = shardkit.load_model("diffusers:UNet2DConditionModel", url)  # config: its config.json
    local = shardkit.load_model("diffusers:UNet2DConditionModel", tmp_path / "unet")
    expected, got = local.state_dict(), loaded.state_dict()
    assert list(got) == list(expected)
    for name, value in expected.items():
        assert tensor_bytes(got[name]) == tensor_bytes(value), name
    assert {f["backend"] for f in loaded.shardkit_load_report["files"]} == {"range"}
    half = shardkit.load_model("diffusers:UNet2DConditionModel", url, dtype="bf16", device_map="cpu")
    assert all(p.dtype in (torch.bfloat16, torch.float32) for p in half.parameters())
    plan_local = shardkit.plan_device_map("diffusers:UNet2DConditionModel", checkpoint=tmp_path / "unet",
                                          config=tmp_path / "unet" / "config.json", max_memory={"cpu": "1GB"})
    plan_remote = shardkit.plan_device_map("diffusers:UNet2DConditionModel", checkpoint=url, max_memory={"cpu": "1GB"})
    assert plan_remote.device_map == plan_local.device_map
    skeleton = shardkit.loading.skeleton.build_skeleton("diffusers:UNet2DConditionModel",
                                                        config=tmp_path / "unet" / "config.json")
    est_remote = shardkit.estimate_memory(skeleton, gpu_bytes="1GB", checkpoint=url)
    est_local = shardkit.estimate_memory(skeleton, gpu_bytes="1GB", checkpoint=tmp_path / "unet")
    assert est_remote.to_dict() == est_local.to_dict()


def test_plan_and_fit_from_s3_read_headers_only(s3_env, tmp_path, run_cli, monkeypatch) -> None:
    model = tiny_unet()
    model.save_pretrained(tmp_path / "unet", max_shard_size="100KB")
    total = s3_env.put_folder(tmp_path / "unet", "unet")
    url = f"s3://{s3_env.bucket}/unet"
    local = run_cli("plan", tmp_path / "unet", "--model", "diffusers:UNet2DConditionModel", "--max-memory", "cpu=1GB",
                    "--json")
    assert local.exit_code == 0, local.stderr
    with DelayProxy(s3_env.server.port, delay_ms=0) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
        remote = run_cli("plan", url, "--model", "diffusers:UNet2DConditionModel", "--max-memory", "cpu=1GB", "--json")
        plan_bytes = proxy.sent_bytes
    assert remote.exit_code == 0, remote.stderr
    mine, theirs = json.loads(remote.stdout), json.loads(local.stdout)
    assert mine.pop("checkpoint") == url
    theirs.pop("checkpoint")
    assert mine == theirs
    from shardkit.stores.mirror import FIRST_RANGE_BYTES

    shards = list((tmp_path / "unet").glob("*.safetensors"))
    side_bytes = sum(p.stat().st_size for p in (tmp_path / "unet").glob("*.json"))
    assert plan_bytes < len(shards) * FIRST_RANGE_BYTES + side_bytes + 30_000 < total, (plan_bytes, total)


def test_missing_prefix_and_wrong_secret_exit_2(s3_env, sharded, tmp_path, run_cli, monkeypatch) -> None:
    import shardkit
    from shardkit.errors import SourceNotFoundError

    s3_env.put_folder(sharded, "ckpt")
    line = assert_one_line_error(run_cli("split", f"s3://{s3_env.bucket}/nothing-here", tmp_path / "out"),
                                 contains="no objects")
    assert f"s3://{s3_env.bucket}/nothing-here" in line
    with pytest.raises(SourceNotFoundError, match="nothing-here"):
        shardkit.open(f"s3://{s3_env.bucket}/nothing-here")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "a-wrong-secret")
    result = run_cli("convert", f"s3://{s3_env.bucket}/ckpt", tmp_path / "out2")
    line = assert_one_line_error(result, contains=s3_env.bucket)
    assert "a-wrong-secret" not in result.stdout + result.stderr and SECRET_KEY not in line
    assert not (tmp_path / "out").exists() and not (tmp_path / "out2").exists()


def test_the_ring_pipeline_reads_a_bucket_through_its_ranged_reader(s3_env, sharded) -> None:
    """What ``load_model`` does for tensors headed to a GPU, run on the host (``pipe_host``): never the stand-in files."""
    import torch

    import shardkit
    from shardkit.loading.bulk import Want, read_batch

    s3_env.put_folder(sharded, "ckpt")
    with shardkit.open(sharded) as local:
        expected = {n: tensor_bytes(t) for n, t in local.to_state_dict(copy=True).items()}
        local_cast = tensor_bytes(local.get_tensor("layers.F32.0", dtype=torch.float64))
    with shardkit.open(f"s3://{s3_env.bucket}/ckpt") as ckpt:
        wants = {n: Want(n, "cpu", ckpt.dtype_of(n)) for n in ckpt}
        values, report = read_batch(ckpt, wants, pipe_host=True)
        cast = ckpt.get_tensor("layers.F32.0", dtype=torch.float64)
    assert report.pipelined_bytes == sum(len(b) for b in expected.values())
    assert {n: tensor_bytes(t) for n, t in values.items()} == expected
    assert tensor_bytes(cast) == local_cast, "a host cast reads the object, not the stand-in"


def test_a_pickle_in_a_bucket_is_refused_in_one_line(s3_env, tmp_path, run_cli) -> None:
    import torch

    torch.save({"w": torch.ones(4)}, tmp_path / "model.bin")
    s3_env.put("pk/model.bin", (tmp_path / "model.bin").read_bytes())
    result = run_cli("convert", f"s3://{s3_env.bucket}/pk", tmp_path / "out")
    line = assert_one_line_error(result)
    assert f"s3://{s3_env.bucket}/pk: holds model.bin, not safetensors" in line and "shardkit-s3-" not in line
    assert not (tmp_path / "out").exists()


def test_fit_of_a_pipeline_in_a_bucket_equals_the_local_fit(s3_env, tmp_path) -> None:
    from helpers_fit import save_tiny_pipeline

    import shardkit

    save_tiny_pipeline(tmp_path / "pipe", tmp_path / "scratch")
    s3_env.put_folder(tmp_path / "pipe", "pipes/tiny")
    local = shardkit.fit(tmp_path / "pipe", gpu="1GB").to_dict()
    remote = shardkit.fit(f"s3://{s3_env.bucket}/pipes/tiny", gpu="1GB").to_dict()
    local.pop("path", None), remote.pop("path", None)
    assert json.dumps(remote, sort_keys=True).replace(f"s3://{s3_env.bucket}/pipes/tiny", "P") == \
        json.dumps(local, sort_keys=True).replace(str(tmp_path / "pipe"), "P")
