"""The collective convert from and into ``s3://`` (gloo, CPU, spawned ranks, SeaweedFS): bit-equal to one process.

Each rank reads only its shards' byte ranges from a source prefix and streams its own shards into
the output prefix; rank 0 puts the journal first and the index last. A failure on one rank leaves
no index and no open upload; a killed rank 0 leaves a journal that ``recover`` cleans up.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers_s3 import DelayProxy
from test_distributed import TINY_UNET, _save_rank, _tiny_llama, run_ranks
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

SIZE = "60KB"


@pytest.fixture
def unet_folder(tmp_path: Path) -> Path:
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    folder = tmp_path / "unet"
    UNet2DConditionModel(**TINY_UNET).save_pretrained(folder)
    return folder


def _convert_rank(rank: int, world: int, src: str, out: str, overwrite: bool) -> None:
    import shardkit

    result = shardkit.convert(src, out, max_shard_size=SIZE, collective=True, overwrite=overwrite)
    assert result.output == out
    assert len(result.plan.shards) > world  # every rank writes shards


def _fault_rank(rank: int, world: int, src: str, out: str) -> None:
    import shardkit
    from shardkit import _faults

    importlib.reload(_faults)  # armed by this rank's environment only
    shardkit.convert(src, out, max_shard_size=SIZE, collective=True)


def _prefix_bytes(s3_env: Any, prefix: str) -> dict[str, bytes]:
    return {k[len(prefix) + 1:]: s3_env.get(k) for k in s3_env.keys(prefix + "/")}


def _folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("route", ["s3-s3", "local-s3"])
def test_collective_convert_with_s3_equals_one_process(s3_env: Any, unet_folder: Path, tmp_path: Path,
                                                      route: str) -> None:
    import shardkit

    s3_env.put_folder(unet_folder, "src/unet")
    src = f"s3://{s3_env.bucket}/src/unet" if route.startswith("s3") else str(unet_folder)
    ref = tmp_path / "ref"
    shardkit.convert(str(unet_folder), ref, max_shard_size=SIZE)  # one process, a local copy of the source
    expected = _folder_bytes(ref)
    assert {"config.json", "diffusion_pytorch_model.safetensors.index.json", "shardkit.manifest.json"} <= set(expected)
    if route.endswith("s3"):
        shardkit.convert(src, f"s3://{s3_env.bucket}/ref", max_shard_size=SIZE)  # one process into the store
        assert _prefix_bytes(s3_env, "ref") == expected
        run_ranks(tmp_path, _convert_rank, src, f"s3://{s3_env.bucket}/out", False)
        assert _prefix_bytes(s3_env, "out") == expected
        assert s3_env.uploads() == []
    else:
        run_ranks(tmp_path, _convert_rank, src, str(tmp_path / "out"), False)
        assert _folder_bytes(tmp_path / "out") == expected
    assert shardkit.verify(str(ref)).ok


def test_s3_to_local_equals_one_process_and_each_rank_reads_only_its_byte_ranges(
        s3_env: Any, unet_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shardkit

    s3_env.put_folder(unet_folder, "src")
    shardkit.convert(str(unet_folder), tmp_path / "ref", max_shard_size=SIZE)
    tensor_bytes = (unet_folder / "diffusion_pytorch_model.safetensors").stat().st_size
    with DelayProxy(s3_env.server.port, delay_ms=0) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
        run_ranks(tmp_path, _convert_rank, f"s3://{s3_env.bucket}/src", str(tmp_path / "out"), False)
        moved = proxy.sent_bytes
    assert _folder_bytes(tmp_path / "out") == _folder_bytes(tmp_path / "ref")
    # both ranks fetch the headers and configs (tens of KB); the tensor bytes cross once, not once per rank
    assert tensor_bytes < moved < tensor_bytes * 1.3 + 200_000, (moved, tensor_bytes)


@pytest.mark.slow
def test_fsdp_save_sharded_into_s3_equals_one_process(s3_env: Any, tmp_path: Path) -> None:
    """save_sharded over a process group streams each rank's gathered shards into the store too."""
    ref = tmp_path / "ref"
    run_ranks(tmp_path, _save_rank, _tiny_llama, f"s3://{s3_env.bucket}/fsdp", str(ref), 20_000)
    assert _prefix_bytes(s3_env, "fsdp") == _folder_bytes(ref)
    assert s3_env.uploads() == []


@pytest.mark.slow
def test_collective_reshard_in_place_in_the_store_equals_one_process(s3_env: Any, unet_folder: Path,
                                                                     tmp_path: Path) -> None:
    import shardkit

    for prefix in ("one", "two"):
        s3_env.put_folder(unet_folder, prefix)
    shardkit.convert(f"s3://{s3_env.bucket}/one", f"s3://{s3_env.bucket}/one", max_shard_size=SIZE, overwrite=True)
    url = f"s3://{s3_env.bucket}/two"
    run_ranks(tmp_path, _convert_rank, url, url, True)
    assert _prefix_bytes(s3_env, "two") == _prefix_bytes(s3_env, "one")
    assert any(k.endswith(".index.json") for k in s3_env.keys("two/"))


def test_failure_on_one_rank_publishes_nothing_and_leaves_no_upload(s3_env: Any, unet_folder: Path,
                                                                     tmp_path: Path) -> None:
    import shardkit

    src, out = str(unet_folder), f"s3://{s3_env.bucket}/out"
    with pytest.raises(ProcessRaisedException):
        run_ranks(tmp_path, _fault_rank, src, out, env={1: {"SHARDKIT_FAULT_ERRNO_AT": "3:EIO"}})
    assert s3_env.keys("out/") == []  # no index, no shard of either rank, no journal
    assert s3_env.uploads() == []
    assert shardkit.recover(out).removed == []


@pytest.mark.slow  # rank 1 waits out the gloo timeout (60 s) before it learns that rank 0 died
def test_rank_zero_killed_mid_write_is_cleaned_by_recover(s3_env: Any, unet_folder: Path, tmp_path: Path) -> None:
    import shardkit

    src, out = str(unet_folder), f"s3://{s3_env.bucket}/out"
    with pytest.raises(ProcessExitedException):
        run_ranks(tmp_path, _fault_rank, src, out, env={0: {"SHARDKIT_FAULT_KILL_AT": "20"}})
    left = s3_env.keys("out/")
    assert not [k for k in left if k.endswith(".index.json")]
    assert [k for k in left if "/.shardkit-write-" in k], left  # the journal went first
    removed = shardkit.recover(out).removed
    assert removed
    assert s3_env.keys("out/") == [] and s3_env.uploads() == []
    run_ranks(tmp_path, _convert_rank, src, out, False)  # the prefix takes a new write
    assert "out/diffusion_pytorch_model.safetensors.index.json" in s3_env.keys("out/")


def test_a_hub_source_is_still_refused_by_a_collective_convert_in_one_line(tmp_path: Path) -> None:
    import shardkit
    from shardkit.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match=r"reads a local or s3:// checkpoint; download it first"):
        shardkit.convert("hf://org/model", tmp_path / "out", collective=True)
    assert not (tmp_path / "out").exists()
