"""Peak accelerator memory of every single-GPU strategy, for a model or pipeline skeleton.

The report behind :func:`shardkit.estimate_memory` and ``shardkit plan --strategies``. It prices
the same :class:`~shardkit.fitting.profile.ComponentProfile` (weights per offload unit from
:mod:`shardkit.fitting.weights`, activations from :mod:`shardkit.fitting.activations`) with the same
strategy table (:data:`shardkit.fitting.peaks.STRATEGIES`) as :func:`shardkit.fit`, so a strategy has
one name and one peak everywhere. Unlike ``fit`` it reports every strategy, each without and with
fp8 layerwise casting, applies no safety margin and proposes no switches. The CUDA context
(~0.3–0.5 GB) is not included: numbers compare with ``torch.cuda.max_memory_allocated``.

report = estimate_memory(skeleton, gpu_bytes=16 * 10**9, dtype="bf16")
print(report.table())
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..errors import InvalidInputError
from ..units import format_size
from .activations import NO_SWITCH, Workload
from .peaks import STRATEGIES, Strategy, View
from .profile import ComponentProfile, profile_module
from .weights import ComponentSizes, Footprint

if TYPE_CHECKING:
    import torch
    from diffusers import DiffusionPipeline
    from torch import nn


__all__ = ["DEFAULT_TOKENS", "ComponentSizes", "Footprint", "MemoryEstimate", "StrategyEstimate", "StrategySpec", "estimate_memory",
           "strategy_peaks", "strategy_specs"]

# 4096 tokens: a 1024² image in a Flux-like latent space (8x VAE, 2x2 patches), batch 1.
DEFAULT_TOKENS = 4096


@dataclass(frozen=True)
class StrategySpec:
    """A strategy with or without fp8 casting: arguments for ``apply_offload`` / ``apply_layerwise_casting``."""

    strategy: Strategy
    fp8: bool
    speed_rank: int            # 0 = fastest; a class, not a measurement

    @property
    def name(self) -> str:
        return self.strategy.name + ("+fp8" if self.fp8 else "")

    @property
    def offload(self) -> str:
        return self.strategy.offload or "none"

    @property
    def options(self) -> dict[str, object]:
        return dict(self.strategy.offload_options)

    @property
    def layerwise_casting(self) -> tuple[str, str] | None:
        return ("float8_e4m3fn", "bfloat16") if self.fp8 else None


@dataclass(frozen=True)
class StrategyEstimate:
    """One row: weights (with the running layer's fp8 upcast) and activations at the peak."""

    spec: StrategySpec
    param_bytes: int
    activation_bytes: int
    fits: bool | None = None

    @property
    def peak_bytes(self) -> int:
        return self.param_bytes + self.activation_bytes

    def to_dict(self) -> dict[str, object]:
        return {
            "strategy": self.spec.name, "offload": self.spec.offload, "offload_options": self.spec.options,
            "layerwise_casting": list(self.spec.layerwise_casting or []) or None, "speed_rank": self.spec.speed_rank,
            "param_bytes": self.param_bytes, "activation_bytes": self.activation_bytes,
            "peak_bytes": self.peak_bytes, "fits": self.fits,
        }


def strategy_specs() -> list[StrategySpec]:
    """Every single-GPU strategy without and with fp8 casting, fastest first (as :func:`shardkit.fit` ranks)."""
    pairs = sorted(((s, fp8) for s in STRATEGIES if s.min_gpus == 1 for fp8 in (False, True)),
                   key=lambda pair: pair[0].slowdown_with(pair[1]))
    return [StrategySpec(s, fp8, rank) for rank, (s, fp8) in enumerate(pairs)]


def strategy_peaks(
    components: Sequence[ComponentSizes], *, activation_bytes: int | Sequence[int] = 0, gpu_bytes: int | None = None,
    specs: Sequence[StrategySpec] | None = None,
) -> list[StrategyEstimate]:
    """One :class:`StrategyEstimate` per spec for a model (one component) or a pipeline (several).

    Pure: a function of the sizes only. ``activation_bytes`` is one number for every component or
    one per component.

    >>> c = ComponentSizes("m", Footprint(100, 40), rest=Footprint(10, 10),
    ...                    block_lists=((Footprint(45, 15), Footprint(45, 15)),))
    >>> [(e.spec.name, e.param_bytes) for e in strategy_peaks([c])][:3]
    [('gpu', 100), ('model_offload', 100), ('gpu+fp8', 40)]
    """
    if not components:
        raise InvalidInputError("memory estimate: no components with parameters")
    acts = [activation_bytes] * len(components) if isinstance(activation_bytes, int) else list(activation_bytes)
    rows = []
    for spec in specs if specs is not None else strategy_specs():
        views = [View(c.name, "", c, spec.fp8, a) for c, a in zip(components, acts, strict=True)]
        peaks = spec.strategy.peaks(views, ())
        peak, act = peaks.gpu[0], peaks.activation_bytes
        fits = None if gpu_bytes is None else peak <= gpu_bytes
        rows.append(StrategyEstimate(spec, peak - act, act, fits))
    return rows


# --- the report ----------------------------------------------------------------------------------

@dataclass
class MemoryEstimate:
    """What :func:`estimate_memory` returns: rows per strategy plus what they were computed from."""

    rows: list[StrategyEstimate]
    components: list[ComponentSizes]
    gpu_bytes: int | None = None
    notes: list[str] = field(default_factory=list)

    def row(self, name: str) -> StrategyEstimate:
        for r in self.rows:
            if r.spec.name == name:
                return r
        raise KeyError(name)

    def fitting(self) -> list[StrategyEstimate]:
        """Rows that fit ``gpu_bytes``, fastest first."""
        return sorted((r for r in self.rows if r.fits), key=lambda r: r.spec.speed_rank)

    def to_dict(self) -> dict[str, object]:
        return {
            "gpu_bytes": self.gpu_bytes,
            "components": {c.name: {"bytes": c.total.plain_bytes, "fp8_bytes": c.total.fp8_bytes} for c in self.components},
            "strategies": [r.to_dict() for r in self.rows],
            "notes": list(self.notes),
        }

    def table(self) -> str:
        head = f"{'strategy':<24} {'params':>10} {'activations':>12} {'peak':>10}  fits"
        lines = [head, "-" * len(head)]
        for r in sorted(self.rows, key=lambda r: r.spec.speed_rank):
            fits = "-" if r.fits is None else ("yes" if r.fits else "no")
            lines.append(f"{r.spec.name:<24} {format_size(r.param_bytes):>10} {format_size(r.activation_bytes):>12} "
                         f"{format_size(r.peak_bytes):>10}  {fits}")
        if self.gpu_bytes is not None:
            lines.append(f"GPU budget: {format_size(self.gpu_bytes)}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


# --- the public entry point ----------------------------------------------------------------------

def estimate_memory(
    skeleton: torch.nn.Module | Mapping[str, torch.nn.Module] | DiffusionPipeline, *,
    gpu_bytes: int | str | None = None, dtype: str | torch.dtype | None = None,
    checkpoint: str | os.PathLike[str] | None = None, activation_bytes: int | None = None,
    tokens: int = DEFAULT_TOKENS, compute_dtype: str | torch.dtype | None = None,
    cast_components: Sequence[str] | None = None,
) -> MemoryEstimate:
    """Estimate the peak accelerator memory of every single-GPU strategy, with and without fp8 casting.

    Args:
        skeleton: an ``nn.Module`` (a meta skeleton from ``init_empty_weights`` is enough), a
            ``{name: module}`` mapping or a diffusers pipeline.
        gpu_bytes: the GPU size rows are marked ``fits`` against (``"16GB"`` or bytes; no margin).
        dtype: the load dtype floats are priced at (what ``load_model(dtype=)`` would cast to);
            else the ``checkpoint`` headers' dtypes, else the skeleton's.
        checkpoint: a file/folder whose headers give the dtypes; for a mapping or pipeline, a
            pipeline folder with one subfolder per component.
        activation_bytes: override the activation estimate (bytes, every component).
        tokens: the workload, as latent tokens of a square image of side ``16·√tokens`` pixels
            (4096: 1024², batch 1) that :mod:`shardkit.fitting.activations` prices.
        compute_dtype: the compute dtype of activations and fp8 upcasts (default: the load dtype).
        cast_components: components fp8 casting applies to (default: the denoiser, or the module).

    Returns:
        A :class:`MemoryEstimate`: one row per strategy (names as :func:`shardkit.fit` uses them,
        ``+fp8`` for casting), the component sizes and notes on where the numbers came from.

    with accelerate.init_empty_weights():
        unet = UNet2DConditionModel.from_config(config)
    print(estimate_memory(unet, gpu_bytes="8GB", dtype="fp16").table())
    """
    from torch import nn

    from ..runtime.casting import DEFAULT_PIPELINE_COMPONENTS
    from ..units import parse_size

    modules = _component_modules(skeleton)
    per_component = not isinstance(skeleton, nn.Module)
    budget = None if gpu_bytes is None else parse_size(gpu_bytes, name="gpu size")
    load, compute = _itemsize(dtype), _itemsize(compute_dtype)
    if not per_component:
        cast_names = set(modules)
    else:
        cast_names = set(cast_components if cast_components is not None else DEFAULT_PIPELINE_COMPONENTS)
    side = 16 * math.isqrt(tokens)
    profiles, notes = [], []
    for name, module in modules.items():
        stored = _checkpoint_bytes(checkpoint, name, per_component)
        profile = profile_module(module, Workload(side, side), name=name, dtype_bytes=load, stored_bytes=stored,
                                 cast=name in cast_names, compute_bytes=compute)
        if activation_bytes is not None:
            profile = replace(profile, activation_bytes={NO_SWITCH: activation_bytes})
        profiles.append(profile)
        source = f"dtype={dtype}" if load else "checkpoint headers" if stored else "the skeleton"
        notes.append(f"{name}: dtypes from {source}")
    notes.append(f"activations: {side}x{side} image, batch 1, x2 under classifier-free guidance "
                 "(shardkit.fitting.activations; pass activation_bytes= to override)"
                 if activation_bytes is None else "activations: given")
    notes.append("peaks exclude the CUDA context (~0.3-0.5 GB); fp8 rows cast " + ", ".join(sorted(cast_names & set(modules))))
    return report(profiles, gpu_bytes=budget, notes=notes)


def report(profiles: Sequence[ComponentProfile], *, gpu_bytes: int | None = None,
           notes: Sequence[str] = ()) -> MemoryEstimate:
    """The :class:`MemoryEstimate` of profiles, as :func:`shardkit.fit` would price them without switches."""
    components = [p.weights for p in profiles]
    acts = [p.activation_bytes.get(NO_SWITCH, 0) for p in profiles]
    return MemoryEstimate(strategy_peaks(components, activation_bytes=acts, gpu_bytes=gpu_bytes), components,
                          gpu_bytes, list(notes))


def _component_modules(skeleton: object) -> dict[str, nn.Module]:
    from torch import nn

    if isinstance(skeleton, nn.Module):
        return {"model": skeleton}
    items = getattr(skeleton, "components", skeleton)
    if isinstance(items, Mapping):
        modules = {k: v for k, v in items.items() if isinstance(v, nn.Module)}
        if modules:
            return modules
    raise InvalidInputError(f"memory estimate needs an nn.Module, a {{name: module}} mapping or a pipeline, got {type(skeleton).__name__}")


def _itemsize(value: str | torch.dtype | None) -> int | None:
    from ..formats.dtypes import resolve_torch_dtype

    resolved = resolve_torch_dtype(value)
    return None if resolved is None else resolved.itemsize


def _checkpoint_bytes(checkpoint: Any, name: str, per_component: bool) -> dict[str, int]:
    """Tensor name → stored bytes from the checkpoint headers (no tensor data is read)."""
    from ..sources import open_source

    if checkpoint is None:
        return {}
    if isinstance(checkpoint, Mapping):
        checkpoint = checkpoint.get(name)
        if checkpoint is None:
            return {}
    elif per_component:
        checkpoint = os.path.join(os.fspath(checkpoint), name)
        if not os.path.isdir(checkpoint):
            return {}
    with open_source(checkpoint) as source:
        return {e.name: e.nbytes for e in source.entries()}
