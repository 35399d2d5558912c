"""Auto-fit: rank the inference setups a pipeline could run with, keep those that fit, pick the fastest.

The planner (:func:`plan_fit`) is pure: it takes :class:`~shardkit.fitting.profile.ComponentProfile`
numbers (weights per offload unit, activations per switch set), a :class:`Budget` and a
:class:`Margin`, and returns a :class:`FitPlan`. :func:`fit` builds the profiles from a folder's
headers and configs, or from a module (never loading weights), and calls it.

The candidates are the strategies of :data:`~shardkit.fitting.peaks.STRATEGIES` (their speed classes
and peak formulas are documented there, and :func:`shardkit.estimate_memory` prices the same
ones), each with or without fp8 layerwise casting, plus VAE tiling (x1.03), attention slicing
(x1.1) and VAE slicing (free) where components support them. Safety margin
(:data:`DEFAULT_MARGIN`): each GPU keeps 10% of its budget plus 512 MiB (CUDA context,
cuBLAS/cuDNN workspaces, fragmentation) free, the CPU 10%.

plan = fit("sdxl-sharded/", gpu=["8GB"], cpu="24GB")
print(plan)
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias, TypedDict, TypeVar

from ..errors import FitError as FitError  # re-exported: defined with every public error
from ..errors import InvalidInputError, Option, Part
from ..units import format_size
from .activations import Workload
from .candidates import DEFAULT_MARGIN, Budget, Candidate, Margin, rank, speed_class
from .peaks import STRATEGIES, DeviceSpread
from .profile import ComponentProfile

if TYPE_CHECKING:
    import torch
    from diffusers import DiffusionPipeline
    from torch import nn

    from ..devices import MaxMemory

# A loaded pipeline or model: returned as given.
Loaded = TypeVar("Loaded", bound="nn.Module | DiffusionPipeline")


class FitSetup(TypedDict):
    """What a plan installs (``FitPlan.setup()``)."""

    placement: str
    offload: str | None
    offload_options: dict[str, object]
    layerwise_casting: tuple[str, str] | None
    switches: list[str]
    device_map: dict[str, DeviceSpread] | None

__all__ = ["STRATEGIES", "Budget", "Candidate", "ComponentProfile", "FitError", "FitPlan", "Margin", "Workload",
           "apply_plan", "fit", "plan_fit"]


# ----------------------------------------------------------------------------- the plan

@dataclass(frozen=True)
class FitPlan:
    """The chosen setup, every candidate ranked, and why each faster one was ruled out.

    ``print(plan)`` explains the choice; :meth:`setup` is what :func:`apply_plan` installs.
    """

    chosen: Candidate
    candidates: tuple[Candidate, ...]
    budget: Budget
    margin: Margin
    workload: Workload
    components: tuple[ComponentProfile, ...]
    device: str | None = None

    def why(self) -> list[str]:
        """One line per faster candidate: the constraint that ruled it out."""
        lines = []
        for c in self.candidates:
            if c is self.chosen:
                break
            lines.append(f"{c.label} ({c.slowdown:.2f}x): {c.reason}")
        chosen = self.chosen
        if chosen.switches and chosen.plain_reason:
            plain = " + ".join([chosen.strategy.label, *(["fp8 layerwise casting"] if chosen.fp8 else [])])
            lines.append(f"{plain} without {', '.join(s.replace('_', ' ') for s in chosen.switches)}: "
                         f"{chosen.plain_reason}")
        return lines

    def setup(self) -> FitSetup:
        """What to install: offload and options, fp8 casting, switches, device map.

        ``"placement"`` names the chosen strategy (the key predates the strategy table).
        """
        strategy = self.chosen.strategy
        dtype_bytes = max((p.dtype_bytes for p in self.components), default=2)
        return {
            "placement": strategy.name,
            "offload": strategy.offload,
            "offload_options": dict(strategy.offload_options),
            "layerwise_casting": ("float8_e4m3fn", {2: "bfloat16", 4: "float32"}.get(dtype_bytes, "bfloat16"))
            if self.chosen.fp8 else None,
            "switches": list(self.chosen.switches),
            "device_map": dict(self.chosen.peaks.device_map) if self.chosen.peaks.device_map else None,
        }

    def to_dict(self) -> dict[str, object]:
        w = self.workload
        return {
            "chosen": self.chosen.to_dict(),
            "setup": self.setup(),
            "why": self.why(),
            "budget": {"gpu_bytes": list(self.budget.gpu_bytes), "cpu_bytes": self.budget.cpu_bytes},
            "margin": {"fraction": self.margin.fraction, "gpu_reserve_bytes": self.margin.gpu_reserve_bytes},
            "workload": {"height": w.height, "width": w.width, "batch_size": w.batch_size,
                         "guidance": w.guidance, "attention": w.attention},
            "components": [{"name": p.name, "role": p.role, "weight_bytes": p.weight_bytes,
                            "activation_bytes": max(p.activation_bytes.values(), default=0),
                            "fp8_saving_bytes": p.fp8_saving_bytes, "switches": sorted(p.switches()),
                            "notes": list(p.notes), "guessed": list(p.guessed)} for p in self.components],
            "guessed": [f"{p.name}: {g}" for p in self.components for g in p.guessed],
            "candidates": [c.to_dict() for c in self.candidates],
        }

    def workload_line(self) -> str:
        """What the activations were priced for, e.g. ``1024x1024, batch 1 (x2 for guidance), sdpa attention``."""
        w = self.workload
        guided = " (x2 for classifier-free guidance)" if w.guidance else ""
        bits = max((p.dtype_bytes for p in self.components), default=2) * 8
        return f"{w.height}x{w.width}, batch {w.batch_size}{guided}, {w.attention} attention, {bits}-bit compute"

    def __str__(self) -> str:
        c = self.chosen
        peaks = ", ".join(f"{dev} {format_size(b)}" for dev, b in c.peak_by_device().items())
        lines = [f"chosen: {c.label} (speed {c.slowdown:.2f}x of all-on-one-GPU, {speed_class(c.slowdown)})",
                 f"estimated peak: {peaks}"]
        if self.device and not str(self.device).startswith("cuda"):
            lines.append(f"runs on: {self.device} (the GPU budget describes that device)")
        why = self.why()
        if why:
            lines.append("faster setups ruled out:")
            lines += [f"  - {line}" for line in why]
        notes = [n for p in self.components for n in (f"{p.name}: {x}" for x in p.notes)]
        lines += [f"note: {n}" for n in notes]
        lines += [f"guessed: {p.name}: {g}" for p in self.components for g in p.guessed]
        return "\n".join(lines)


def plan_fit(profiles: Sequence[ComponentProfile], budget: Budget, *, workload: Workload | None = None,
             margin: Margin = DEFAULT_MARGIN, allow_fp8: bool = True, streams: bool = True,
             exclude: Iterable[str] = (), device: str | None = None) -> FitPlan:
    """Pick the fastest candidate whose estimated peak fits ``budget`` with ``margin``.

    Pure: profiles are plain numbers, so tests and tools can plan for fake sizes.

    Args:
        profiles: one :class:`~shardkit.fitting.profile.ComponentProfile` per component.
        budget: memory per GPU and for the CPU.
        workload: what the profiles were computed for (reported only).
        margin: memory kept free on each device.
        allow_fp8: whether fp8 layerwise casting may be proposed.
        streams: whether CUDA-stream strategies may be proposed (False without CUDA).
        exclude: strategy names or prefixes to drop (``"group"``, ``"staged"``, ``"fp8"``).
        device: where :func:`apply_plan` will run the model (reported only).

    Returns:
        The :class:`FitPlan`: the chosen candidate and every candidate ranked.

    Raises:
        FitError: nothing fits; the message and attributes name the smallest budget that would.

    >>> unet = ComponentProfile.from_totals("unet", "denoiser", weight_bytes=5 * 10**9,
    ...                                     block_bytes=(10**9,) * 4, leaf_bytes=10**8,
    ...                                     activation_bytes={"": 10**9})
    >>> plan_fit([unet], Budget((8 * 10**9,)), margin=Margin(0.1, 0)).chosen.strategy.name
    'gpu'
    """
    if not profiles:
        raise InvalidInputError("nothing to fit: no component with weights")
    if any(b <= 0 for b in budget.gpu_bytes) or (budget.cpu_bytes is not None and budget.cpu_bytes <= 0):
        raise InvalidInputError("memory budgets must be greater than zero")
    if not budget.gpu_bytes and budget.cpu_bytes is None:
        raise InvalidInputError("no memory budget: give at least one GPU budget (", Option("gpu", "8GB"),
                                ") or a CPU budget")
    candidates = tuple(rank(profiles, budget, margin=margin, allow_fp8=allow_fp8, streams=streams, exclude=exclude))
    chosen = next((c for c in candidates if c.fits), None)
    if chosen is None:
        raise _no_fit(candidates, budget, margin)
    return FitPlan(chosen, candidates, budget, margin, workload or Workload(), tuple(profiles), device)


def _no_fit(candidates: Sequence[Candidate], budget: Budget, margin: Margin) -> FitError:
    """The error for an impossible budget, with the smallest single-device budget that fits.

    The budget is printed as flags to paste back (``--gpu 1.31GB``), rounded up so that exactly
    the printed flags fit.
    """
    options = []
    for c in candidates:
        if c.strategy.min_gpus > 1 or (c.strategy.min_gpus == 1 and not c.peaks.gpu):
            continue
        gpu = margin.budget_for(int(max(c.peaks.gpu, default=0)), gpu=True) if c.peaks.gpu else 0
        cpu = margin.budget_for(int(c.peaks.cpu), gpu=False)
        options.append((gpu, cpu, c))
    within_cpu = [o for o in options if budget.cpu_bytes is None or o[1] <= budget.cpu_bytes]
    gpu, cpu, best = min(within_cpu or options, key=lambda o: (o[0], o[1], o[2].slowdown))
    have = ", ".join([f"cuda:{i} {format_size(b)}" for i, b in enumerate(budget.gpu_bytes)]
                     + ([f"cpu {format_size(budget.cpu_bytes)}"] if budget.cpu_bytes is not None else []))
    margin_text = f"{margin.fraction:.0%} of each budget" + (
        f" + {format_size(margin.gpu_reserve_bytes)} per GPU" if margin.gpu_reserve_bytes else "")
    need = _budget_flags(gpu, cpu, best, budget, with_cpu=not within_cpu)
    lowest = min(options, key=lambda o: (o[0], o[1], o[2].slowdown))
    if budget.gpu_bytes and lowest[0] < gpu:
        need += (", or ", *_budget_flags(*lowest, budget, with_cpu=True))
    return FitError(
        f"no setup fits the budget ({have}; margin {margin_text}): the smallest budget that would fit is ", *need,
        min_gpu_bytes=gpu if budget.gpu_bytes else None, min_cpu_bytes=cpu,
    )


def _budget_flags(gpu_bytes: int, cpu_bytes: int, candidate: Candidate, budget: Budget, *,
                  with_cpu: bool) -> tuple[Part, ...]:
    """``gpu='1.31GB' [cpu='4.41MB'] (setup)`` (``--gpu 1.31GB [--cpu 4.41MB]`` in the CLI): the budget to rerun
    with, then what it pays for."""
    if not budget.gpu_bytes:
        return Option("cpu", size_flag(cpu_bytes)), f" ({candidate.label})"
    flags: tuple[Part, ...] = (Option("gpu", size_flag(gpu_bytes)),)
    if with_cpu:
        flags += (" ", Option("cpu", size_flag(cpu_bytes)))
    one = " on one GPU" if len(budget.gpu_bytes) > 1 else ""
    cpu_note = "" if with_cpu or not candidate.peaks.cpu else f", {format_size(cpu_bytes)} of CPU RAM"
    return *flags, f"{one} ({candidate.label}{cpu_note})"


def size_flag(size_bytes: int) -> str:
    """The shortest size text (two decimals, no space) that parses back to at least ``size_bytes``.

    Rounds up, so a budget printed as a flag is never below the bytes it stands for.

    Args:
        size_bytes: the smallest acceptable size.

    Returns:
        A size string for ``--gpu``/``--cpu`` or ``gpu=``/``cpu=``.

    >>> size_flag(1_301_000_001), size_flag(999)
    ('1.31GB', '999B')
    """
    from ..units import parse_size

    if size_bytes < 1000:
        return f"{max(size_bytes, 1)}B"
    scale, unit = next((10**e, u) for e, u in ((12, "TB"), (9, "GB"), (6, "MB"), (3, "KB"))
                       if size_bytes >= 10**e)
    hundredths = -(-size_bytes * 100 // scale)
    text = f"{hundredths // 100}.{hundredths % 100:02d}{unit}"
    while parse_size(text) < size_bytes:  # the parser multiplies floats: it may land one byte short
        hundredths += 1
        text = f"{hundredths // 100}.{hundredths % 100:02d}{unit}"
    return text


# ----------------------------------------------------------------------------- public entry points

# A pipeline folder or one component folder, a module (a meta skeleton is enough), or profiles.
FitTarget: TypeAlias = "str | os.PathLike[str] | torch.nn.Module | Sequence[ComponentProfile]"


def fit(target: FitTarget, *, gpu: Iterable[str | int] | str | int | None = None, cpu: str | int | None = None,
        max_memory: str | MaxMemory | None = None, height: int | None = None, width: int | None = None,
        batch_size: int = 1, guidance: bool | None = None, attention: str = "sdpa", dtype: str | None = None,
        allow_fp8: bool = True, exclude: Iterable[str] = (), margin: Margin = DEFAULT_MARGIN,
        device: str | None = None) -> FitPlan:
    """Choose the fastest inference setup for ``target`` that fits the memory budget; load nothing.

    Args:
        target: a diffusers pipeline folder, one component folder (``unet/``), an ``nn.Module``
            (a meta skeleton is enough) or a list of :class:`~shardkit.fitting.profile.ComponentProfile`.
        gpu, cpu: budgets, ``gpu=["8GB", "16GB"]`` (one per GPU) and ``cpu="24GB"``.
        max_memory: accelerate-style budgets instead, ``{0: "8GB", "cpu": "24GB"}``.
        height, width, batch_size, guidance: the workload (default: the pipeline's image size,
            1024² for a module; classifier-free guidance unless the denoiser embeds guidance).
        attention: ``"sdpa"``, or ``"eager"`` for kernels that materialise attention scores.
        dtype: the load/compute dtype (``"bf16"``; default: the checkpoint's, or the module's).
        allow_fp8: whether fp8 layerwise casting may be proposed.
        exclude: strategy names or prefixes to drop (``"group"``, ``"sequential"``, ``"fp8"``).
        margin: memory kept free on each device.
        device: where :func:`apply_plan` runs the model (default ``cuda``); ``"cpu"`` plans
            without CUDA streams and exercises the same hooks on the CPU.

    Returns:
        The :class:`FitPlan`; ``print(plan)`` explains the choice.

    Raises:
        FitError: no setup fits; it names the smallest budget that would.

    plan = fit("sdxl-sharded/", gpu="8GB", cpu="24GB", height=1024, width=1024)
    plan.setup()["offload"], plan.chosen.peak_by_device()
    """
    import os

    from .profile import profile_folder, profile_module, resolve_workload

    if attention not in ("sdpa", "eager"):
        raise InvalidInputError(f"attention must be 'sdpa' or 'eager', got {attention!r}")
    for name, value in (("height", height), ("width", width), ("batch_size", batch_size)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise InvalidInputError(f"{name} must be a positive integer, got {value!r}")
    workload = Workload(height, width, batch_size, guidance, attention)
    budget = Budget.parse(gpu, cpu, max_memory)
    if isinstance(target, (str, os.PathLike)) and os.path.isdir(target):
        from ..atomic.snapshot import wait_settled

        wait_settled(target)  # a crashed write's journal is reported, never rolled forward
    if isinstance(target, (str, os.PathLike)):
        workload = resolve_workload(os.fspath(target), workload)
        profiles = profile_folder(os.fspath(target), workload, dtype=dtype)
    elif isinstance(target, (list, tuple)) and all(isinstance(p, ComponentProfile) for p in target):
        profiles = list(target)
    elif hasattr(target, "named_parameters"):
        from .profile import module_config

        if guidance is None:
            guidance = not module_config(target).get("guidance_embeds", False)
        workload = Workload(height or 1024, width or 1024, batch_size, guidance, attention)
        profiles = [profile_module(target, workload, dtype_bytes=_dtype_bytes(dtype))]
    else:
        raise InvalidInputError(f"fit needs a folder, an nn.Module or component profiles, got {type(target).__name__}")
    streams = device is None or str(device).startswith("cuda")
    return plan_fit(profiles, budget, workload=workload, margin=margin, allow_fp8=allow_fp8, streams=streams,
                    exclude=exclude, device=device)


def _dtype_bytes(dtype: str | None) -> int | None:
    from ..units import DTYPE_BITS, normalize_dtype

    return DTYPE_BITS[normalize_dtype(dtype)] // 8 if dtype else None


def apply_plan(pipe: Loaded, plan: FitPlan, *, device: str | None = None) -> Loaded:
    """Install ``plan``'s setup on a loaded pipeline (or model) and set ``pipe.shardkit_plan``.

    Args:
        pipe: the loaded pipeline or model.
        plan: a plan from :func:`fit` / :func:`plan_fit`.
        device: the compute device (default: the plan's, else ``cuda`` when available, else ``cpu``).

    Returns:
        ``pipe``. Multi-GPU strategies are chosen at load time (:func:`shardkit.load_pipeline`
        passes them as ``device_map``); here they only check that the pipeline was placed.

    apply_plan(pipe, fit("sdxl/", gpu="8GB"))
    """
    import torch

    from ..runtime.apply import RuntimeSetup, apply_runtime

    setup = plan.setup()
    device = device or plan.device or ("cuda" if torch.cuda.is_available() else "cpu")
    apply_runtime(pipe, RuntimeSetup(switches=setup["switches"], layerwise_casting=setup["layerwise_casting"] or None,
                                     offload=setup["offload"] or None, offload_options=setup["offload_options"] or {},
                                     device=device))
    resident = plan.chosen.strategy.resident
    if resident is not None:
        pipe.to(device if resident == "device" else "cpu")  # type: ignore[union-attr]  # DiffusionPipeline.to, which mypy misses
    object.__setattr__(pipe, "shardkit_plan", plan)
    return pipe
