"""Inference offload strategies for a diffusers pipeline, a diffusers model or any ``nn.Module``.

Every strategy wraps the hooks diffusers and accelerate already ship; this module only picks the
right entry point for the target (a table, not a chain of class checks), validates the options,
and turns the known traps into one clear :class:`~shardkit.errors.ShardkitError` each.

=============  ======================================================  ===========================
strategy       pipeline                                                 nn.Module
=============  ======================================================  ===========================
``model``      ``enable_model_cpu_offload``                             ``accelerate.cpu_offload_with_hook`` (a list of modules is chained)
``sequential`` ``enable_sequential_cpu_offload``                        ``accelerate.cpu_offload``
``group``      ``enable_group_offload``                                 ``apply_group_offloading``
``disk``       ``accelerate.disk_offload`` per component                ``accelerate.disk_offload``
``none``       removes all of the above (casting hooks stay)            same
=============  ======================================================  ===========================

apply_offload(pipe, "model")
apply_offload(unet, "group", offload_type="block_level", num_blocks_per_group=2,
              use_stream=True)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

from ..errors import InvalidInputError, ShardkitError
from ..errors import OffloadError as OffloadError  # re-exported: defined with every public error
from .offload_targets import (
    Modules,
    Offloadable,
    OffloadPipeline,
    Options,
    compute_device,
    record_offload,
    refuse_device_mapped,
    refuse_on_accelerator,
    target_kind,
    target_modules,
)

if TYPE_CHECKING:
    from torch import nn

# A pipeline, a module or a list of modules: returned as given.
_Target = TypeVar("_Target")

GROUP_OPTIONS = frozenset({
    "device", "onload_device", "offload_device", "offload_type", "num_blocks_per_group", "non_blocking",
    "use_stream", "record_stream", "low_cpu_mem_usage", "offload_to_disk_path", "exclude_modules", "block_modules",
})


@dataclass(frozen=True)
class Strategy:
    """One row of :data:`STRATEGIES`: how to apply a strategy to each kind of target."""

    name: str
    options: frozenset[str]
    pipeline: Callable[[OffloadPipeline, Options], None]
    module: Callable[[Modules, Options], None]
    summary: str


def apply_offload(obj: _Target, strategy: str = "model", **options: Any) -> _Target:
    """Install ``strategy`` on ``obj`` (a pipeline, an ``nn.Module`` or a list of modules); return ``obj``.

    Any offload strategy already installed is removed first (layerwise casting hooks stay).
    ``device`` is the accelerator the weights are moved to for compute (default: ``cuda`` when
    available; pass ``device="cpu"`` to exercise the hooks on a machine without one). The
    strategy and options are recorded as ``shardkit_offload`` on ``obj`` and its modules.

    Args:
        obj: a diffusers pipeline, an ``nn.Module``, or a list of modules (``model`` offload
            chains them: each one moves back to the host when the next one runs).
        strategy: ``"model"``, ``"sequential"``, ``"group"``, ``"disk"`` or ``"none"`` (remove
            every offload hook); see the table in this module's docstring.
        **options: the strategy's options: ``device`` for all but ``none``;
            ``offload_buffers`` for ``sequential`` and ``disk``; ``offload_dir`` (required)
            for ``disk``; diffusers' group offloading arguments (:data:`GROUP_OPTIONS`) for
            ``group``.

    Returns:
        ``obj``, with the hooks installed.

    Raises:
        InvalidInputError: an unknown strategy or option, a bad option value, or an ``obj``
            that is not a pipeline or module.
        OffloadError: the strategy cannot apply to ``obj`` as it is (dispatched over a device
            map, weights already on an accelerator, no accelerator found, or the underlying
            diffusers/accelerate call failed).

    apply_offload(pipe, "group", offload_type="leaf_level", use_stream=True)
    apply_offload(pipe, "none")
    """
    spec = STRATEGIES.get(strategy)
    if spec is None:
        raise InvalidInputError(f"unknown offload strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
    unknown = sorted(set(options) - spec.options)
    if unknown:
        allowed = ", ".join(sorted(spec.options)) or "none"
        raise InvalidInputError(f"offload strategy {strategy!r} takes no option {', '.join(unknown)}; allowed: {allowed}")
    kind = target_kind(obj)
    target = cast("Offloadable", obj)  # checked by target_kind
    refuse_device_mapped(target, kind, strategy)
    if strategy != "none":
        _remove(target, kind)
    apply = spec.pipeline if kind == "pipeline" else spec.module
    try:
        apply(cast(Any, obj), dict(options))  # a module or a pipeline, by ``kind``
    except ShardkitError:
        raise
    except (ValueError, RuntimeError, NotImplementedError) as e:
        raise OffloadError(f"offload strategy {strategy!r} failed on {type(obj).__name__}: {e}") from e
    record_offload(target, strategy, options)
    return obj


# --- model offload -------------------------------------------------------------------------------

def _model_pipeline(pipe: OffloadPipeline, options: Options) -> None:
    pipe.enable_model_cpu_offload(device=compute_device(options))


def _model_modules(obj: Modules, options: Options) -> None:
    from accelerate import cpu_offload_with_hook

    device = compute_device(options)
    hook = None
    for _, module in target_modules(obj):
        module.to("cpu")
        _, hook = cpu_offload_with_hook(module, execution_device=device, prev_module_hook=hook)
        module.shardkit_model_hook = hook


# --- sequential offload --------------------------------------------------------------------------

def _sequential_pipeline(pipe: OffloadPipeline, options: Options) -> None:
    refuse_on_accelerator(pipe)
    device = compute_device(options)
    if device.type != "cpu":
        pipe.enable_sequential_cpu_offload(device=device)
        return
    # diffusers turns a "cpu" device into "cpu:0", and accelerate's hook then copies each weight
    # with Parameter.to("cpu:0"), which returns a plain Tensor its post-forward cannot handle. On
    # the host we install the very same accelerate hooks per component with an index-free device.
    excluded = set(getattr(pipe, "_exclude_from_cpu_offload", ()))
    _sequential_modules([m for n, m in target_modules(pipe) if n not in excluded], {"device": device})


def _sequential_modules(obj: Modules, options: Options) -> None:
    from accelerate import cpu_offload

    refuse_on_accelerator(obj)
    device = compute_device(options)
    offload_buffers = bool(options.pop("offload_buffers", False))
    for _, module in target_modules(obj):
        cpu_offload(module, execution_device=device, offload_buffers=offload_buffers)


# --- group offload -------------------------------------------------------------------------------

def _group_kwargs(options: Options) -> Options:
    """Validate group options and fill the defaults diffusers leaves to the caller."""
    import torch

    if "onload_device" in options and "device" in options:
        raise InvalidInputError("group offload: pass device= or onload_device=, not both")
    onload = compute_device(options, "onload_device" if "onload_device" in options else "device")
    kwargs = {"onload_device": onload, "offload_device": torch.device(options.pop("offload_device", "cpu")), **options}
    kwargs.setdefault("offload_type", "block_level")
    if kwargs["offload_type"] not in ("block_level", "leaf_level"):
        raise InvalidInputError(f"group offload: offload_type must be block_level or leaf_level, got {kwargs['offload_type']!r}")
    if kwargs["offload_type"] == "block_level":
        kwargs.setdefault("num_blocks_per_group", 1)
        blocks = kwargs["num_blocks_per_group"]
        if not isinstance(blocks, int) or blocks < 1:
            raise InvalidInputError(f"group offload: num_blocks_per_group must be a positive integer, got {blocks!r}")
        if kwargs.get("use_stream") and blocks != 1:
            raise OffloadError(
                f"group offload with use_stream=True prefetches one block at a time; num_blocks_per_group={blocks} "
                "would be silently reset to 1 by diffusers: pass num_blocks_per_group=1 or use_stream=False"
            )
    elif kwargs.get("num_blocks_per_group") not in (None, 1):
        raise InvalidInputError("group offload: num_blocks_per_group applies to offload_type='block_level' only")
    if kwargs.get("record_stream") and not kwargs.get("use_stream"):
        raise InvalidInputError("group offload: record_stream=True needs use_stream=True")
    if kwargs.get("use_stream") and onload.type == "cpu":
        raise OffloadError("group offload: use_stream=True needs an accelerator onload device (CUDA streams), not cpu")
    if kwargs.get("offload_to_disk_path"):
        os.makedirs(kwargs["offload_to_disk_path"], exist_ok=True)
    return kwargs


def _group_pipeline(pipe: OffloadPipeline, options: Options) -> None:
    kwargs = _group_kwargs(options)
    if kwargs.pop("block_modules", None) is not None:
        raise InvalidInputError("group offload: block_modules applies to a single model, not to a pipeline")
    pipe.enable_group_offload(**kwargs)


def _group_modules(obj: Modules, options: Options) -> None:
    from diffusers.hooks import apply_group_offloading

    kwargs = _group_kwargs(options)
    if kwargs.pop("exclude_modules", None) is not None:
        raise InvalidInputError("group offload: exclude_modules applies to pipelines; apply_offload the modules you want")
    for name, module in target_modules(obj):
        if getattr(module, "_supports_group_offloading", True) is False:
            raise OffloadError(f"{type(module).__name__} does not support group offloading (diffusers says so); use 'model' or 'sequential'")
        module_kwargs = dict(kwargs)
        if module_kwargs.get("offload_to_disk_path") and name:
            module_kwargs["offload_to_disk_path"] = os.path.join(module_kwargs["offload_to_disk_path"], name)
        apply_group_offloading(module, **module_kwargs)


# --- disk offload --------------------------------------------------------------------------------

def _disk_modules(obj: Offloadable, options: Options) -> None:
    from accelerate import disk_offload

    folder = options.pop("offload_dir", None)
    if not folder:
        raise InvalidInputError("disk offload needs offload_dir='folder/' for the offloaded weights")
    refuse_on_accelerator(obj)
    device = compute_device(options)
    for name, module in target_modules(obj):
        disk_offload(module, os.path.join(folder, name) if name else folder, execution_device=device,
                     offload_buffers=bool(options.get("offload_buffers", False)))


# --- none: remove every offload hook -------------------------------------------------------------

_DIFFUSERS_OFFLOAD_HOOKS = ("group_offloading", "layer_execution_tracker", "lazy_prefetch_group_offloading")


def _remove(obj: Offloadable, kind: str) -> None:
    from accelerate.hooks import remove_hook_from_module

    for _, module in target_modules(obj):
        _restore_group_offloaded(module)
        # Registries may sit on submodules only (a VAE offloads its encoder/decoder blocks).
        for sub in module.modules():
            registry = getattr(sub, "_diffusers_hook", None)
            if registry is None:
                continue
            for hook_name in _DIFFUSERS_OFFLOAD_HOOKS:
                registry.remove_hook(hook_name, recurse=False)
        remove_hook_from_module(module, recurse=True)
        module.__dict__.pop("shardkit_model_hook", None)
        if any(t.is_meta for t in module.parameters()):
            raise OffloadError(f"removing offload hooks left meta weights in {type(module).__name__}; reload the model")
    if kind == "pipeline":
        cast(Any, obj)._all_hooks = []  # the pipeline's own list of accelerate hooks


def _restore_group_offloaded(module: nn.Module) -> None:
    """Bring disk-offloaded groups back into host memory before their hooks go away.

    Disk group offload leaves empty tensors behind; onloading each group to its offload device
    (the host) refills them from the files diffusers wrote.
    """
    for sub in module.modules():
        registry = getattr(sub, "_diffusers_hook", None)
        hook = registry.get_hook("group_offloading") if registry is not None else None
        group = getattr(hook, "group", None)
        if group is not None and group.offload_to_disk_path and getattr(group, "_is_offloaded_to_disk", False):
            group.onload_device, group.stream = group.offload_device, None
            group.onload_()
            group._is_offloaded_to_disk = False


def _none_pipeline(pipe: OffloadPipeline, options: Options) -> None:
    _remove(pipe, "pipeline")


def _none_modules(obj: Modules, options: Options) -> None:
    _remove(obj, "module")


def _disk_pipeline(pipe: OffloadPipeline, options: Options) -> None:
    _disk_modules(pipe, options)


STRATEGIES: dict[str, Strategy] = {
    "none": Strategy("none", frozenset(), _none_pipeline, _none_modules, "everything stays where it is; hooks removed"),
    "model": Strategy("model", frozenset({"device"}), _model_pipeline, _model_modules,
                      "whole components move to the accelerator on call, back when the next one runs"),
    "sequential": Strategy("sequential", frozenset({"device", "offload_buffers"}), _sequential_pipeline,
                           _sequential_modules, "each layer's weights move to the accelerator for its own forward"),
    "group": Strategy("group", GROUP_OPTIONS, _group_pipeline, _group_modules,
                      "groups of blocks (block_level) or single layers (leaf_level) move on demand"),
    "disk": Strategy("disk", frozenset({"device", "offload_dir", "offload_buffers"}), _disk_pipeline, _disk_modules,
                     "weights live in files under offload_dir and are read for each layer's forward"),
}


def installed_hooks(obj: Offloadable) -> list[str]:
    """``"name: HookClass"`` for every accelerate and diffusers hook under ``obj`` (for tests and debugging)."""
    found = []
    for prefix, module in target_modules(obj):
        for name, sub in module.named_modules():
            full = ".".join(p for p in (prefix, name) if p)
            if hasattr(sub, "_hf_hook"):
                found.append(f"{full}: {type(sub._hf_hook).__name__}")
            registry = getattr(sub, "_diffusers_hook", None)
            for hook_name in getattr(registry, "hooks", {}) or {}:
                found.append(f"{full}: {hook_name}")
    return found
