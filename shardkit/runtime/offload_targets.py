"""What :func:`~shardkit.runtime.offload.apply_offload` offloads: the kinds of target (a diffusers pipeline, an
``nn.Module``, a list of modules), their modules, the compute device, and the guards for the known traps
(a device-mapped model, weights already on an accelerator), each one clear :class:`~shardkit.errors.OffloadError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

from ..errors import InvalidInputError, OffloadError, Option

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["Modules", "OffloadPipeline", "Offloadable", "Options", "compute_device", "placed_devices", "record_offload",
           "refuse_device_mapped", "refuse_on_accelerator", "target_kind", "target_modules"]

# The caller's keyword options, forwarded to diffusers/accelerate (which type them themselves).
Options: TypeAlias = "dict[str, Any]"
Modules: TypeAlias = "nn.Module | list[nn.Module] | tuple[nn.Module, ...]"


class OffloadPipeline(Protocol):
    """What offloading uses of a diffusers ``DiffusionPipeline`` (diffusers is imported only when used)."""

    @property
    def components(self) -> Mapping[str, object]: ...

    def enable_model_cpu_offload(self, *, device: torch.device) -> None: ...

    def enable_sequential_cpu_offload(self, *, device: torch.device) -> None: ...

    def enable_group_offload(self, **kwargs: Any) -> None: ...


Offloadable: TypeAlias = "Modules | OffloadPipeline"


# --- targets -------------------------------------------------------------------------------------

def target_kind(obj: object) -> str:
    from torch import nn

    if isinstance(obj, nn.Module):
        return "module"
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(m, nn.Module) for m in obj):
        return "modules"
    if isinstance(getattr(obj, "components", None), dict) and hasattr(obj, "enable_model_cpu_offload"):
        return "pipeline"
    raise InvalidInputError(
        f"apply_offload needs a diffusers pipeline, an nn.Module or a list of modules, got {type(obj).__name__}"
    )


def target_modules(obj: Offloadable) -> list[tuple[str, nn.Module]]:
    from torch import nn

    if isinstance(obj, nn.Module):
        return [("", obj)]
    if isinstance(obj, (list, tuple)):
        return [(str(i), m) for i, m in enumerate(obj)]
    return [(k, v) for k, v in obj.components.items() if isinstance(v, nn.Module)]


def record_offload(obj: Offloadable, strategy: str, options: Options) -> None:
    record = None if strategy == "none" else (strategy, dict(options))
    for _, module in target_modules(obj):
        object.__setattr__(module, "shardkit_offload", record)  # a plain attribute, not a submodule
    if not isinstance(obj, (list, tuple)):
        object.__setattr__(obj, "shardkit_offload", None if strategy == "none" else (strategy, dict(options)))


# --- guards for the known traps ------------------------------------------------------------------

def refuse_device_mapped(obj: Offloadable, kind: str, strategy: str) -> None:
    if kind == "pipeline":
        device_map = getattr(obj, "hf_device_map", None)
        if isinstance(device_map, dict) and len(device_map) > 1:
            raise OffloadError(
                f"this pipeline was loaded with a device map ({_short_map(device_map)}); offload strategy "
                f"{strategy!r} needs the components on the host: call pipe.reset_device_map() first"
            )
        return
    for name, module in target_modules(obj):
        device_map = getattr(module, "hf_device_map", None)
        if isinstance(device_map, dict) and len(set(map(str, device_map.values()))) > 1:
            raise OffloadError(
                f"module {name or type(module).__name__} was dispatched over {_short_map(device_map)} by a device map; "
                f"offload strategy {strategy!r} would break that placement: load it with ",
                Option("device_map", None, choices=("cpu",))
            )


def _short_map(device_map: Mapping[object, object]) -> str:
    items = [f"{k}→{v}" for k, v in list(device_map.items())[:4]]
    return ", ".join(items) + (", ..." if len(device_map) > 4 else "")


def placed_devices(obj: Offloadable) -> set[str]:
    """Devices (``"cuda:0"``, ``"cpu"``...) holding the parameters of ``obj``, meta excluded."""
    devices = set()
    for _, module in target_modules(obj):
        for tensor in module.parameters():
            if not tensor.is_meta:
                devices.add(str(tensor.device))
    return devices


def refuse_on_accelerator(obj: Offloadable) -> None:
    on_accelerator = sorted(d for d in placed_devices(obj) if not d.startswith("cpu"))
    if on_accelerator:
        raise OffloadError(
            f"the weights were already moved to {', '.join(on_accelerator)} before sequential offload, which would keep "
            "them there and save nothing; move them back with .to('cpu') (do not call .to('cuda') before offloading)"
        )


# --- devices -------------------------------------------------------------------------------------

def compute_device(options: Options, key: str = "device") -> torch.device:
    import torch

    value = options.pop(key, None)
    if value is None:
        if not torch.cuda.is_available():
            raise OffloadError(
                "offloading needs an accelerator to compute on and none was found; pass device='cpu' to run the hooks "
                "on the host (useful for testing), or device='cuda:N'"
            )
        value = "cuda"
    device = torch.device(value) if not isinstance(value, torch.device) else value
    if device.type != "cpu" and device.index is None:
        device = torch.device(device.type, 0)
    return device
