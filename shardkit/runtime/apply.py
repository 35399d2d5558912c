"""The one place that applies runtime options to a loaded model or pipeline.

Order matters and is fixed here: switches first (they replace modules and dtypes), then fp8
layerwise casting (so offloaded copies are already in their storage dtype), then the offload
strategy's hooks — the order the diffusers docs give for combining them. ``load_model``,
``load_pipeline`` and the auto-fit planner all call :func:`apply_runtime`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

from ..errors import InvalidInputError

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch
    from diffusers import DiffusionPipeline
    from torch import nn

    from .casting import CastingReport

# A loaded model or pipeline: returned as given.
Loaded = TypeVar("Loaded", bound="nn.Module | DiffusionPipeline")

# ``(storage, compute)`` dtypes, or apply_layerwise_casting's keywords as a dict.
LayerwiseCasting: TypeAlias = "tuple[str | torch.dtype, str | torch.dtype] | Mapping[str, Any]"


@dataclass(frozen=True)
class RuntimeSetup:
    """What to apply after loading.

    ``layerwise_casting``: ``(storage, compute)`` dtypes or a dict of
    :func:`~shardkit.runtime.casting.apply_layerwise_casting` keywords. ``offload``: a strategy of
    :func:`~shardkit.runtime.offload.apply_offload` with ``offload_options``. ``switches``: see
    :mod:`shardkit.runtime.switches`. ``device``: the compute device offload hooks move weights to.
    """

    switches: Mapping[str, object] | list[str] | None = None
    layerwise_casting: LayerwiseCasting | None = None
    offload: str | None = None
    offload_options: Mapping[str, object] = field(default_factory=dict)
    device: str | None = None

    def __post_init__(self) -> None:
        if self.offload is None and self.offload_options:
            raise InvalidInputError(
                "offload_options given without offload=; name the strategy ('model', 'sequential', 'group' or 'none')"
            )


def apply_runtime(target: Loaded, setup: RuntimeSetup) -> Loaded:
    """Apply ``setup`` to ``target`` (an ``nn.Module`` or a diffusers pipeline) and return it.

    Args:
        target: the loaded model or pipeline.
        setup: switches, layerwise casting and offload to install, in that order.

    Returns:
        ``target``; a pipeline given layerwise casting gets ``shardkit_casting`` (the report).

    apply_runtime(pipe, RuntimeSetup(layerwise_casting=("float8_e4m3fn", "bfloat16"),
                                     offload="model"))
    """
    if setup.switches:
        from .switches import apply_switches

        log.debug("switches on %s: %s", type(target).__name__, apply_switches(target, setup.switches))
    if setup.layerwise_casting is not None:
        report = _cast(target, setup.layerwise_casting)
        log.debug("layerwise casting on %s: %s", type(target).__name__, report)
        if not _is_module(target):
            object.__setattr__(target, "shardkit_casting", report)
    if setup.offload is not None:
        from .offload import apply_offload

        options = dict(setup.offload_options)
        if setup.device is not None:
            options.setdefault("device", setup.device)
            if options.get("use_stream") and not str(setup.device).startswith("cuda"):
                options.pop("use_stream")  # streams need CUDA; the same grouping runs synchronously
        log.debug("offload %r on %s with %s", setup.offload, type(target).__name__, options)
        apply_offload(target, setup.offload, **options)
    return target


def _cast(target: nn.Module | DiffusionPipeline, spec: LayerwiseCasting) -> CastingReport:
    from .casting import apply_layerwise_casting

    if isinstance(spec, Mapping):
        return apply_layerwise_casting(target, **spec)
    try:
        storage, compute = spec
    except (TypeError, ValueError):
        raise InvalidInputError(
            f"layerwise_casting must be (storage_dtype, compute_dtype) or a dict of keywords, got {spec!r}"
        ) from None
    return apply_layerwise_casting(target, storage, compute)


def _is_module(target: object) -> bool:
    from torch import nn

    return isinstance(target, nn.Module)
