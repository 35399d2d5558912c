"""Device maps: which module goes to which GPU, the CPU or disk, computed by accelerate.

``plan_device_map`` builds a meta skeleton, lets accelerate's ``get_balanced_memory`` and
``infer_auto_device_map`` place it, and returns a :class:`DevicePlan` that renders as a table.
Planning needs no GPU: ``max_memory`` may name devices this machine does not have.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..devices import Device, device_label, parse_device, parse_max_memory
from ..errors import InvalidInputError, Option, Part, ShardkitError
from ..units import format_count, format_size

if TYPE_CHECKING:
    import os

    import torch

    from ..devices import DeviceMapStrategy, MaxMemory
    from .lazy import LazyCheckpoint
    from .skeleton import ConfigSpec, ModelSpec

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
_BAR_WIDTH = 28


def infer_device_map(skeleton: torch.nn.Module, strategy: str, *, max_memory: dict[Device, int] | None,
                     no_split_module_classes: list[str] | None = None) -> dict[str, Device]:
    """Run accelerate's placement for ``strategy`` on a skeleton whose dtypes are already final."""
    from accelerate.utils import get_balanced_memory, infer_auto_device_map

    if strategy == "cpu":
        return {"": "cpu"}
    if strategy not in STRATEGIES:
        raise InvalidInputError(
            f"unknown device_map {strategy!r}: use one of {', '.join(STRATEGIES)}, 'cpu' or a dict of module → device"
        )
    no_split = list(no_split_module_classes if no_split_module_classes is not None
                    else getattr(skeleton, "_no_split_modules", None) or [])
    budget = dict(max_memory) if max_memory is not None else None
    if strategy != "sequential":
        budget = get_balanced_memory(skeleton, max_memory=budget, no_split_module_classes=no_split,
                                     low_zero=strategy == "balanced_low_0")
    return dict(infer_auto_device_map(skeleton, max_memory=budget, no_split_module_classes=no_split))


@dataclass
class DevicePlan:
    """Where each module goes, and how many bytes land on each device.

    Returned by :func:`plan_device_map`; ``table()`` renders it for people, ``to_dict()`` as JSON.
    Devices are GPU indices (``0``, ``1``...), ``"mps"``, ``"cpu"`` or ``"disk"``.

    Attributes:
        model: the model's class name.
        strategy: the placement strategy (``"auto"``, ``"balanced"``...).
        dtype: the dtype the sizes assume (``"bfloat16"``...), or the dominant one of the model.
        device_map: module name → device, as accelerate's ``device_map`` takes it.
        module_bytes: module name → bytes of its parameters and buffers.
        max_memory: the budget per device, in bytes.
        total_bytes: bytes of the whole model.
        parameters: the number of parameters.
        checkpoint: the checkpoint the sizes came from, if one was given.
        device_bytes: device → bytes placed there (computed from the map when not given).
    """

    model: str
    strategy: str
    dtype: str | None
    device_map: dict[str, Device]
    module_bytes: dict[str, int]
    max_memory: dict[Device, int]
    total_bytes: int
    parameters: int
    checkpoint: str | None = None
    device_bytes: dict[Device, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.device_bytes:
            for name, device in self.device_map.items():
                self.device_bytes[device] = self.device_bytes.get(device, 0) + self.module_bytes.get(name, 0)

    @property
    def offloaded_bytes(self) -> int:
        """Bytes kept off the accelerators (CPU and disk); with no accelerator, bytes on disk."""
        has_gpu = any(isinstance(d, int) or d == "mps" for d in [*self.max_memory, *self.device_bytes])
        off = ("cpu", "disk") if has_gpu else ("disk",)
        return sum(b for d, b in self.device_bytes.items() if d in off)

    def devices(self) -> list[Device]:
        """Devices in accelerate's order: accelerators, then CPU, then disk."""
        seen = list(dict.fromkeys([*self.max_memory, *self.device_bytes]))
        order = {"mps": 1, "cpu": 2, "disk": 3}
        return sorted(seen, key=lambda d: (0, d) if isinstance(d, int) else (order.get(d, 4), 0))

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict: the fields, ``offloaded_bytes``, per-device totals and per-module rows."""
        return {
            "model": self.model,
            "checkpoint": self.checkpoint,
            "strategy": self.strategy,
            "dtype": self.dtype,
            "parameters": self.parameters,
            "total_bytes": self.total_bytes,
            "offloaded_bytes": self.offloaded_bytes,
            "devices": [
                {"device": d, "bytes": self.device_bytes.get(d, 0), "max_memory_bytes": self.max_memory.get(d)}
                for d in self.devices()
            ],
            "device_map": {name: device for name, device in self.device_map.items()},
            "modules": [{"name": n, "device": d, "bytes": self.module_bytes.get(n, 0)} for n, d in self.device_map.items()],
        }

    def table(self) -> str:
        """A readable placement: module rows (numbered runs grouped), then per-device bars."""
        head = (f"{self.model}: {format_count(self.parameters)} parameters, {format_size(self.total_bytes)}"
                f"{' in ' + self.dtype if self.dtype else ''}, device_map={self.strategy}")
        rows = group_rows(self.device_map, self.module_bytes)
        width = max([len("module"), *(len(r[0]) for r in rows)])
        lines = [head, "", f"  {'module':<{width}}  {'device':<7}  {'size':>10}"]
        lines += [f"  {name:<{width}}  {device_label(dev):<7}  {format_size(size):>10}" for name, dev, size in rows]
        lines += ["", f"  {'device':<7}  {'placed':>10}  {'limit':>10}"]
        for device in self.devices():
            placed = self.device_bytes.get(device, 0)
            limit = self.max_memory.get(device)
            scale = limit or self.total_bytes or 1
            filled = min(_BAR_WIDTH, round(_BAR_WIDTH * placed / scale))
            bar = "█" * filled + "░" * (_BAR_WIDTH - filled)
            limit_text = format_size(limit) if limit else "-"
            lines.append(f"  {device_label(device):<7}  {format_size(placed):>10}  {limit_text:>10}  {bar}")
        off = self.offloaded_bytes
        lines += ["", f"offloaded to CPU/disk: {format_size(off)}" if off else "offloaded: nothing (all on accelerators)"]
        return "\n".join(lines)


def group_rows(device_map: dict[str, Device], module_bytes: dict[str, int]) -> list[tuple[str, Device, int]]:
    """Collapse runs like ``blocks.0 … blocks.18`` on one device into ``blocks.0-18``."""
    rows: list[tuple[str, Device, int]] = []
    run: tuple[str, int, int, Device, int] | None = None  # parent, first, last, device, bytes
    for name, device in device_map.items():
        parent, _, last = name.rpartition(".")
        size = module_bytes.get(name, 0)
        if run and last.isdigit() and run[0] == parent and run[3] == device and int(last) == run[2] + 1:
            run = (parent, run[1], int(last), device, run[4] + size)
            continue
        if run:
            rows.append(_run_row(run))
            run = None
        if parent and last.isdigit():
            run = (parent, int(last), int(last), device, size)
        else:
            rows.append((name or "(whole model)", device, size))
    if run:
        rows.append(_run_row(run))
    return rows


def _run_row(run: tuple[str, int, int, Device, int]) -> tuple[str, Device, int]:
    parent, first, last, device, size = run
    label = f"{parent}.{first}" if first == last else f"{parent}.{first}-{last}"
    return label, device, size


def plan_device_map(model: ModelSpec, *, config: ConfigSpec | None = None,
                    checkpoint: str | os.PathLike[str] | LazyCheckpoint | None = None, max_memory: MaxMemory,
                    dtype: str | torch.dtype | None = None, device_map: DeviceMapStrategy | str = "auto",
                    no_split_module_classes: list[str] | None = None, strict: bool = True) -> DevicePlan:
    """Compute, without loading a byte, where each module of ``model`` would go.

    The model is built on the meta device and placed by accelerate. With ``checkpoint`` the
    dtypes and sizes come from its headers (``dtype`` still overrides) and its keys are checked
    against the skeleton. Devices in ``max_memory`` need not exist here: a plan for two GPUs
    can be made on a laptop.

    Args:
        model: a ``"diffusers:Class"`` / ``"transformers:Class"`` string or class (with
            ``config``), any ``nn.Module`` factory, or a skeleton on the meta device.
        config: the model's config: a dict, a ``config.json`` path or the folder holding it.
        checkpoint: a path for :func:`shardkit.open` or an open checkpoint; optional.
        max_memory: the budget per device, e.g. ``{0: "16GB", "cpu": "64GB"}`` (sizes as
            :func:`shardkit.parse_size` reads them).
        dtype: the dtype to size the weights in (``"bf16"``, ``torch.float16``...); None keeps
            the checkpoint's or the model's.
        device_map: the strategy: ``"auto"``, ``"balanced"``, ``"balanced_low_0"``,
            ``"sequential"`` or ``"cpu"``.
        no_split_module_classes: module classes kept whole on one device; None uses the
            model's ``_no_split_modules``.
        strict: refuse a checkpoint with missing, unexpected or mis-shaped tensors (as
            :func:`~shardkit.loading.load.load_model` does); with False they only warn.

    Returns:
        A :class:`DevicePlan`.

    Raises:
        InvalidInputError: ``max_memory`` is missing or invalid, ``device_map`` is not a
            strategy name, the model cannot be built, or accelerate cannot place it.
        KeyMismatchError: with ``strict``, the checkpoint's keys or shapes do not match the model.

    plan = plan_device_map("diffusers:FluxTransformer2DModel", config="flux/config.json",
                           max_memory={0: "16GB", 1: "16GB", "cpu": "64GB"}, dtype="bf16")
    print(plan.table())
    """
    from ..formats.dtypes import resolve_torch_dtype
    from .keys import prepare_skeleton
    from .lazy import LazyCheckpoint
    from .opening import open_checkpoint
    from .skeleton import default_config

    config = default_config(model, checkpoint, config)  # CHECKPOINT/config.json, as load_model and `plan` do
    budget = parse_max_memory(max_memory)
    if not budget:
        raise InvalidInputError("planning needs max_memory, e.g. {0: '16GB', 'cpu': '64GB'}")
    target = resolve_torch_dtype(dtype)
    with contextlib.ExitStack() as stack:
        ckpt = checkpoint if checkpoint is None or isinstance(checkpoint, LazyCheckpoint) else \
            stack.enter_context(open_checkpoint(checkpoint))
        skeleton, _, description = prepare_skeleton(model, ckpt, config=config, dtype=target, strict=strict)
    if not isinstance(device_map, str):
        raise InvalidInputError("plan_device_map computes a device map; pass a strategy name, not a dict")
    return _plan_skeleton(skeleton, device_map, budget, dtype=target, checkpoint=description,
                          no_split_module_classes=no_split_module_classes)


def _plan_skeleton(skeleton: torch.nn.Module, strategy: str, budget: dict[Device, int], *, dtype: torch.dtype | None,
                   checkpoint: str | None, no_split_module_classes: list[str] | None) -> DevicePlan:
    """Place a skeleton whose dtypes are final and measure what lands where."""
    from accelerate.utils import compute_module_sizes

    try:
        # accelerate logs a warning for each GPU this machine lacks; planning for them is the point,
        # and the CLI quiets accelerate's logger (the library leaves it alone).
        mapping = infer_device_map(skeleton, strategy, max_memory=budget, no_split_module_classes=no_split_module_classes)
    except ShardkitError:
        raise
    except (ValueError, RuntimeError) as e:
        raise InvalidInputError(f"accelerate could not place {type(skeleton).__name__}: {e}") from e
    sizes = compute_module_sizes(skeleton)
    return DevicePlan(
        model=type(skeleton).__name__, strategy=strategy,
        dtype=str(dtype).removeprefix("torch.") if dtype is not None else _dominant_dtype(skeleton),
        device_map=mapping, module_bytes={n: int(sizes.get(n, 0)) for n in mapping}, max_memory=budget,
        total_bytes=int(sizes[""]), parameters=sum(p.numel() for p in skeleton.parameters()),
        checkpoint=checkpoint,
    )


def _dominant_dtype(skeleton: torch.nn.Module) -> str | None:
    counts: dict[str, int] = {}
    for p in skeleton.parameters():
        key = str(p.dtype).removeprefix("torch.")
        counts[key] = counts.get(key, 0) + p.numel()
    return max(counts, key=counts.__getitem__) if counts else None


def check_devices_exist(devices: list[Device], *, where: Part, fix: tuple[Part, ...] | None = None) -> None:
    """Loading needs real devices (planning does not); ``fix`` replaces the advice after the ';'."""
    import torch

    if not any(isinstance(device, int) for device in devices):
        count = 0  # not asked: counting GPUs initialises the CUDA driver, which a host-only load never needs
    else:
        count = torch.cuda.device_count()
    for device in devices:
        if isinstance(device, int) and device >= count:
            have = f"GPUs 0-{count - 1}" if count else "no GPU"
            raise InvalidInputError(
                where, f" names GPU {device}, but this machine has {have}; ", *(fix or ("remove it, or use "
                "'shardkit plan' / shardkit.plan_device_map to plan for hardware you do not have",))
            )
        if device == "mps" and not torch.backends.mps.is_available():
            raise InvalidInputError(where, " names 'mps', which is not available on this machine")


def resolve_device_map(skeleton: torch.nn.Module, device_map: object, *, max_memory: dict[Device, int] | None,
                       no_split_module_classes: list[str] | None) -> dict[str, Device]:
    """A strategy name, "cpu", one device (``0``, ``"cuda"``, ``"cuda:1"``, a ``torch.device``) or an
    explicit dict → a complete module → device dict."""
    if device_map is None:
        device_map = "auto" if max_memory else "cpu"
    if isinstance(device_map, dict):
        return {name: parse_device(device) for name, device in device_map.items()}
    if isinstance(device_map, str) and device_map.strip().lower() in (*STRATEGIES, "cpu"):
        return infer_device_map(skeleton, device_map.strip().lower(), max_memory=max_memory,
                                no_split_module_classes=no_split_module_classes)
    return {"": single_device(device_map)}


def single_device(device_map: object) -> Device:
    """One device for the whole model, as transformers' ``from_pretrained`` takes it: ``0``, ``"cuda"``
    (GPU 0), ``"cuda:1"``, ``torch.device("cuda", 1)``, ``"mps"``.

    >>> single_device("cuda"), single_device(1), single_device("cuda:2")
    (0, 1, 2)
    """
    bare_cuda = device_map == "cuda" or (type(device_map).__name__ == "device" and str(device_map) == "cuda")
    try:
        device = parse_device(0 if bare_cuda else device_map)
    except InvalidInputError:
        raise InvalidInputError(
            f"unknown device_map {device_map!r}: use one of {', '.join(STRATEGIES)}, 'cpu', one device "
            "(0, 'cuda', 'cuda:1') or a dict of module → device"
        ) from None
    if device == "disk":
        raise InvalidInputError(Option("device_map", "disk"), " puts no weight anywhere it can run: use ",
                                Option("device_map", "auto"), " "
                                "with max_memory and offload_folder to spill what does not fit to disk")
    return device


def module_device(device_map: dict[str, Device], name: str) -> Device:
    """The device of tensor ``name``: the entry of its longest module prefix."""
    parts = name.split(".")
    for cut in range(len(parts), -1, -1):
        prefix = ".".join(parts[:cut])
        if prefix in device_map:
            return device_map[prefix]
    raise InvalidInputError(f"device_map gives no device for {name!r}; add it (or one of its parent modules)")
