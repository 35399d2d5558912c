"""``load_model``: a meta skeleton filled from a lazy checkpoint, dispatched by accelerate.

Flow: skeleton (meta) → keys matched against the checkpoint → dtypes made final on the meta
tensors (free) → device map from accelerate → each tensor read once, straight to its device →
disk tensors get an offload index that points into the shards → ``accelerate.dispatch_model``.
Host memory peaks near the bytes placed on the host: host tensors that need no cast are views of
the shards' memory maps (file-backed pages, read on first use, never copied); tensors that need a
cast are read with ``pread`` one at a time and cast; nothing goes through a whole-shard state dict.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from .errors import InvalidInputError, KeyMismatchError, ShardkitWarning
from .lazy import LazyCheckpoint
from .placement import Device, infer_device_map, parse_device, parse_max_memory
from .skeleton import build_skeleton, cast_floating, keeps_fp32

if TYPE_CHECKING:
    import torch

_SHOWN = 5


@dataclass
class KeyMatch:
    """How model tensor names map to checkpoint names.

    ``loads`` holds one name per storage (tied parameters are re-tied after loading);
    ``source_of`` covers every model name that has data, tied and aliased names included.
    """

    loads: dict[str, str] = field(default_factory=dict)
    source_of: dict[str, str] = field(default_factory=dict)
    tied: list[list[str]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: dict[str, str] = field(default_factory=dict)  # name → "checkpoint [..], model [..]"

    def problems(self) -> str:
        parts = []
        shapes = [f"{name} ({detail})" for name, detail in self.mismatched.items()]
        for label, names in (("missing from the checkpoint", self.missing), ("unexpected", self.unexpected),
                             ("with a different shape", shapes)):
            if names:
                more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
                parts.append(f"{len(names)} key(s) {label}: {', '.join(names[:_SHOWN])}{more}")
        return "; ".join(parts)


def match_keys(skeleton: Any, checkpoint: LazyCheckpoint) -> KeyMatch:
    """Compare the skeleton's state-dict names and shapes with the checkpoint's headers."""
    from accelerate.utils import find_tied_parameters

    state = skeleton.state_dict(keep_vars=True)
    match = KeyMatch(tied=find_tied_parameters(skeleton))
    group_of = {name: group for group in match.tied for name in group}
    aliases = checkpoint.aliases

    def source(name: str) -> str | None:
        if name in checkpoint:
            return name
        return aliases.get(name)

    for name, tensor in state.items():
        src = source(name) or next((s for s in map(source, group_of.get(name, ())) if s), None)
        if src is None:
            if tensor.is_meta:  # buffers built with real values keep them
                match.missing.append(name)
            continue
        match.source_of[name] = src
        if checkpoint.shape_of(src) != tuple(tensor.shape):
            match.mismatched[name] = f"checkpoint {list(checkpoint.shape_of(src))}, model {list(tensor.shape)}"
            continue
        group = group_of.get(name)
        if group is None or not any(member in match.loads for member in group):
            match.loads[name] = src
    used = set(match.source_of.values())
    match.unexpected = [k for k in checkpoint if k not in used and k not in state]
    return match


def check_match(match: KeyMatch, *, strict: bool, model: str, checkpoint: str) -> None:
    """Strict: one error naming every problem. Otherwise a warning, and missing tensors become zeros."""
    problems = match.problems()
    if not problems:
        return
    if strict:
        raise KeyMismatchError(f"{checkpoint} does not match {model}: {problems}; pass strict=False to load anyway")
    warnings.warn(f"{checkpoint} vs {model}: {problems}; missing and mismatched tensors are zeros", ShardkitWarning, stacklevel=3)


def final_dtypes(skeleton: Any, checkpoint: LazyCheckpoint | None, match: KeyMatch | None,
                 dtype: "torch.dtype | None") -> Callable[[str], "torch.dtype | None"]:
    """The dtype each tensor ends up in: ``dtype`` if given (fp32 for keep-in-fp32 modules), else the checkpoint's."""
    import torch

    def dtype_for(name: str) -> "torch.dtype | None":
        if dtype is not None:
            return torch.float32 if keeps_fp32(skeleton, name) else dtype
        src = match.source_of.get(name) if match is not None else None
        if checkpoint is None or src is None:
            return None
        stored = checkpoint.dtype_of(src)
        return stored if stored.is_floating_point else None

    return dtype_for


def prepare_skeleton(model: Any, checkpoint: LazyCheckpoint | None, *, config: Any, dtype: "torch.dtype | None",
                     strict: bool) -> tuple[Any, KeyMatch | None, str | None]:
    """Build the skeleton, check it against ``checkpoint`` and give its meta tensors their final dtypes."""
    skeleton = build_skeleton(model, config=config)
    match = None
    if checkpoint is not None:
        match = match_keys(skeleton, checkpoint)
        check_match(match, strict=strict, model=type(skeleton).__name__, checkpoint=checkpoint.description)
    cast_floating(skeleton, final_dtypes(skeleton, checkpoint, match, dtype))
    return skeleton, match, checkpoint.description if checkpoint is not None else None


def check_devices_exist(devices: list[Device], *, where: str) -> None:
    """Loading needs real devices (planning does not)."""
    import torch

    count = torch.cuda.device_count()
    for device in devices:
        if isinstance(device, int) and device >= count:
            have = f"GPUs 0-{count - 1}" if count else "no GPU"
            raise InvalidInputError(
                f"{where} names GPU {device}, but this machine has {have}; remove it, or use "
                "'shardkit plan' / shardkit.plan_device_map to plan for hardware you do not have"
            )
        if device == "mps" and not torch.backends.mps.is_available():
            raise InvalidInputError(f"{where} names 'mps', which is not available on this machine")


def resolve_device_map(skeleton: Any, device_map: Any, *, max_memory: dict[Device, int] | None,
                       no_split_module_classes: list[str] | None) -> dict[str, Device]:
    """A strategy name, "cpu" or an explicit dict → a complete module → device dict."""
    import torch

    if device_map is None:
        device_map = "auto" if max_memory else "cpu"
    if isinstance(device_map, str):
        return infer_device_map(skeleton, device_map, max_memory=max_memory, no_split_module_classes=no_split_module_classes)
    if not isinstance(device_map, dict):
        raise InvalidInputError(f"device_map must be a strategy name or a dict, got {type(device_map).__name__}")
    resolved = {}
    for name, device in device_map.items():
        if isinstance(device, torch.device):
            device = device.index if device.type == "cuda" else device.type
        resolved[name] = parse_device(device)
    return resolved


def module_device(device_map: dict[str, Device], name: str) -> Device:
    """The device of tensor ``name``: the entry of its longest module prefix."""
    parts = name.split(".")
    for cut in range(len(parts), -1, -1):
        prefix = ".".join(parts[:cut])
        if prefix in device_map:
            return device_map[prefix]
    raise InvalidInputError(f"device_map gives no device for {name!r}; add it (or one of its parent modules)")


def _main_device(device_map: dict[str, Device]) -> Device:
    accelerators = [d for d in device_map.values() if d not in ("cpu", "disk")]
    return accelerators[0] if accelerators else "cpu"


def fill_skeleton(skeleton: Any, checkpoint: LazyCheckpoint, match: KeyMatch, device_map: dict[str, Device],
                  offload_folder: str | None) -> dict[str, Any] | None:
    """Read each tensor once into its device; disk tensors go to an offload index. Returns that index."""
    from accelerate.utils import retie_parameters, set_module_tensor_to_device

    from .offload_index import DiskTensor, write_offload_index

    state = skeleton.state_dict(keep_vars=True)
    params = {name for name, _ in skeleton.named_parameters(remove_duplicate=False)}
    on_disk: list[DiskTensor] = []
    for name, tensor in state.items():
        device = module_device(device_map, name)
        src = None if name in match.mismatched else match.source_of.get(name)
        if device == "disk" and name in params:
            on_disk.append(DiskTensor(name, src, tensor.dtype, tuple(tensor.shape)))
            continue
        if src is not None and name not in match.loads:
            continue  # a tied name: re-tied below
        if src is None and not tensor.is_meta:
            continue  # a buffer that keeps its built value
        target = "cpu" if device == "disk" else device
        if src is None:
            import torch

            value = torch.zeros(tensor.shape, dtype=tensor.dtype, device=target)
        else:
            # Host tensors without a cast stay views of the mapped shards (no copy, pages read on
            # first use), as safetensors' own load_file does; casts read into fresh memory.
            value = checkpoint.get_tensor(src, device=None if target == "cpu" else target, dtype=tensor.dtype)
        set_module_tensor_to_device(skeleton, name, target, value=value, clear_cache=False)
    retie_parameters(skeleton, match.tied)
    if not on_disk:
        return None
    assert offload_folder is not None  # checked by load_model before anything is read
    return write_offload_index(checkpoint, on_disk, os.fspath(offload_folder))


def load_model(model: Any, checkpoint: Any, *, config: Any = None, device_map: Any = None, max_memory: Any = None,
               offload_folder: str | os.PathLike[str] | None = None, dtype: Any = None,
               no_split_module_classes: list[str] | None = None, strict: bool = True, offload: str | None = None,
               offload_options: dict[str, Any] | None = None, layerwise_casting: Any = None) -> Any:
    """Load a sharded safetensors checkpoint into ``model``, placed over GPUs, CPU and disk.

    ``model``: a ``"diffusers:Class"``/``"transformers:Class"`` string or class (with ``config``),
    any ``nn.Module`` factory, or a skeleton on the meta device. ``checkpoint``: a path for
    :func:`shardkit.open` or an open checkpoint. ``device_map``: "auto", "balanced",
    "balanced_low_0", "sequential", "cpu" or a dict of module → device; None means "cpu", or
    "auto" when ``max_memory`` is given. ``dtype`` None keeps the checkpoint's dtypes.
    ``offload`` / ``layerwise_casting`` apply :func:`shardkit.apply_layerwise_casting` (a
    ``(storage, compute)`` pair) and then :func:`shardkit.apply_offload` after loading.

    >>> unet = load_model("diffusers:UNet2DConditionModel", "out/", config="out/config.json",
    ...                   device_map="auto", max_memory={0: "16GB", "cpu": "32GB"},
    ...                   offload_folder="offload/", dtype="bf16")      # doctest: +SKIP
    >>> unet.hf_device_map                                              # doctest: +SKIP
    """
    from accelerate import dispatch_model
    from accelerate.utils import check_device_map

    from .lazy import open as open_checkpoint
    from .torch_dtypes import resolve_torch_dtype

    target = resolve_torch_dtype(dtype)
    budget = parse_max_memory(max_memory)
    if budget:
        check_devices_exist(list(budget), where="max_memory")
    with contextlib.ExitStack() as stack:
        ckpt = checkpoint if isinstance(checkpoint, LazyCheckpoint) else stack.enter_context(open_checkpoint(checkpoint))
        skeleton, match, _ = prepare_skeleton(model, ckpt, config=config, dtype=target, strict=strict)
        assert match is not None
        mapping = resolve_device_map(skeleton, device_map, max_memory=budget, no_split_module_classes=no_split_module_classes)
        check_devices_exist(list(mapping.values()), where="device_map")
        disk_modules = [name or "(whole model)" for name, device in mapping.items() if device == "disk"]
        if disk_modules and offload_folder is None:
            raise InvalidInputError(f"the device map sends {', '.join(disk_modules[:_SHOWN])} to disk; pass offload_folder=")
        try:
            with warnings.catch_warnings():
                # accelerate's own maps name top-level buffers/params, which its checker calls "not submodules"
                warnings.filterwarnings("ignore", message="The following device_map keys do not match")
                check_device_map(skeleton, mapping)
                offload_index = fill_skeleton(skeleton, ckpt, match, mapping, offload_folder)
                dispatch_model(skeleton, mapping, main_device=_main_device(mapping), offload_index=offload_index,
                               offload_dir=os.fspath(offload_folder) if offload_index is not None else None)
        except ValueError as e:
            if isinstance(e, InvalidInputError):
                raise
            raise InvalidInputError(f"cannot place {type(skeleton).__name__} with this device map: {e}") from e
    skeleton.eval()
    _apply_runtime_options(skeleton, offload=offload, offload_options=offload_options, layerwise_casting=layerwise_casting)
    return skeleton


def _apply_runtime_options(model: Any, *, offload: str | None, offload_options: dict[str, Any] | None,
                           layerwise_casting: Any) -> None:
    """Casting first, so that offloaded copies are already in their storage dtype."""
    if layerwise_casting is not None:
        from .casting import apply_layerwise_casting

        if isinstance(layerwise_casting, dict):
            apply_layerwise_casting(model, **layerwise_casting)
        else:
            storage, compute = layerwise_casting
            apply_layerwise_casting(model, storage, compute)
    if offload is None and offload_options:
        raise InvalidInputError("offload_options needs offload= ('model', 'sequential', 'group' or 'none')")
    if offload is not None:
        from .offload import apply_offload

        apply_offload(model, offload, **(offload_options or {}))
