"""Auto-fit: rank the inference setups a pipeline could run with, keep those that fit, pick the fastest.

The planner (:func:`plan_fit`) is pure: it takes :class:`~shardkit.fit_sizes.ComponentProfile`
numbers (weights per offload unit, activations per switch set), a :class:`Budget` and a
:class:`Margin`, and returns a :class:`FitPlan`. :func:`fit` builds the profiles from a folder's
headers and configs (never loading weights) and calls it.

Candidates, by expected time per image relative to everything on one GPU (coarse classes taken
from the diffusers memory guides; transfers are what cost):

==========================  =====  ======================================================
setup                       speed  peak on the GPU
==========================  =====  ======================================================
all on one GPU              1.0x   Σ weights + largest activation
balanced across GPUs        1.0x   per GPU: its whole components + their largest activation
staged (denoiser split)     1.05x  per GPU: its share of denoiser blocks + other components
model offload               1.25x  largest (component weights + its activations)
group block, stream         1.35x  unmatched params + 2 adjacent blocks (prefetch) + activations
group leaf, stream          1.5x   2 largest leaves + activations
group block, n=4/2/1        1.7x–1.9x  unmatched params + n blocks + activations
group leaf                  3.0x   largest leaf + activations
sequential offload          8.0x   largest leaf + activations
==========================  =====  ======================================================

fp8 layerwise casting multiplies the time by 1.1 and stores castable weights in one byte (plus one
layer upcast at a time); VAE tiling ×1.03, attention slicing ×1.1, VAE slicing free. Offloading
setups hold every offloaded weight in CPU RAM. Safety margin (:data:`DEFAULT_MARGIN`): each GPU
keeps 10% of its budget plus 512 MiB (CUDA context, cuBLAS/cuDNN workspaces, fragmentation) free,
the CPU 10%.

>>> plan = fit("sdxl-sharded/", gpu=["8GB"], cpu="24GB")   # doctest: +SKIP
>>> print(plan)                                           # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from ..errors import InvalidInputError
from ..units import format_size
from .candidates import (
    DEFAULT_MARGIN,
    PLACEMENTS,
    Budget,
    Candidate,
    Margin,
    fp8_saving,
    rank,
    speed_class,
)
from .profile import ComponentProfile, Workload

__all__ = ["Budget", "Candidate", "ComponentProfile", "FitError", "FitPlan", "Margin", "PLACEMENTS", "Workload",
           "apply_plan", "fit", "plan_fit"]


class FitError(InvalidInputError):
    """No candidate setup fits the memory budget; says the smallest budget that would."""

    def __init__(self, message: str, *, min_gpu_bytes: int | None = None, min_cpu_bytes: int | None = None) -> None:
        super().__init__(message)
        self.min_gpu_bytes = min_gpu_bytes
        self.min_cpu_bytes = min_cpu_bytes


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
            plain = " + ".join([chosen.placement.label, *(["fp8 layerwise casting"] if chosen.fp8 else [])])
            lines.append(f"{plain} without {', '.join(s.replace('_', ' ') for s in chosen.switches)}: "
                         f"{chosen.plain_reason}")
        return lines

    def setup(self) -> dict[str, Any]:
        """What to install: offload strategy and options, fp8 casting, switches, placement."""
        placement = self.chosen.placement
        dtype_bytes = max((p.dtype_bytes for p in self.components), default=2)
        return {
            "placement": placement.name,
            "offload": placement.offload,
            "offload_options": dict(placement.offload_options),
            "layerwise_casting": ("float8_e4m3fn", {2: "bfloat16", 4: "float32"}.get(dtype_bytes, "bfloat16"))
            if self.chosen.fp8 else None,
            "switches": list(self.chosen.switches),
            "device_map": dict(self.chosen.peaks.device_map) if self.chosen.peaks.device_map else None,
        }

    def to_dict(self) -> dict[str, Any]:
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
                            "fp8_saving_bytes": fp8_saving(p), "switches": sorted(p.switches()),
                            "notes": list(p.notes)} for p in self.components],
            "candidates": [c.to_dict() for c in self.candidates],
        }

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
        return "\n".join(lines)


def plan_fit(profiles: Sequence[ComponentProfile], budget: Budget, *, workload: Workload | None = None,
             margin: Margin = DEFAULT_MARGIN, allow_fp8: bool = True, streams: bool = True,
             exclude: Iterable[str] = (), device: str | None = None) -> FitPlan:
    """Pick the fastest candidate whose estimated peak fits ``budget`` with ``margin``.

    Pure: profiles are plain numbers (see :class:`~shardkit.fit_sizes.ComponentProfile`).
    Raises :class:`FitError` naming the smallest budget that would fit when none does.

    >>> unet = ComponentProfile("unet", "denoiser", weight_bytes=5 * 10**9, block_bytes=(10**9,) * 4,
    ...                         leaf_bytes=10**8, activation_bytes={"": 10**9})
    >>> plan_fit([unet], Budget((8 * 10**9,)), margin=Margin(0.1, 0)).chosen.placement.name
    'gpu'
    """
    if not profiles:
        raise InvalidInputError("nothing to fit: no component with weights")
    if any(b <= 0 for b in budget.gpu_bytes) or (budget.cpu_bytes is not None and budget.cpu_bytes <= 0):
        raise InvalidInputError("memory budgets must be greater than zero")
    if not budget.gpu_bytes and budget.cpu_bytes is None:
        raise InvalidInputError("no memory budget: give at least one GPU budget (--gpu 8GB) or a CPU budget")
    candidates = tuple(rank(profiles, budget, margin=margin, allow_fp8=allow_fp8, streams=streams, exclude=exclude))
    chosen = next((c for c in candidates if c.fits), None)
    if chosen is None:
        raise _no_fit(candidates, budget, margin)
    return FitPlan(chosen, candidates, budget, margin, workload or Workload(), tuple(profiles), device)


def _no_fit(candidates: Sequence[Candidate], budget: Budget, margin: Margin) -> FitError:
    """The error for an impossible budget, with the smallest single-device budget that fits."""
    options = []
    for c in candidates:
        if c.placement.min_gpus > 1 or (c.placement.min_gpus == 1 and not c.peaks.gpu):
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

    def wording(g: int, c: int, cand: Candidate, *, with_cpu: bool) -> str:
        size = f"--gpu {format_size(g)}" if budget.gpu_bytes else f"--cpu {format_size(c)}"
        if budget.gpu_bytes and with_cpu:
            size += f" --cpu {format_size(c)}"
        return f"{size} ({cand.label})"

    need = wording(gpu, cpu, best, with_cpu=not within_cpu or budget.cpu_bytes is None)
    lowest = min(options, key=lambda o: (o[0], o[1], o[2].slowdown))
    if budget.gpu_bytes and lowest[0] < gpu:
        need += f", or {wording(*lowest, with_cpu=True)}"
    return FitError(
        f"no setup fits the budget ({have}; margin {margin_text}): the smallest budget that would fit is {need}",
        min_gpu_bytes=gpu if budget.gpu_bytes else None, min_cpu_bytes=cpu,
    )


# ----------------------------------------------------------------------------- public entry points

def fit(target: Any, *, gpu: Iterable[str | int] | str | int | None = None, cpu: str | int | None = None,
        max_memory: Mapping[Any, Any] | None = None, height: int | None = None, width: int | None = None,
        batch_size: int = 1, guidance: bool | None = None, attention: str = "sdpa", dtype: str | None = None,
        allow_fp8: bool = True, exclude: Iterable[str] = (), margin: Margin = DEFAULT_MARGIN,
        device: str | None = None) -> FitPlan:
    """Choose the fastest inference setup for ``target`` that fits the memory budget; load nothing.

    ``target`` is a diffusers pipeline folder, one component folder (``unet/``), an ``nn.Module``
    (a meta skeleton is enough) or a list of :class:`~shardkit.fit_sizes.ComponentProfile`.
    Budgets: ``gpu=["8GB", "16GB"]`` and ``cpu="24GB"``, or accelerate-style ``max_memory``.
    ``dtype`` overrides the checkpoint's float dtype (``"bf16"``); ``attention="eager"`` plans
    for kernels that materialise attention scores. ``exclude`` drops placements by name or
    prefix (``"group"``, ``"sequential"``, ``"fp8"``). ``device`` is where :func:`apply_plan` runs
    the model (default ``cuda``); ``device="cpu"`` plans without CUDA streams and exercises the
    same hooks on the CPU (tests, machines without a GPU).

    >>> plan = fit("sdxl-sharded/", gpu="8GB", cpu="24GB", height=1024, width=1024)  # doctest: +SKIP
    >>> plan.setup()["offload"], plan.chosen.peak_by_device()                      # doctest: +SKIP
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
    if isinstance(target, (str, os.PathLike)):
        workload = resolve_workload(os.fspath(target), workload)
        profiles = profile_folder(os.fspath(target), workload, dtype=dtype)
    elif isinstance(target, (list, tuple)) and all(isinstance(p, ComponentProfile) for p in target):
        profiles = list(target)
    elif hasattr(target, "named_parameters"):
        workload = Workload(height or 1024, width or 1024, batch_size, guidance, attention)
        profiles = [profile_module(target, workload)]
    else:
        raise InvalidInputError(f"fit needs a folder, an nn.Module or component profiles, got {type(target).__name__}")
    streams = device is None or str(device).startswith("cuda")
    return plan_fit(profiles, budget, workload=workload, margin=margin, allow_fp8=allow_fp8, streams=streams,
                    exclude=exclude, device=device)


def apply_plan(pipe: Any, plan: FitPlan, *, device: str | None = None) -> Any:
    """Install ``plan``'s setup on a loaded pipeline (or model) and set ``pipe.shardkit_plan``.

    Args:
        pipe: the loaded pipeline or model.
        plan: a plan from :func:`fit` / :func:`plan_fit`.
        device: the compute device (default: the plan's, else ``cuda`` when available, else ``cpu``).

    Returns:
        ``pipe``. Multi-GPU placements are chosen at load time (:func:`shardkit.load_pipeline`
        passes them as ``device_map``); here they only check that the pipeline was placed.

    >>> apply_plan(pipe, fit("sdxl/", gpu="8GB"))   # doctest: +SKIP
    """
    import torch

    from ..runtime.apply import RuntimeSetup, apply_runtime

    setup = plan.setup()
    device = device or plan.device or ("cuda" if torch.cuda.is_available() else "cpu")
    apply_runtime(pipe, RuntimeSetup(switches=setup["switches"], layerwise_casting=setup["layerwise_casting"] or None,
                                     offload=setup["offload"] or None, offload_options=setup["offload_options"] or {},
                                     device=device))
    if not setup["offload"] and setup["placement"] in ("gpu", "cpu"):
        pipe.to(device if setup["placement"] == "gpu" else "cpu")
    object.__setattr__(pipe, "shardkit_plan", plan)
    return pipe
