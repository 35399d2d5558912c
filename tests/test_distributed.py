"""Collective save, parallel convert and rank-local loading over torch.distributed (gloo, CPU, spawned ranks)."""

from __future__ import annotations

import datetime
import gc
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TINY_UNET = {"block_out_channels": [8, 16], "layers_per_block": 1, "sample_size": 8, "in_channels": 4,
             "out_channels": 4, "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
             "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"], "cross_attention_dim": 8,
             "norm_num_groups": 4, "attention_head_dim": 2}


# ----------------------------------------------------------------------------- spawning ranks

def _entry(rank: int, world: int, init: str, fn: Callable[..., Any], args: tuple, env: dict) -> None:
    os.environ.update(env.get(rank, {}))
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        fn(rank, world, *args)
    finally:
        gc.collect()  # FSDP2 modules and DTensors hold the group; free them before it goes
        dist.destroy_process_group()


def run_ranks(tmp_path: Path, fn: Callable[..., Any], *args: Any, world: int = 2, env: dict | None = None) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo ranks; raise if any rank failed."""
    init = f"file://{tmp_path / f'.pg-{os.urandom(4).hex()}'}"
    mp.spawn(_entry, args=(world, init, fn, args, env or {}), nprocs=world, join=True)


def _tiny_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def _tiny_unet() -> Any:
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(**TINY_UNET)


def _fsdp(model: Any) -> Any:
    from torch.distributed.fsdp import fully_shard

    for module in model.modules():
        if type(module).__name__ in ("LlamaDecoderLayer", "Transformer2DModel", "ResnetBlock2D"):
            fully_shard(module)
    fully_shard(model)
    return model


# ----------------------------------------------------------------------------- rank bodies

def _save_rank(rank: int, world: int, build: Callable[[], Any], out: str, ref: str, size: int) -> None:
    import shardkit
    from shardkit import save_sharded as save_local

    model = build()
    if rank == 0:
        save_local(model, ref, max_shard_size=size)  # the single-process save of the full model
    dist.barrier()
    result = shardkit.save_sharded(_fsdp(model), out, max_shard_size=size, process_group=dist.group.WORLD)
    assert len(result.plan.shards) > 2


def _folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("kind", ["transformers", pytest.param("diffusers", marks=pytest.mark.slow)])
def test_collective_save_equals_single_process_save(tmp_path: Path, kind: str, request: pytest.FixtureRequest) -> None:
    build = _tiny_llama if kind == "transformers" else _tiny_unet
    if kind == "transformers":  # ran in the module's one start of the ranks (not started for the slow case alone)
        one_start: Path = request.getfixturevalue("one_start")
        out, ref = one_start / "save" / "out", one_start / "save" / "ref"
    else:
        out, ref = tmp_path / "out", tmp_path / "ref"
        run_ranks(tmp_path, _save_rank, build, str(out), str(ref), 20_000)
    assert _folder_bytes(out) == _folder_bytes(ref)
    assert not [n for n in os.listdir(out.parent) if "shardkit-tmp" in n]
    if kind == "transformers":
        from transformers import LlamaForCausalLM

        loaded = LlamaForCausalLM.from_pretrained(out)
    else:
        from diffusers import UNet2DConditionModel

        loaded = UNet2DConditionModel.from_pretrained(out)
    expected = build().state_dict()
    for name, t in loaded.state_dict().items():
        assert torch.equal(t, expected[name]), name


def _uneven_rank(rank: int, world: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import shardkit

    mesh = init_device_mesh("cpu", (world,))
    placed = {name: distribute_tensor(t, mesh, [placement]) for name, (t, placement) in _uneven_state(
        Shard, Replicate).items()}
    placed["plain"] = torch.arange(6, dtype=torch.int64)
    shardkit.save_sharded(placed, out, max_shard_size=64, process_group=dist.group.WORLD)


def _uneven_state(Shard: Any, Replicate: Any) -> dict:
    g = torch.Generator().manual_seed(1)
    return {"rows": (torch.randn(5, 3, generator=g), Shard(0)), "cols": (torch.randn(3, 5, generator=g), Shard(1)),
            "one": (torch.randn(1, generator=g), Shard(0)), "same": (torch.randn(4, generator=g), Replicate()),
            "half": (torch.randn(7, generator=g).to(torch.bfloat16), Shard(0))}


def test_collective_save_of_uneven_and_mixed_placements_equals_one_process(tmp_path: Path, one_start: Path) -> None:
    from torch.distributed.tensor import Replicate, Shard

    import shardkit

    full = {name: t for name, (t, _) in _uneven_state(Shard, Replicate).items()}
    full["plain"] = torch.arange(6, dtype=torch.int64)
    shardkit.save_sharded(full, tmp_path / "ref", max_shard_size=64)
    assert len(list((tmp_path / "ref").glob("*.safetensors"))) > 2
    assert _folder_bytes(one_start / "uneven") == _folder_bytes(tmp_path / "ref")


def _kill_rank(rank: int, world: int, out: str) -> None:
    import importlib

    import shardkit
    from shardkit import _faults

    importlib.reload(_faults)  # the kill point is armed by this rank's environment only
    shardkit.save_sharded(_fsdp(_tiny_llama()), out, max_shard_size=20_000, process_group=dist.group.WORLD)


def _save_plain(rank: int, world: int, out: str) -> None:
    import shardkit

    shardkit.save_sharded(_fsdp(_tiny_llama()), out, max_shard_size=20_000, process_group=dist.group.WORLD)


@pytest.mark.slow
def test_rank_killed_mid_save_publishes_nothing_and_next_run_cleans_up(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises((mp.ProcessExitedException, mp.ProcessRaisedException)):  # a rank killed, or failing after
        run_ranks(tmp_path, _kill_rank, str(out), env={1: {"SHARDKIT_FAULT_KILL_AT": "3"}})
    assert not out.exists()
    run_ranks(tmp_path, _save_plain, str(out))
    assert (out / "model.safetensors.index.json").is_file()
    assert [n for n in os.listdir(tmp_path) if "shardkit-tmp" in n or n.startswith(".out")] == []
    assert not [n for n in os.listdir(out) if n.startswith(".")]


def _overwrite_rank(rank: int, world: int, out: str, ref: str) -> None:
    import shardkit
    from shardkit import save_sharded as save_local

    model = _tiny_llama()
    if rank == 0:
        save_local(model, ref, max_shard_size=30_000)
    model = _fsdp(model)
    shardkit.save_sharded(model, out, max_shard_size=20_000, process_group=dist.group.WORLD)
    shardkit.save_sharded(model, out, max_shard_size=30_000, overwrite=True, process_group=dist.group.WORLD)


@pytest.mark.slow
def test_collective_overwrite_reshards_in_place_like_a_single_process(tmp_path: Path) -> None:
    out, ref = tmp_path / "out", tmp_path / "ref"
    run_ranks(tmp_path, _overwrite_rank, str(out), str(ref))
    assert _folder_bytes(out) == _folder_bytes(ref)


# ----------------------------------------------------------------------------- errors, one line each

def _expect_error(rank: int, world: int, out: str, setup: str, report: str) -> None:
    import shardkit
    from shardkit.errors import ShardkitError

    model = _fsdp(_tiny_llama())
    state = model.state_dict()
    if setup == "plan" and rank == 1:
        state = dict(state)
        state.pop("lm_head.weight", None)
        state.pop("model.norm.weight")
    if setup == "world" and rank == 1:
        os.environ["WORLD_SIZE"] = "3"
    if setup == "shared":
        os.chdir(os.path.join(os.path.dirname(out), f"cwd{rank}"))
        out = "out"  # each rank's "out" is another folder: not shared
    try:
        shardkit.save_sharded(state, out, max_shard_size=20_000, process_group=dist.group.WORLD)
    except ShardkitError as e:
        Path(report).with_suffix(f".{rank}").write_text(str(e))
        return
    raise AssertionError("no error")


@pytest.mark.slow
@pytest.mark.parametrize("setup, words", [
    ("plan", "rank(s) 1 planned different shards than rank 0"),
    ("world", "WORLD_SIZE=3 but the default process group has 2 ranks"),
    ("shared", "must be one folder on a filesystem shared by every rank"),
])
def test_collective_errors_are_one_line_on_every_rank(tmp_path: Path, setup: str, words: str) -> None:
    for r in (0, 1):
        (tmp_path / f"cwd{r}").mkdir()
    run_ranks(tmp_path, _expect_error, str(tmp_path / "out"), setup, str(tmp_path / "report"))
    for r in (0, 1):
        message = (tmp_path / f"report.{r}").read_text()
        assert words in message and "\n" not in message, message
    leftovers = [p for p in tmp_path.rglob("*") if "shardkit-tmp" in p.name or p.name == "out"]
    assert leftovers == []


# ----------------------------------------------------------------------------- rank-local loading

def _load_rank(rank: int, world: int, ckpt: str, report: str) -> None:
    from torch.distributed.tensor import DTensor

    import shardkit

    model = _fsdp(_tiny_llama())
    for p in model.parameters():
        p.data.to_local().zero_() if isinstance(p.data, DTensor) else p.data.zero_()
    done = shardkit.load_into(model, ckpt)
    full = _tiny_llama().state_dict()
    local_bytes = 0
    for name, t in model.state_dict().items():
        assert isinstance(t, DTensor), name
        assert torch.equal(t.full_tensor(), full[name]), name
        local = t.to_local()
        local_bytes += local.numel() * local.element_size()
    Path(report).with_suffix(f".{rank}").write_text(f"{done.read_bytes} {local_bytes} {done.global_bytes}")


def test_rank_local_loading_reads_only_each_ranks_slice(one_start: Path) -> None:
    reads = [tuple(map(int, (one_start / f"report.{r}").read_text().split())) for r in (0, 1)]
    for read_bytes, local_bytes, global_bytes in reads:
        assert read_bytes == local_bytes < global_bytes
    assert sum(r[0] for r in reads) == reads[0][2]  # the two ranks' slices tile every tensor once


def test_slice_runs_are_one_read_per_contiguous_run() -> None:
    from shardkit.distributed.rank_load import slice_runs

    assert list(slice_runs((8, 4), (4, 0), (4, 4))) == [(16, 16, 0)]
    assert list(slice_runs((2, 3, 4), (0, 1, 0), (2, 2, 4))) == [(4, 8, 0), (16, 8, 8)]
    assert list(slice_runs((), (), ())) == [(0, 1, 0)]


def _subgroup_rank(rank: int, world: int, out: str) -> None:
    import shardkit

    os.environ["WORLD_SIZE"] = str(world)  # as torchrun sets it: the default group's size, not the subgroup's
    sub = dist.new_group([1])  # every rank creates it; only rank 1 is in it (rank 0 of the subgroup)
    if rank == 1:
        state = {f"w{i}": torch.full((10, 10), float(i)) for i in range(4)}
        shardkit.save_sharded(state, out, max_shard_size=800, process_group=sub)
    dist.barrier()


def test_collective_save_over_a_subgroup_is_accepted(one_start: Path) -> None:
    from safetensors.torch import load_file

    shards = sorted((one_start / "subgroup").glob("*.safetensors"))
    assert len(shards) == 2
    got = {k: v for p in shards for k, v in load_file(p).items()}
    assert sorted(got) == ["w0", "w1", "w2", "w3"] and torch.equal(got["w3"], torch.full((10, 10), 3.0))


def _manifest_rank(rank: int, world: int, out: str) -> None:
    import shardkit

    state = {f"w{i}": torch.full((10, 10), float(i)) for i in range(4)}
    for manifest in (True, False):  # both in one start of the ranks
        result = shardkit.save_sharded(state, f"{out}-{manifest}", max_shard_size=800, manifest=manifest,
                                       process_group=dist.group.WORLD)
        Path(f"{out}-{manifest}.result{rank}").write_text(str(result.cloned_bytes + result.copied_bytes))


def test_collective_save_obeys_manifest_option_like_one_process(tmp_path: Path, one_start: Path) -> None:
    import shardkit

    state = {f"w{i}": torch.full((10, 10), float(i)) for i in range(4)}
    for manifest in (True, False):
        shardkit.save_sharded(state, tmp_path / f"ref-{manifest}", max_shard_size=800, manifest=manifest)
        out = one_start / f"manifest-{manifest}"
        assert (out / "shardkit.manifest.json").exists() is manifest
        assert _folder_bytes(out) == _folder_bytes(tmp_path / f"ref-{manifest}")
        for r in (0, 1):  # every rank reports the bytes of all ranks' shards
            assert (one_start / f"manifest-{manifest}.result{r}").read_text() == str(4 * 400)


# ----------------------------------------------------------------------------- one start of the ranks

def _every_body_rank(rank: int, world: int, root: str) -> None:
    """The collective bodies above, one after another in one start of the ranks (each rank's start, imports
    of torch, transformers and shardkit, is most of a body's time); each writes under its own folder."""
    _save_rank(rank, world, _tiny_llama, f"{root}/save/out", f"{root}/save/ref", 20_000)
    dist.barrier()
    _uneven_rank(rank, world, f"{root}/uneven")
    dist.barrier()
    _load_rank(rank, world, f"{root}/ckpt", f"{root}/report")
    dist.barrier()
    _subgroup_rank(rank, world, f"{root}/subgroup")
    _manifest_rank(rank, world, f"{root}/manifest")


@pytest.fixture(scope="module")
def one_start(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder where one start of two gloo ranks ran every collective body of this module's default tests."""
    from shardkit import save_sharded

    root = tmp_path_factory.mktemp("ranks")
    (root / "save").mkdir()
    save_sharded(_tiny_llama(), root / "ckpt", max_shard_size=20_000)  # what _load_rank loads
    run_ranks(root, _every_body_rank, str(root))
    return root


# ----------------------------------------------------------------------------- torchrun convert

def _torchrun_convert(src: Path, out: Path, ranks: int, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(ranks), "-m", "shardkit", "convert", str(src), str(out), "--max-shard-size", "10KB",
                           *extra], capture_output=True, text=True, timeout=300)


def _small_dcp(folder: Path) -> None:
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    state = {f"layers.{i}.weight": torch.randn(40, 30) for i in range(6)}
    state["bias"] = torch.randn(7).to(torch.bfloat16)
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)


@pytest.mark.slow  # the default suite checks one clean exit: test_torchrun_convert_of_dcp_equals_single_process_convert
@pytest.mark.parametrize("runs", [3, 20])
def test_torchrun_convert_exits_cleanly_every_time(tmp_path: Path, runs: int) -> None:
    """Each rank ends the process group it started: no 'terminate called without an active exception'."""
    _small_dcp(tmp_path / "dcp")
    for i in range(runs):
        run = _torchrun_convert(tmp_path / "dcp", tmp_path / f"out{i}", 2, "--no-manifest")
        assert run.returncode == 0 and "terminate called" not in run.stderr, f"run {i}: {run.stderr[-3000:]}"
        assert not (tmp_path / f"out{i}" / "shardkit.manifest.json").exists()
        shutil.rmtree(tmp_path / f"out{i}")


@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_torchrun_convert_of_dcp_equals_single_process_convert(tmp_path: Path, ranks: int) -> None:
    import shardkit

    _small_dcp(tmp_path / "dcp")
    shardkit.convert(tmp_path / "dcp", tmp_path / "ref", max_shard_size="10KB")
    run = _torchrun_convert(tmp_path / "dcp", tmp_path / "out", ranks)
    assert run.returncode == 0 and "terminate called" not in run.stderr, run.stderr[-3000:]  # a clean exit too
    assert len(list((tmp_path / "out").glob("*.safetensors"))) == 3  # fewer shards than 4 ranks: one rank writes none
    assert _folder_bytes(tmp_path / "out") == _folder_bytes(tmp_path / "ref")
