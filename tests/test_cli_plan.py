"""``shardkit plan`` through the real CLI entry point."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
from conftest import SHARDKIT_BIN, assert_one_line_error, tiny_unet
from helpers_load import FLUX_DEV_CONFIG, save_model, write_config


@pytest.fixture(scope="module")
def flux_config(tmp_path_factory) -> str:
    return str(write_config(tmp_path_factory.mktemp("flux"), FLUX_DEV_CONFIG))


def test_flux_docs_scenario_table(run_cli, flux_config) -> None:
    for budget in ("0=16GB,1=16GB,cpu=64GB", "0=16GB,1=16GB"):
        result = run_cli("plan", "--model", "diffusers:FluxTransformer2DModel", "--config", flux_config,
                         "--max-memory", budget, "--dtype", "bf16")
        assert result.exit_code == 0, result.stderr
        assert "11.90B parameters" in result.stdout and "GPU 0" in result.stdout and "GPU 1" in result.stdout
        assert "offloaded: nothing" in result.stdout
        assert "not available" not in result.stderr, "planning for absent GPUs must not warn"


def test_json_output_and_strategy_choice(run_cli, flux_config) -> None:
    result = run_cli("plan", "--model", "diffusers:FluxTransformer2DModel", "--config", flux_config,
                     "--max-memory", "0=8GB,1=8GB,cpu=64GB", "--dtype", "bf16", "--device-map", "balanced_low_0", "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["strategy"] == "balanced_low_0" and doc["dtype"] == "bfloat16"
    devices = {d["device"]: d for d in doc["devices"]}
    assert devices[0]["bytes"] <= 8e9 and devices["cpu"]["bytes"] == doc["offloaded_bytes"] > 0
    assert sum(d["bytes"] for d in doc["devices"]) == doc["total_bytes"]


def test_checkpoint_argument_uses_its_config_and_dtypes(run_cli, tmp_path) -> None:
    folder = save_model(tiny_unet(), tmp_path / "unet", dtype="fp16")
    result = run_cli("plan", folder, "--model", "diffusers:UNet2DConditionModel", "--max-memory", "0=1MB,cpu=1GB", "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["dtype"] == "float16" and str(folder) in doc["checkpoint"]


def test_strategies_table(run_cli, tmp_path) -> None:
    folder = save_model(tiny_unet(), tmp_path / "unet")
    result = run_cli("plan", folder, "--model", "diffusers:UNet2DConditionModel", "--gpu", "1MB", "--strategies", "--json")
    assert result.exit_code == 0, result.stderr
    assert "strategies" in json.loads(result.stdout)
    result = run_cli("plan", folder, "--model", "diffusers:UNet2DConditionModel", "--gpu", "1MB", "--strategies",
                     "--max-memory", "0=1MB,cpu=1GB")
    assert result.exit_code == 0, result.stderr
    assert "GPU 0" in result.stdout and len(result.stdout.splitlines()) > 10


@pytest.mark.parametrize("args, needle", [
    (["--max-memory", "0:16GB"], "unparseable max memory"),
    (["--max-memory", "0=16XB"], "invalid max memory"),
    (["--max-memory", "tpu=1GB"], "unknown device"),
    ([], "--max-memory"),
    (["--max-memory", "0=16GB", "--gpu", "8GB"], "GPU 0 is given twice"),
    (["--max-memory", "cpu=16GB", "--cpu", "8GB"], "CPU is given twice"),
    (["--gpu", "8GB", "--dtype", "fp8_e4m3"], "not a compute dtype"),
])
def test_bad_options_are_one_line_errors(run_cli, flux_config, args, needle) -> None:
    result = run_cli("plan", "--model", "diffusers:FluxTransformer2DModel", "--config", flux_config, *args)
    assert_one_line_error(result, contains=needle)


def test_unknown_class_and_missing_checkpoint(run_cli, tmp_path) -> None:
    assert_one_line_error(run_cli("plan", "--model", "diffusers:NoSuchModel", "--max-memory", "0=1GB"),
                          contains="unknown model class")
    assert_one_line_error(run_cli("plan", "--model", "nomodule", "--max-memory", "0=1GB"), contains="unknown model class")
    assert_one_line_error(run_cli("plan", tmp_path / "nope", "--model", "diffusers:UNet2DConditionModel",
                                  "--config", tmp_path, "--max-memory", "0=1GB"), contains="nope")


MEASURE = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:]); "
           "print(done.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)")


@pytest.mark.slow
def test_flux_plan_process_stays_under_600mb(flux_config) -> None:
    """The 12B skeleton plans in a fresh process, imports included, under 600 MB peak RSS."""
    done = subprocess.run([sys.executable, "-c", MEASURE, SHARDKIT_BIN, "plan", "--model", "diffusers:FluxTransformer2DModel",
                           "--config", flux_config, "--max-memory", "0=16GB,1=16GB", "--dtype", "bf16"],
                          capture_output=True, text=True, timeout=300)
    code, peak_bytes = map(int, done.stdout.split()[-2:])
    assert code == 0, done.stderr
    assert peak_bytes < 600 * 2**20, peak_bytes


def test_strategies_json_gives_every_byte_count_as_an_integer(run_cli, tmp_path) -> None:
    folder = save_model(tiny_unet(), tmp_path / "unet")
    result = run_cli("plan", folder, "--model", "diffusers:UNet2DConditionModel", "--gpu", "1MB", "--strategies",
                     "--json")
    assert result.exit_code == 0, result.stderr

    def byte_counts(node, path=""):
        if isinstance(node, dict):
            for key, value in node.items():
                yield from byte_counts(value, f"{path}.{key}")
                if key.endswith("bytes"):
                    yield f"{path}.{key}", value
        elif isinstance(node, list):
            for i, value in enumerate(node):
                yield from byte_counts(value, f"{path}[{i}]")

    counts = dict(byte_counts(json.loads(result.stdout)))
    assert counts and all(isinstance(v, int) for v in counts.values() if v is not None), counts


def test_gpu_and_cpu_flags_are_the_max_memory_budget(run_cli, flux_config) -> None:
    """--gpu/--cpu and --max-memory are two spellings of one budget; mixing them is fine if they agree."""
    base = ["plan", "--model", "diffusers:FluxTransformer2DModel", "--config", flux_config, "--json"]
    docs = [json.loads(run_cli(*base, *budget).stdout) for budget in (
        ["--max-memory", "0=8GB,1=8GB,cpu=64GB", "--dtype", "bf16"],
        ["--gpu", "8GB", "--gpu", "8GB", "--cpu", "64GB", "--dtype", "bfloat16"],
        ["--max-memory", "cpu=64GB", "--gpu", "8GB", "--gpu", "8GB", "--dtype", "BF16"],
        ["--max-memory", "0=8GB,1=8GB,cpu=64GB", "--gpu", "8GB", "--dtype", "bf16"],
    )]
    assert all(doc == docs[0] for doc in docs[1:])
    assert [d["max_memory_bytes"] for d in docs[0]["devices"]] == [8 * 10**9, 8 * 10**9, 64 * 10**9]


def test_quiet_prints_one_line_per_result(run_cli, tmp_path) -> None:
    folder = save_model(tiny_unet(), tmp_path / "unet")
    result = run_cli("plan", folder, "--model", "diffusers:UNet2DConditionModel", "--gpu", "10KB", "--cpu", "1GB",
                     "--strategies", "-q")
    assert result.exit_code == 0, result.stderr
    placement, strategies = result.stdout.splitlines()
    assert placement.startswith("GPU 0 ") and ", CPU " in placement
    assert strategies == "no strategy fits"
    result = run_cli("plan", folder, "--model", "diffusers:UNet2DConditionModel", "--gpu", "1GB", "--strategies",
                     "--quiet")
    assert result.stdout.splitlines()[-1] == "fastest that fits: gpu"


_FREED = """
import sys
from shardkit.cli.run import map_large_blocks
if sys.argv[1] == "mapped":
    map_large_blocks()
def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) // 1024
warm = bytearray(8 << 20)
del warm                                    # glibc raises its mmap threshold to 8 MiB here
keep, big = [], []
for _ in range(16):
    big.append(bytearray(4 << 20))
    keep.append(bytearray(200 << 10))       # small blocks after each: the heap cannot shrink from its top
before = rss_mb()
del big
print(before - rss_mb())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_a_plan_worker_gives_freed_large_blocks_back() -> None:
    """`shardkit run` maps blocks of 1 MiB and more (as MALLOC_MMAP_THRESHOLD_=1048576 does): freed, they leave
    the process, where glibc's own threshold would keep 64 MiB of freed 4 MiB blocks in the heap."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}

    def freed_mb(mode: str) -> int:
        proc = subprocess.run([sys.executable, "-c", _FREED, mode], capture_output=True, text=True, env=env, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return int(proc.stdout)

    assert freed_mb("mapped") >= 60
    assert freed_mb("default") < 30  # what the setting changes (glibc keeps them)
