"""The one device and ``max_memory`` parser: every command and API call goes through it.

Device keys: ``0``, ``"0"``, ``"cuda:1"``, ``"gpu:0"`` → GPU index; ``"cpu"``, ``"disk"``,
``"mps"`` as they are. Sizes: ``"16GB"`` (decimal), ``"2GiB"`` (binary) or an int of bytes.

>>> parse_max_memory("gpu:0=16GB,cpu=2GiB")
{0: 16000000000, 'cpu': 2147483648}
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from .errors import InvalidInputError, Option
from .units import format_size, parse_size

if TYPE_CHECKING:
    import torch

# A parsed device key (what parse_device returns): an int (accelerator index), or "cpu", "disk", "mps".
Device: TypeAlias = "int | str"
# What a caller may name a device by: an index, "cuda:1", "gpu:0", "cpu", a torch.device...
DeviceKey: TypeAlias = "int | str | torch.device"
# What the public functions take (``load_model``, ``load_pipeline``, ``plan_device_map``, ``fit``):
# a device key (``0``, ``"cuda:1"``, ``"gpu:0"``, ``"cpu"``, ``"disk"``...) → a size (``"16GB"``, bytes).
MaxMemory: TypeAlias = "Mapping[int | str, int | str]"
# A placement strategy, one device for everything, or module name → device key.
DeviceMapStrategy = Literal["auto", "balanced", "balanced_low_0", "sequential", "cpu", "cuda"]
DeviceMap: TypeAlias = "DeviceMapStrategy | str | int | Mapping[str, int | str]"
# A budget as a caller writes it, checked by :func:`parse_max_memory`: ``"0=16GB,cpu=64GB"`` or a mapping
# of device keys to sizes (keys typed loosely: a ``dict[int, str]`` or ``dict[str, int]`` must be accepted).
Budgets: TypeAlias = "str | Mapping[Any, Any]"
NAMED_DEVICES = ("cpu", "disk", "mps")


def parse_device(key: Any) -> Device:  # Any: a user's key, checked here
    """Normalize one device key.

    Args:
        key: ``0``, ``"0"``, ``"cuda:0"``, ``"gpu:0"``, a ``torch.device``, ``"cpu"``, ``"disk"`` or ``"mps"``.

    Returns:
        The GPU index as an int, or the device name as a lower-case string.

    >>> parse_device("cuda:1"), parse_device("gpu:0"), parse_device("CPU")
    (1, 0, 'cpu')
    """
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return key
    if type(key).__name__ == "device" and hasattr(key, "type"):  # torch.device, without importing torch
        # An index-less torch.device("cuda") is refused like the string "cuda": which GPU is ambiguous.
        key = key.index if key.type == "cuda" else key.type
    text = str(key).strip().lower()
    if text.isdigit():
        return int(text)
    match = re.fullmatch(r"(?:cuda|gpu):(\d+)", text)
    if match:
        return int(match.group(1))
    if text in NAMED_DEVICES:
        return text
    raise InvalidInputError(
        f"unknown device {key!r}: use a GPU index (0, 'cuda:1', 'gpu:0'), 'cpu', 'disk' or 'mps'"
    )


def parse_max_memory(value: Budgets | None) -> dict[Device, int] | None:
    """Parse a memory budget per device into bytes.

    Args:
        value: ``"0=16GB,1=16GB,cpu=64GB"`` or ``{0: "16GB", "cuda:1": 16e9, "cpu": "64GB"}``; ``None`` passes through.

    Returns:
        ``{device: bytes}`` with keys normalized by :func:`parse_device`, or ``None``.

    >>> parse_max_memory("0=16GB,cpu=2GiB")
    {0: 16000000000, 'cpu': 2147483648}
    """
    if value is None:
        return None
    out: dict[Device, int] = {}
    for device, size in _pairs(value):
        key = parse_device(device)
        if key in out:
            raise InvalidInputError(f"max memory names device {key!r} twice")
        out[key] = parse_size(size.strip() if isinstance(size, str) else size, name=f"max memory for {key!r}")
    return out


def _pairs(value: Budgets) -> list[tuple[Any, Any]]:
    if isinstance(value, Mapping):
        return list(value.items())
    if not isinstance(value, str):
        raise InvalidInputError(f"max_memory must be a dict or a 'DEVICE=SIZE,...' string, got {type(value).__name__}")
    pairs = []
    for part in filter(None, (p.strip() for p in value.split(","))):
        device, sep, size = part.partition("=")
        if not sep or not size.strip():
            raise InvalidInputError(
                f"unparseable max memory {value!r}: write DEVICE=SIZE pairs separated by commas, "
                "e.g. '0=16GB,1=16GB,cpu=64GB'"
            )
        pairs.append((device, size))
    if not pairs:
        raise InvalidInputError(f"unparseable max memory {value!r}: give at least one DEVICE=SIZE pair, e.g. '0=16GB'")
    return pairs


def merge_budgets(max_memory: Budgets | None, *, gpu_bytes: tuple[int, ...] | list[int] = (),
                  cpu_bytes: int | None = None) -> dict[Device, int] | None:
    """One budget from its two spellings: ``max_memory`` and per-GPU/CPU sizes (``--gpu``/``--cpu``).

    Args:
        max_memory: as for :func:`parse_max_memory`.
        gpu_bytes: GPU budgets in bytes, GPU 0 first.
        cpu_bytes: the CPU budget in bytes.

    Returns:
        The merged ``{device: bytes}``, or ``None`` when neither spelling gave anything.

    Raises:
        InvalidInputError: both spellings give the same device different sizes.

    >>> merge_budgets("cpu=2GB", gpu_bytes=[10**9])
    {'cpu': 2000000000, 0: 1000000000}
    """
    merged = dict(parse_max_memory(max_memory) or {})
    flags: dict[Device, int] = dict(enumerate(gpu_bytes))
    if cpu_bytes is not None:
        flags["cpu"] = cpu_bytes
    for device, size_bytes in flags.items():
        if device in merged and merged[device] != size_bytes:
            a, b = format_size(merged[device]), format_size(size_bytes)
            a, b = (a, b) if a != b else (f"{merged[device]} B", f"{size_bytes} B")
            flag = (("the CPU budget (", Option("cpu"), ")") if isinstance(device, str)
                    else (f"GPU budget number {device + 1} (", Option("gpu"), ")"))
            raise InvalidInputError(
                f"the budget for {device_label(device)} is given twice with different sizes: {a} in max memory "
                "(", Option("max_memory"), f") and {b} as ", *flag, "; give it once"
            )
        merged[device] = size_bytes
    return merged or None


def gpu_and_cpu_bytes(max_memory: dict[Device, int]) -> tuple[tuple[int, ...], int | None]:
    """Split a parsed budget into GPU budgets (ordered by index) and the CPU budget.

    Args:
        max_memory: the result of :func:`parse_max_memory`.

    Returns:
        ``(gpu_bytes_by_index, cpu_bytes_or_None)``; ``disk`` and ``mps`` are refused.

    >>> gpu_and_cpu_bytes({1: 8, 0: 16, "cpu": 32})
    ((16, 8), 32)
    """
    others = [d for d in max_memory if not isinstance(d, int) and d != "cpu"]
    if others:
        raise InvalidInputError(f"max_memory: device(s) {others} cannot hold a fitted model; use GPU indices and 'cpu'")
    gpus = tuple(max_memory[d] for d in sorted(d for d in max_memory if isinstance(d, int)))
    return gpus, max_memory.get("cpu")


def device_label(device: Device) -> str:
    """``0`` → ``"GPU 0"``, ``"cpu"`` → ``"CPU"``, others unchanged."""
    return f"GPU {device}" if isinstance(device, int) else "CPU" if device == "cpu" else str(device)
