"""Ranking candidate setups for the fit planner: budgets, the safety margin, and which setup fits.

A candidate is a strategy of :data:`~shardkit.fitting.peaks.STRATEGIES`, with or without fp8 layerwise
casting, plus the switches it needs. Pure: every function here works on
:class:`~shardkit.fitting.profile.ComponentProfile` numbers priced by :mod:`shardkit.fitting.peaks`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..devices import Budgets, gpu_and_cpu_bytes, merge_budgets
from ..errors import InvalidInputError
from ..units import format_size, parse_size
from .peaks import CPU_STRATEGY, STRATEGIES, SWITCH_SLOWDOWN, Peaks, Strategy, view_of
from .profile import ComponentProfile


@dataclass(frozen=True)
class Margin:
    """Memory kept free on every device: a fraction of the budget, plus a fixed reserve per GPU."""

    fraction: float = 0.10
    gpu_reserve_bytes: int = 512 * 2**20

    def usable(self, budget_bytes: int, *, gpu: bool) -> int:
        return int(budget_bytes * (1 - self.fraction)) - (self.gpu_reserve_bytes if gpu else 0)

    def budget_for(self, peak_bytes: int, *, gpu: bool) -> int:
        """Smallest budget whose usable part holds ``peak_bytes`` (exactly: ``usable`` agrees to the byte)."""
        budget = max(0, math.ceil((peak_bytes + (self.gpu_reserve_bytes if gpu else 0)) / (1 - self.fraction)))
        # The float division can land a byte either side of the bound that ``usable`` truncates to.
        while self.usable(budget, gpu=gpu) < peak_bytes:
            budget += 1
        while budget > 0 and self.usable(budget - 1, gpu=gpu) >= peak_bytes:
            budget -= 1
        return budget


DEFAULT_MARGIN = Margin()


@dataclass(frozen=True)
class Budget:
    """Memory per GPU (in order) and for the CPU (None: not limited)."""

    gpu_bytes: tuple[int, ...] = ()
    cpu_bytes: int | None = None

    @classmethod
    def parse(cls, gpu: Iterable[str | int] | str | int | None = None, cpu: str | int | None = None,
              max_memory: Budgets | None = None) -> Budget:
        """From ``gpu=["8GB", "16GB"], cpu="24GB"`` or accelerate-style ``max_memory={0: "8GB", "cpu": ...}``.

        Both spellings may be mixed (``gpu=["8GB"], max_memory={"cpu": "24GB"}``); a device that
        both give with different sizes is refused.
        """
        gpus = [gpu] if isinstance(gpu, (str, int)) else list(gpu or [])
        gpu_bytes = [parse_size(g, name="GPU budget") for g in gpus]
        cpu_bytes = None if cpu is None else parse_size(cpu, name="CPU budget")
        merged = merge_budgets(max_memory or None, gpu_bytes=gpu_bytes, cpu_bytes=cpu_bytes) or {}
        mapped_gpus, mapped_cpu = gpu_and_cpu_bytes(merged)
        return cls(mapped_gpus, mapped_cpu)


# ----------------------------------------------------------------------------- candidates

@dataclass(frozen=True)
class Candidate:
    """One setup, its estimated peaks and whether it fits (``reason`` says why not)."""

    strategy: Strategy
    fp8: bool
    switches: tuple[str, ...]
    peaks: Peaks
    devices: tuple[int, ...]
    fits: bool
    reason: str | None = None
    plain_reason: str | None = None  # why the same strategy without its switches does not fit

    @property
    def slowdown(self) -> float:
        return self.strategy.slowdown_with(self.fp8, self.switches)

    @property
    def name(self) -> str:
        return "+".join([self.strategy.name, *(["fp8"] if self.fp8 else []), *self.switches])

    @property
    def label(self) -> str:
        return " + ".join([self.strategy.label, *(["fp8 layerwise casting"] if self.fp8 else []),
                           *(s.replace("_", " ") for s in self.switches)])

    def peak_by_device(self) -> dict[str, int]:
        out = {f"cuda:{d}": int(p) for d, p in zip(self.devices, self.peaks.gpu, strict=True)}
        out["cpu"] = int(self.peaks.cpu)
        return out

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "label": self.label, "speed": round(self.slowdown, 3),
                "speed_class": speed_class(self.slowdown), "fits": self.fits, "reason": self.reason,
                "peak_bytes": self.peak_by_device(), "fp8": self.fp8, "switches": list(self.switches),
                "device_map": dict(self.peaks.device_map) if self.peaks.device_map else None}


def speed_class(slowdown: float) -> str:
    for limit, name in ((1.0, "fastest"), (1.2, "fast"), (1.6, "moderate"), (2.0, "slower"), (4.0, "slow")):
        if slowdown <= limit + 1e-9:
            return name
    return "very slow"


def _violation(peaks: Peaks, devices: tuple[int, ...], budget: Budget, margin: Margin) -> str | None:
    for d, need in zip(devices, peaks.gpu, strict=True):
        usable = margin.usable(budget.gpu_bytes[d], gpu=True)
        if need > usable:
            return (f"cuda:{d} would need {format_size(int(need))}, more than the {format_size(max(usable, 0))} "
                    f"usable of its {format_size(budget.gpu_bytes[d])}")
    if budget.cpu_bytes is not None:
        usable = margin.usable(budget.cpu_bytes, gpu=False)
        if peaks.cpu > usable:
            return (f"CPU RAM would need {format_size(peaks.cpu)}, more than the {format_size(usable)} usable "
                    f"of its {format_size(budget.cpu_bytes)}")
    return None


def _overshoot(peaks: Peaks, devices: tuple[int, ...], budget: Budget, margin: Margin) -> float:
    over = sum(max(0, need - margin.usable(budget.gpu_bytes[d], gpu=True)) for d, need in zip(devices, peaks.gpu, strict=True))
    if budget.cpu_bytes is not None:
        over += max(0, peaks.cpu - margin.usable(budget.cpu_bytes, gpu=False))
    return over


def switch_sets(profiles: Sequence[ComponentProfile]) -> list[frozenset[str]]:
    """Every combination of the switches some component supports, cheapest first."""
    names = sorted(set().union(*(p.switches() for p in profiles)) if profiles else set())
    sets = [frozenset(c) for r in range(len(names) + 1) for c in itertools.combinations(names, r)]
    return sorted(sets, key=lambda s: (math.prod(SWITCH_SLOWDOWN.get(x, 1.0) for x in s), len(s), sorted(s)))


def evaluate(strategy: Strategy, fp8: bool, profiles: Sequence[ComponentProfile], budget: Budget,
             margin: Margin) -> Candidate:
    """The cheapest switch set with which ``strategy`` fits, else the one that comes closest."""
    n = len(budget.gpu_bytes)
    if n < strategy.min_gpus:
        return Candidate(strategy, fp8, (), Peaks((), 0), (), False,
                         f"needs {strategy.min_gpus} or more GPU budgets, got {n}")
    if strategy.min_gpus >= 2:
        devices = tuple(range(n))
    elif strategy.min_gpus == 1:
        devices = (max(range(n), key=lambda i: budget.gpu_bytes[i]),)
    else:
        devices = ()
    usable = tuple(margin.usable(budget.gpu_bytes[d], gpu=True) for d in devices)
    best: Candidate | None = None
    best_over = math.inf
    plain_reason = None
    for switches in switch_sets(profiles):
        views = [view_of(p, fp8=fp8, switches=switches) for p in profiles]
        peaks = strategy.peaks(views, usable)
        used = tuple(sorted(s for s in switches if any(s in p.switches() for p in profiles)))
        reason = _violation(peaks, devices, budget, margin)
        if reason is None:
            return Candidate(strategy, fp8, used, peaks, devices, True, plain_reason=plain_reason)
        plain_reason = plain_reason or reason
        over = _overshoot(peaks, devices, budget, margin)
        if over < best_over:
            best, best_over = Candidate(strategy, fp8, used, peaks, devices, False, reason), over
    assert best is not None
    return best


def rank(profiles: Sequence[ComponentProfile], budget: Budget, *, margin: Margin = DEFAULT_MARGIN,
         allow_fp8: bool = True, streams: bool = True, exclude: Iterable[str] = ()) -> list[Candidate]:
    """Every candidate setup, fastest first (ties: fewer GPUs, lower peak).

    ``streams=False`` drops the CUDA-stream variants (no CUDA device); ``exclude`` drops strategies
    by name or prefix (``"group"``, ``"sequential"``) and ``"fp8"`` drops layerwise casting.
    """
    excluded = tuple(exclude)
    names = [s.name for s in (*STRATEGIES, CPU_STRATEGY)]
    unknown = [e for e in excluded if e != "fp8" and not any(n.startswith(e) for n in names)]
    if unknown or "" in excluded:
        raise InvalidInputError(
            f"exclude {', '.join(repr(e) for e in unknown or [''])} matches no setup: exclude takes strategy names or "
            f"their prefixes ({', '.join(names)}; 'group' drops every group offload) or 'fp8' (no fp8 casting)"
        )
    strategies = [s for s in (STRATEGIES if budget.gpu_bytes else (CPU_STRATEGY,))
                  if not s.name.startswith(excluded) and (streams or not s.offload_options.get("use_stream"))]
    if not strategies:
        raise InvalidInputError(f"every strategy is excluded ({', '.join(excluded)}); nothing to rank")
    with_fp8 = allow_fp8 and "fp8" not in excluded and any(p.fp8_saving_bytes > 0 for p in profiles)
    candidates = [evaluate(s, fp8, profiles, budget, margin) for s in strategies
                  for fp8 in ([False, True] if with_fp8 else [False])]
    # At the same speed: fewer GPUs, then without fp8 casting (it changes the outputs), then the smaller peak.
    return sorted(candidates, key=lambda c: (round(c.slowdown, 6), c.strategy.min_gpus, c.fp8, sum(c.peaks.gpu)))
