"""shardkit.devices: the one device and max_memory parser, and every caller going through it."""

from __future__ import annotations

import pytest

from shardkit.devices import device_label, gpu_and_cpu_bytes, parse_device, parse_max_memory
from shardkit.errors import InvalidInputError, InvalidSizeError

GB = 10**9


@pytest.mark.parametrize("key,expected", [(0, 0), ("0", 0), (" 3 ", 3), ("cuda:1", 1), ("gpu:0", 0), ("GPU:2", 2),
                                          ("cpu", "cpu"), ("CPU", "cpu"), ("disk", "disk"), ("mps", "mps")])
def test_parse_device_accepts_every_spelling(key, expected) -> None:
    assert parse_device(key) == expected


def test_parse_device_accepts_torch_devices() -> None:
    import torch

    assert parse_device(torch.device("cuda", 1)) == 1
    assert parse_device(torch.device("cpu")) == "cpu"
    with pytest.raises(InvalidInputError, match="unknown device"):
        parse_device(torch.device("cuda"))  # which GPU is ambiguous, as with the string "cuda"


@pytest.mark.parametrize("key", [-1, True, "tpu", "cuda", "cuda:x", "gpu:-1", ""])
def test_parse_device_refuses_unknown_keys_in_one_line(key) -> None:
    with pytest.raises(InvalidInputError, match="unknown device") as info:
        parse_device(key)
    assert "\n" not in str(info.value)


def test_parse_max_memory_strings_and_dicts() -> None:
    assert parse_max_memory("0=16GB, 1=16GB,cpu=64GB") == {0: 16 * GB, 1: 16 * GB, "cpu": 64 * GB}
    assert parse_max_memory({"cuda:1": "2GiB", "disk": 5, 0: "1.5GB"}) == {1: 2 * 2**30, "disk": 5, 0: 1_500_000_000}
    assert parse_max_memory("gpu:0=1GB") == {0: GB}
    assert parse_max_memory(None) is None


@pytest.mark.parametrize("bad", ["0:16GB", "0=", "=16GB", "tpu=1GB", "0=1GB,0=2GB", ",", "0=lots", "-1=1GB",
                                 "gpu:0=1GB,0=1GB"])
def test_unparseable_max_memory_is_one_line_error(bad: str) -> None:
    with pytest.raises((InvalidInputError, InvalidSizeError)) as info:
        parse_max_memory(bad)
    assert "\n" not in str(info.value)


def test_gpu_and_cpu_bytes_orders_gpus_by_index() -> None:
    assert gpu_and_cpu_bytes(parse_max_memory({"cuda:1": "8GB", "gpu:0": "16GB", "cpu": "32GB"})) == (
        (16 * GB, 8 * GB), 32 * GB)
    assert gpu_and_cpu_bytes({0: 1}) == ((1,), None)
    with pytest.raises(InvalidInputError, match="disk"):
        gpu_and_cpu_bytes({0: 1, "disk": 5})


def test_device_label() -> None:
    assert [device_label(d) for d in (0, "cpu", "disk")] == ["GPU 0", "CPU", "disk"]


@pytest.mark.parametrize("spelling", [{"gpu:0": "1MB"}, {"cuda:0": "1MB"}, {0: "1MB"}, "0=1MB", "gpu:0=1MB"])
def test_plan_device_map_takes_every_spelling(spelling) -> None:
    """The planner parses max_memory through the same parser (no second parser that knows fewer keys)."""
    from conftest import TINY_UNET_CONFIG

    import shardkit

    plan = shardkit.plan_device_map("diffusers:UNet2DConditionModel", config=TINY_UNET_CONFIG,
                                    max_memory=spelling)
    assert plan.max_memory == {0: 10**6}


def test_merge_budgets_joins_both_spellings_and_refuses_conflicts() -> None:
    from shardkit.devices import merge_budgets

    assert merge_budgets("0=16GB,cpu=64GB", gpu_bytes=[16 * GB]) == {0: 16 * GB, "cpu": 64 * GB}
    assert merge_budgets({"cpu": "1GB"}, gpu_bytes=[GB, 2 * GB]) == {"cpu": GB, 0: GB, 1: 2 * GB}
    assert merge_budgets(None, cpu_bytes=GB) == {"cpu": GB}
    assert merge_budgets(None) is None
    with pytest.raises(InvalidInputError, match="GPU 1 is given twice") as info:
        merge_budgets("1=16GB", gpu_bytes=[GB, GB])
    assert "\n" not in str(info.value) and "give it once" in str(info.value)
    with pytest.raises(InvalidInputError, match="1000000001 B"):  # sizes that print alike are shown in bytes
        merge_budgets({"cpu": GB}, cpu_bytes=GB + 1)
