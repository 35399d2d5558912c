"""``load_model``: a meta skeleton filled from a lazy checkpoint, dispatched by accelerate.

Flow: skeleton (meta) → keys matched against the checkpoint → dtypes made final on the meta
tensors (free) → device map from accelerate → each tensor read once, straight to its device →
disk tensors get an offload index that points into the shards → ``accelerate.dispatch_model``.
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
from typing import TYPE_CHECKING, Any

from ..devices import Device, parse_max_memory
from ..errors import InvalidInputError
from ..runtime.apply import RuntimeSetup, apply_runtime
from .bulk import Want, read_batch
from .device_map import check_devices_exist, module_device, resolve_device_map
from .keys import KeyMatch, prepare_skeleton
from .lazy import LazyCheckpoint
from .skeleton import default_config

if TYPE_CHECKING:
    import torch

    from ..devices import DeviceMap, MaxMemory
    from ..reading.residency import ReadMode
    from ..runtime.apply import LayerwiseCasting
    from ..sources.ranged import RangedCheckpoint
    from .skeleton import ConfigSpec, ModelSpec


def _main_device(device_map: dict[str, Device]) -> Device:
    accelerators = [d for d in device_map.values() if d not in ("cpu", "disk")]
    return accelerators[0] if accelerators else "cpu"


def fill_skeleton(skeleton: Any, checkpoint: LazyCheckpoint, match: KeyMatch, device_map: dict[str, Device],
                  offload_folder: str | os.PathLike[str] | None) -> dict[str, Any] | None:
    """Read each tensor once into its device; disk tensors go to an offload index. Returns that index."""
    from accelerate.utils import retie_parameters, set_module_tensor_to_device

    from .offload_index import DiskTensor, write_offload_index

    state = skeleton.state_dict(keep_vars=True)
    params = {name for name, _ in skeleton.named_parameters(remove_duplicate=False)}
    on_disk: list[DiskTensor] = []
    pending: list[tuple[str, Any, str | None, Any]] = []
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
        pending.append((name, "cpu" if device == "disk" else device, src, tensor))
    wants = {name: Want(src, target, tensor.dtype) for name, target, src, tensor in pending if src is not None}
    values, report = read_batch(checkpoint, wants)
    skeleton.shardkit_load_report = {"files": report.files, "host_batch_bytes": report.host_batch_bytes,
                                     "pipelined_bytes": report.pipelined_bytes}
    for name, target, src, tensor in pending:
        if src is None:
            import torch

            value = torch.zeros(tensor.shape, dtype=tensor.dtype, device=target)
        elif name in values:
            value = values.pop(name)
        else:
            # Host tensors without a cast stay views of the mapped shards (no copy, pages read on
            # first use), as safetensors' own load_file does; casts read into fresh memory.
            value = checkpoint.get_tensor(src, device=None if target == "cpu" else target, dtype=tensor.dtype)
        set_module_tensor_to_device(skeleton, name, target, value=value, clear_cache=False)
    retie_parameters(skeleton, match.tied)
    if not on_disk:
        return None
    assert offload_folder is not None  # checked by _fill_and_dispatch before anything is read
    return write_offload_index(checkpoint, on_disk, os.fspath(offload_folder))


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
            ``"cpu"`` or a dict of module → device; None means ``"cpu"``, or ``"auto"`` when
            ``max_memory`` is given.
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
    from .opening import open as open_checkpoint

    runtime = RuntimeSetup(layerwise_casting=layerwise_casting, offload=offload, offload_options=offload_options or {})
    target = resolve_torch_dtype(dtype)
    config = default_config(model, checkpoint, config)
    budget = parse_max_memory(max_memory)
    if budget:
        check_devices_exist(list(budget), where="max_memory")
    with contextlib.ExitStack() as stack:
        ckpt = checkpoint if isinstance(checkpoint, LazyCheckpoint) else stack.enter_context(open_checkpoint(checkpoint, read=read))
        skeleton, match, _ = prepare_skeleton(model, ckpt, config=config, dtype=target, strict=strict)
        assert match is not None
        mapping = resolve_device_map(skeleton, device_map, max_memory=budget, no_split_module_classes=no_split_module_classes)
        check_devices_exist(list(mapping.values()), where="device_map")
        _fill_and_dispatch(skeleton, ckpt, match, mapping, offload_folder)
    skeleton.eval()
    apply_runtime(skeleton, runtime)
    return skeleton


def _fill_and_dispatch(skeleton: Any, checkpoint: LazyCheckpoint, match: KeyMatch, mapping: dict[str, Device],
                       offload_folder: str | os.PathLike[str] | None) -> None:
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
            offload_index = fill_skeleton(skeleton, checkpoint, match, mapping, offload_folder)
            dispatch_model(skeleton, mapping, main_device=_main_device(mapping), offload_index=offload_index,
                           offload_dir=os.fspath(offload_folder) if offload_index is not None and offload_folder else None)
    except ValueError as e:
        if isinstance(e, InvalidInputError):
            raise
        raise InvalidInputError(f"cannot place {type(skeleton).__name__} with this device map: {e}") from e
