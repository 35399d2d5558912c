"""Planning without loading a byte, for local folders and ``hf://`` repositories (a header-only mirror).

``plan_model``: where a model's modules go for a memory budget, and optionally the peak GPU memory
of each offload strategy (what ``shardkit plan`` prints). ``fit``: the fastest inference setup
that fits a budget (what ``shardkit fit`` prints).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..devices import device_label
from ..errors import InvalidInputError, Option
from ..fitting.autofit import FitPlan, FitTarget
from ..fitting.candidates import DEFAULT_MARGIN, Candidate, Margin, speed_class

if TYPE_CHECKING:
    from ..devices import Budgets, MaxMemory
    from ..fitting.estimate import MemoryEstimate
    from ..loading.device_map import DevicePlan

__all__ = ["DEFAULT_MARGIN", "Candidate", "FitPlan", "Margin", "ModelPlan", "device_label", "fit", "plan_model", "speed_class"]


@dataclass(frozen=True)
class ModelPlan:
    """What :func:`plan_model` found: the device map for the budget and/or the strategies' estimate."""

    model: str
    checkpoint: str | None
    placement: DevicePlan | None
    strategies: MemoryEstimate | None

    def to_dict(self) -> dict[str, Any]:
        output: dict[str, Any] = {}
        if self.placement is not None:
            output.update(self.placement.to_dict())
            if self.checkpoint is not None:
                output["checkpoint"] = self.checkpoint  # the hf:// spec, not its temporary mirror
        if self.strategies is not None:
            output.setdefault("model", self.model)
            output["strategies"] = self.strategies.to_dict()
        return output


def plan_model(model: str, checkpoint: str | None = None, *, config: str | None = None,
               max_memory: Budgets | None = None, gpu_bytes: Sequence[int] = (),
               cpu_bytes: int | None = None, dtype: str | None = None, device_map: str = "auto",
               strict: bool = True, strategies: bool = False, token: str | None = None) -> ModelPlan:
    """The device map ``model`` would get for a budget, optionally for ``checkpoint``'s weights (``hf://`` too).

    Args:
        model: ``diffusers:ClassName``, ``transformers:ClassName`` or ``package.module:Name``.
        checkpoint: a local checkpoint or ``hf://ORG/REPO[@REVISION][/SUBFOLDER]`` (headers only).
        config: config.json (or its folder); default ``checkpoint/config.json``.
        max_memory, gpu_bytes, cpu_bytes: two spellings of one budget, merged.
        dtype, device_map, strict: as for :func:`shardkit.plan_device_map`.
        strategies: also estimate each offload strategy's peak GPU memory (against the largest GPU budget).
        token: a Hub token for ``hf://`` checkpoints.

    shardkit.plan_model("diffusers:UNet2DConditionModel", "hf://org/sd15/unet", gpu_bytes=[8 * 10**9])
    """
    if checkpoint is None:
        return _plan(model, None, config=config, max_memory=max_memory, gpu_bytes=gpu_bytes, cpu_bytes=cpu_bytes,
                     dtype=dtype, device_map=device_map, strict=strict, strategies=strategies, shown=None)
    from .sources import headers

    with headers(checkpoint, token=token) as local:  # hf://: a header-only mirror
        return _plan(model, local, config=config, max_memory=max_memory, gpu_bytes=gpu_bytes, cpu_bytes=cpu_bytes,
                     dtype=dtype, device_map=device_map, strict=strict, strategies=strategies, shown=checkpoint)


def _plan(model: str, checkpoint: str | None, *, config: str | None, max_memory: Budgets | None,
          gpu_bytes: Sequence[int], cpu_bytes: int | None, dtype: str | None, device_map: str, strict: bool,
          strategies: bool, shown: str | None) -> ModelPlan:
    from ..devices import gpu_and_cpu_bytes, merge_budgets

    budget = merge_budgets(max_memory, gpu_bytes=list(gpu_bytes), cpu_bytes=cpu_bytes)
    if budget is None and not strategies:
        raise InvalidInputError("give a budget (", Option("max_memory"), ", or ", Option("gpu_bytes"), " and ",
                                Option("cpu_bytes"), "), ",
                                Option("strategies", True), ", or both")
    if config is None and checkpoint is not None and os.path.isfile(os.path.join(checkpoint, "config.json")):
        config = os.path.join(checkpoint, "config.json")
    placement = estimate = None
    if budget is not None:
        from ..loading.device_map import plan_device_map

        placement = plan_device_map(model, config=config, checkpoint=checkpoint, max_memory=budget,
                                    dtype=dtype, device_map=device_map, strict=strict)
    if strategies:
        from ..fitting.estimate import estimate_memory
        from ..loading.skeleton import build_skeleton

        largest = max(gpu_and_cpu_bytes({d: b for d, b in (budget or {}).items() if d != "disk"})[0], default=None)
        estimate = estimate_memory(build_skeleton(model, config=config), gpu_bytes=largest, dtype=dtype,
                                   checkpoint=checkpoint)
    return ModelPlan(model, shown, placement, estimate)


def fit(target: FitTarget, *, gpu: Iterable[str | int] | str | int | None = None, cpu: str | int | None = None,
        max_memory: str | MaxMemory | None = None, height: int | None = None, width: int | None = None,
        batch_size: int = 1, guidance: bool | None = None, attention: str = "sdpa", dtype: str | None = None,
        allow_fp8: bool = True, exclude: Iterable[str] = (), margin: Margin = DEFAULT_MARGIN,
        device: str | None = None, token: str | None = None) -> FitPlan:
    """:func:`shardkit.fitting.autofit.fit`, for an ``hf://ORG/REPO[@REVISION][/SUBFOLDER]`` target too.

    An ``hf://`` target is read from its headers and configs only (a header-only mirror, removed
    after); ``token`` is the Hub token for it. Every other argument is as for the local ``fit``.

    shardkit.fit("hf://black-forest-labs/FLUX.1-dev", gpu=["16GB", "16GB"])
    """
    from ..fitting.autofit import fit as fit_local
    from .sources import headers, is_remote

    options: dict[str, Any] = dict(gpu=gpu, cpu=cpu, max_memory=max_memory, height=height, width=width,
                                   batch_size=batch_size, guidance=guidance, attention=attention, dtype=dtype,
                                   allow_fp8=allow_fp8, exclude=exclude, margin=margin, device=device)
    if not is_remote(target):
        return fit_local(target, **options)
    with headers(os.fspath(target), token=token) as local:
        return fit_local(local, **options)
