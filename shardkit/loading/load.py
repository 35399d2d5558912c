"""``load_model``: a meta skeleton filled from a lazy checkpoint, dispatched by accelerate.

Flow: skeleton (meta) → keys matched against the checkpoint → dtypes made final on the meta
tensors (free) → device map from accelerate → each tensor read once, straight to its device →
disk tensors get an offload index that points into the shards → ``accelerate.dispatch_model``.
When everything goes to the host, the reads start first: on one bounded thread
(:func:`~shardkit.loading.bulk.start_early_reads`) while the skeleton is built and matched.
Host memory peaks near the bytes placed on the host: host tensors that need no cast are views of
the shards' memory maps (file-backed pages, read on first use, never copied) or, with the
``pread``/``direct`` backends, read in one parallel batch per shard into tensors allocated once;
tensors that need a cast are read one at a time through a small buffer and cast; GPU tensors go
through a ring of pinned buffers (:mod:`shardkit.loading.bulk`); nothing goes through a whole-shard
state dict.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..devices import Device, parse_max_memory
from ..errors import InvalidInputError
from ..runtime.apply import RuntimeSetup, apply_runtime
from ..workers import ReadPool
from .bulk import BatchReport, read_batch, start_early_reads, take_early_reads
from .device_map import check_devices_exist, module_device, resolve_device_map
from .device_reads import Want
from .keys import KeyMatch, prepare_skeleton
from .lazy import LazyCheckpoint
from .skeleton import default_config

if TYPE_CHECKING:
    from concurrent.futures import Future

    import torch

    from ..devices import DeviceMap, MaxMemory
    from ..reading.residency import ReadMode
    from ..runtime.apply import LayerwiseCasting
    from ..sources.ranged import RangedCheckpoint
    from .offload_index import DiskTensor
    from .skeleton import ConfigSpec, ModelSpec

# accelerate's offload index: tensor name → {"safetensors_file", "weight_name", "dtype"} (its own format)
OffloadIndex = dict[str, dict[str, Any]]


def _main_device(device_map: dict[str, Device]) -> Device:
    accelerators = [d for d in device_map.values() if d not in ("cpu", "disk")]
    return accelerators[0] if accelerators else "cpu"


def _all_on_host(device_map: DeviceMap | None, budget: Mapping[Device, int] | None) -> bool:
    """Whether ``device_map`` places everything on the host before the skeleton exists to ask."""
    if device_map is None:
        return not budget  # None means "cpu" unless a budget asks for "auto"
    if isinstance(device_map, Mapping):
        return bool(device_map) and all(str(d).strip().lower() == "cpu" for d in device_map.values())
    return str(device_map).strip().lower() == "cpu"  # "cpu" or torch.device("cpu")


def _set_tensor(skeleton: torch.nn.Module, modules: Mapping[str, torch.nn.Module], name: str, target: Device,
                value: torch.Tensor) -> None:
    """Put ``value`` (already of the tensor's shape and dtype, on ``target``) in place of meta tensor ``name``.

    A plain ``nn.Parameter`` or a buffer is replaced directly, as ``load_state_dict(assign=True)``
    does; a parameter subclass or one carrying attributes goes through accelerate, which knows them.
    ``modules``: the skeleton's modules by name (looked up once, not per tensor).
    """
    import torch
    from accelerate.utils import set_module_tensor_to_device

    module_name, _, attr = name.rpartition(".")
    module = modules[module_name]
    old = module._parameters.get(attr)
    if old is not None and type(old) is torch.nn.Parameter and not old.__dict__ and value.device.type != "meta":
        module._parameters[attr] = torch.nn.Parameter(value, requires_grad=old.requires_grad)
    elif old is None and attr in module._buffers and value.device.type != "meta":
        module._buffers[attr] = value
    else:
        set_module_tensor_to_device(skeleton, name, target, value=value, clear_cache=False)


@dataclass
class _FillPlan:
    """Where each skeleton tensor comes from and goes: (model name, device, checkpoint name or None
    for zeros, meta tensor) to read, and the tensors left on disk."""

    pending: list[tuple[str, Device, str | None, torch.Tensor]] = field(default_factory=list)
    on_disk: list[DiskTensor] = field(default_factory=list)


def _plan_fill(skeleton: torch.nn.Module, match: KeyMatch, device_map: dict[str, Device]) -> _FillPlan:
    from .offload_index import DiskTensor

    plan = _FillPlan()
    params = {name for name, _ in skeleton.named_parameters(remove_duplicate=False)}
    for name, tensor in skeleton.state_dict(keep_vars=True).items():
        device = module_device(device_map, name)
        src = None if name in match.mismatched else match.source_of.get(name)
        if device == "disk" and name in params:
            plan.on_disk.append(DiskTensor(name, src, tensor.dtype, tuple(tensor.shape)))
            continue
        if src is not None and name not in match.loads:
            continue  # a tied name: re-tied below
        if src is None and not tensor.is_meta:
            continue  # a buffer that keeps its built value
        plan.pending.append((name, "cpu" if device == "disk" else device, src, tensor))
    return plan


def fill_skeleton(skeleton: torch.nn.Module, checkpoint: LazyCheckpoint, match: KeyMatch, device_map: dict[str, Device],
                  offload_folder: str | os.PathLike[str] | None, *,
                  early: Future[dict[str, torch.Tensor]] | None = None) -> OffloadIndex | None:
    """Read each tensor once into its device; disk tensors go to an offload index. Returns that index.

    ``early``: host tensors being read since before the skeleton existed
    (:func:`~shardkit.loading.bulk.start_early_reads`), waited for after the plan is made and used
    for host tensors whose dtype they have; the rest is read here.
    """
    import torch
    from accelerate.utils import retie_parameters

    from .offload_index import write_offload_index

    plan = _plan_fill(skeleton, match, device_map)
    modules = dict(skeleton.named_modules(remove_duplicate=False))
    ready = take_early_reads(early) if early is not None else {}
    taken = {name: ready[src] for name, target, src, tensor in plan.pending
             if src is not None and src in ready and str(target) == "cpu" and ready[src].dtype == tensor.dtype}
    wants = {name: Want(src, target, tensor.dtype) for name, target, src, tensor in plan.pending
             if src is not None and name not in taken}
    values, report = read_batch(checkpoint, wants)
    _report(skeleton, report, early=sum(t.nbytes for t in taken.values()))
    values.update(taken)
    del ready, taken  # what the model does not use is freed with the blocks no kept tensor shares
    for name, target, src, tensor in plan.pending:
        if src is None:
            value = torch.zeros(tensor.shape, dtype=tensor.dtype, device=target)
        elif name in values:
            value = values.pop(name)
        else:
            # Host tensors without a cast stay views of the mapped shards (no copy, pages read on
            # first use), as safetensors' own load_file does; casts read into fresh memory.
            value = checkpoint.get_tensor(src, device=None if target == "cpu" else target, dtype=tensor.dtype)
        _set_tensor(skeleton, modules, name, target, value)
    retie_parameters(skeleton, match.tied)
    if not plan.on_disk:
        return None
    assert offload_folder is not None  # checked by _fill_and_dispatch before anything is read
    return write_offload_index(checkpoint, plan.on_disk, os.fspath(offload_folder))


REPORT_ATTRIBUTE = "shardkit_load_report"


def _report(skeleton: torch.nn.Module, report: BatchReport, *, early: int) -> None:
    """``model.shardkit_load_report``: each file's backend and why, and the bytes each read path took."""
    attach_report(skeleton, {"files": report.files, "host_batch_bytes": report.host_batch_bytes + early,
                             "pipelined_bytes": report.pipelined_bytes, "early_bytes": early})


def attach_report(target: object, report: Mapping[str, object]) -> None:
    """Set ``target.shardkit_load_report``: a plain attribute users read, like accelerate's
    ``hf_device_map`` (set through ``vars``: ``nn.Module``'s typed ``__setattr__`` is for tensors)."""
    vars(target)[REPORT_ATTRIBUTE] = report


def load_report(target: object) -> dict[str, object]:
    """``target.shardkit_load_report`` as :func:`load_model` (or ``load_pipeline``) set it."""
    report: dict[str, object] = vars(target)[REPORT_ATTRIBUTE]
    return report


def load_model(model: ModelSpec, checkpoint: str | os.PathLike[str] | LazyCheckpoint | RangedCheckpoint, *,
               config: ConfigSpec | None = None, device_map: DeviceMap | None = None,
               max_memory: MaxMemory | None = None, offload_folder: str | os.PathLike[str] | None = None,
               dtype: str | torch.dtype | None = None, no_split_module_classes: list[str] | None = None,
               strict: bool = True, offload: str | None = None, offload_options: dict[str, Any] | None = None,
               layerwise_casting: LayerwiseCasting | None = None, read: ReadMode = "auto") -> torch.nn.Module:
    """Load a sharded safetensors checkpoint into ``model``, placed over GPUs, CPU and disk.

    The model is built on the meta device, its keys are matched against the checkpoint, and
    each tensor is read once, straight to its device (host tensors without a cast stay views of
    the shards' memory maps). Tensors placed on disk are read from the shards in place through
    an offload index; only those that need a dtype change are written out. The result is
    dispatched with accelerate and put in eval mode.

    Args:
        model: a ``"diffusers:Class"`` / ``"transformers:Class"`` string or class (with
            ``config``), any ``nn.Module`` factory, or a skeleton on the meta device.
        checkpoint: a path for :func:`shardkit.open` or an open checkpoint.
        config: the model's config: a dict, a ``config.json`` path or the folder holding it;
            default ``config.json`` beside the checkpoint (a pipeline's ``unet/`` folder holds its
            own) when the model is a diffusers or transformers class.
        device_map: ``"auto"``, ``"balanced"``, ``"balanced_low_0"``, ``"sequential"``,
            ``"cpu"``, one device for the whole model (``0``, ``"cuda"`` meaning GPU 0,
            ``"cuda:1"``, a ``torch.device``) or a dict of module → device; None means ``"cpu"``,
            or ``"auto"`` when ``max_memory`` is given.
        max_memory: the budget per device, e.g. ``{0: "16GB", "cpu": "64GB"}``.
        offload_folder: where the offload index (and disk tensors that need a dtype change)
            go; required when the device map sends anything to disk.
        dtype: the dtype of floating-point weights (``"bf16"``, ``torch.float16``...); None
            keeps the checkpoint's dtypes. Modules the model keeps in fp32 stay fp32.
        no_split_module_classes: module classes kept whole on one device; None uses the
            model's ``_no_split_modules``.
        strict: refuse missing, unexpected or mis-shaped tensors; with False they only warn
            and missing tensors are zeros.
        offload: an offload strategy for :func:`shardkit.apply_offload`, applied after loading.
        offload_options: keyword options for that strategy.
        layerwise_casting: a ``(storage, compute)`` dtype pair for
            :func:`shardkit.apply_layerwise_casting`, applied before ``offload``.
        read: the read backend for :func:`shardkit.open` (``"auto"``, ``"mmap"``, ``"pread"``,
            ``"direct"``); ignored when ``checkpoint`` is already open.

    Returns:
        The loaded model, in eval mode, with ``hf_device_map`` set by accelerate and
        ``shardkit_load_report`` saying which read backend each file got and why.

    Raises:
        KeyMismatchError: with ``strict``, the checkpoint does not match the model.
        InvalidInputError: a bad option, a device this machine lacks, disk placement without
            ``offload_folder``, or a device map accelerate cannot apply.
        SourceNotFoundError: the checkpoint or config does not exist.

    unet = load_model("diffusers:UNet2DConditionModel", "out/",   # config: out/config.json
                      device_map="auto", max_memory={0: "16GB", "cpu": "32GB"},
                      offload_folder="offload/", dtype="bf16")
    unet.hf_device_map
    """
    from ..formats.dtypes import resolve_torch_dtype
    from .opening import open_checkpoint

    runtime = RuntimeSetup(layerwise_casting=layerwise_casting, offload=offload, offload_options=offload_options or {})
    target = resolve_torch_dtype(dtype)
    config = default_config(model, checkpoint, config)
    budget = parse_max_memory(max_memory)
    if budget:
        check_devices_exist(list(budget), where="max_memory")
    with contextlib.ExitStack() as stack:
        # Unwound in reverse: the checkpoint closes first (cancelling reads still queued), then the
        # thread that started them is joined (bounded), on every path.
        early_pool = ReadPool(1, name="shardkit-load")
        stack.callback(early_pool.close)
        early: Future[dict[str, torch.Tensor]] | None = None
        if isinstance(checkpoint, LazyCheckpoint):
            ckpt = checkpoint  # the caller's: not closed here, so its reads cannot be cancelled early
        else:
            ckpt = stack.enter_context(open_checkpoint(checkpoint, read=read))
            if _all_on_host(device_map, budget):  # read while the skeleton is built and matched
                early = start_early_reads(early_pool, ckpt, dtype=target)
        skeleton: torch.nn.Module
        skeleton, match, _ = prepare_skeleton(model, ckpt, config=config, dtype=target, strict=strict)
        assert match is not None
        mapping = resolve_device_map(skeleton, device_map, max_memory=budget, no_split_module_classes=no_split_module_classes)
        check_devices_exist(list(mapping.values()), where="device_map")
        _fill_and_dispatch(skeleton, ckpt, match, mapping, offload_folder, early=early)
    skeleton.eval()
    apply_runtime(skeleton, runtime)
    return skeleton


def _fill_and_dispatch(skeleton: torch.nn.Module, checkpoint: LazyCheckpoint, match: KeyMatch,
                       mapping: dict[str, Device], offload_folder: str | os.PathLike[str] | None, *,
                       early: Future[dict[str, torch.Tensor]] | None) -> None:
    """Read the weights into their devices, then let accelerate install its dispatch hooks."""
    from accelerate import dispatch_model
    from accelerate.utils import check_device_map

    disk_modules = [name or "(whole model)" for name, device in mapping.items() if device == "disk"]
    if disk_modules and offload_folder is None:
        raise InvalidInputError(f"the device map sends {', '.join(disk_modules[:5])} to disk; pass offload_folder=")
    try:
        with warnings.catch_warnings():
            # accelerate's own maps name top-level buffers/params, which its checker calls "not submodules"
            warnings.filterwarnings("ignore", message="The following device_map keys do not match")
            check_device_map(skeleton, mapping)
            offload_index = fill_skeleton(skeleton, checkpoint, match, mapping, offload_folder, early=early)
            if _in_place_on_host(skeleton, mapping):
                vars(skeleton)["hf_device_map"] = dict(mapping)  # all dispatch_model does here
            else:
                dispatch_model(skeleton, mapping, main_device=_main_device(mapping), offload_index=offload_index,
                               offload_dir=os.fspath(offload_folder) if offload_index is not None and offload_folder else None)
    except ValueError as e:
        if isinstance(e, InvalidInputError):
            raise
        raise InvalidInputError(f"cannot place {type(skeleton).__name__} with this device map: {e}") from e


def _in_place_on_host(skeleton: torch.nn.Module, mapping: dict[str, Device]) -> bool:
    """Everything mapped to the CPU and already there: accelerate's ``dispatch_model`` would attach no
    hook (one device, not a bitsandbytes model) and its ``model.to("cpu")`` would move nothing."""
    import itertools

    if set(mapping.values()) != {"cpu"} or getattr(skeleton, "is_loaded_in_8bit", False) \
            or getattr(skeleton, "is_loaded_in_4bit", False):
        return False
    return all(t.device.type == "cpu" for t in itertools.chain(skeleton.parameters(), skeleton.buffers()))
