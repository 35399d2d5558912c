"""Candidate inference setups for the fit planner: placements, their peak formulas, and ranking.

Pure: every function here works on :class:`~shardkit.fit_sizes.ComponentProfile` numbers. The
speed classes, peak formulas and safety margin are documented in :mod:`shardkit.autofit`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..devices import gpu_and_cpu_bytes, parse_max_memory
from ..errors import InvalidInputError
from ..units import format_size, parse_size
from .profile import NO_SWITCH, ComponentProfile, switch_key

FP8_SLOWDOWN = 1.10
SWITCH_SLOWDOWN = {"vae_slicing": 1.0, "vae_tiling": 1.03, "attention_slicing": 1.10}


@dataclass(frozen=True)
class Margin:
    """Memory kept free on every device: a fraction of the budget, plus a fixed reserve per GPU."""

    fraction: float = 0.10
    gpu_reserve_bytes: int = 512 * 2**20

    def usable(self, budget_bytes: int, *, gpu: bool) -> int:
        return int(budget_bytes * (1 - self.fraction)) - (self.gpu_reserve_bytes if gpu else 0)

    def budget_for(self, peak_bytes: int, *, gpu: bool) -> int:
        """Smallest budget whose usable part holds ``peak_bytes``."""
        return math.ceil((peak_bytes + (self.gpu_reserve_bytes if gpu else 0)) / (1 - self.fraction))


DEFAULT_MARGIN = Margin()


@dataclass(frozen=True)
class Budget:
    """Memory per GPU (in order) and for the CPU (None: not limited)."""

    gpu_bytes: tuple[int, ...] = ()
    cpu_bytes: int | None = None

    @classmethod
    def parse(cls, gpu: Iterable[str | int] | str | int | None = None, cpu: str | int | None = None,
              max_memory: Mapping[Any, Any] | None = None) -> "Budget":
        """From ``gpu=["8GB", "16GB"], cpu="24GB"`` or accelerate-style ``max_memory={0: "8GB", "cpu": ...}``."""
        gpus = [gpu] if isinstance(gpu, (str, int)) else list(gpu or [])
        gpu_bytes: tuple[int, ...] = tuple(parse_size(g, name="GPU budget") for g in gpus)
        cpu_bytes = None if cpu is None else parse_size(cpu, name="CPU budget")
        if max_memory:
            mapped_gpus, mapped_cpu = gpu_and_cpu_bytes(parse_max_memory(max_memory) or {})
            gpu_bytes += mapped_gpus
            cpu_bytes = mapped_cpu if mapped_cpu is not None else cpu_bytes
        return cls(gpu_bytes, cpu_bytes)


@dataclass(frozen=True)
class View:
    """A component as one candidate sees it (after fp8 casting and switches)."""

    name: str
    role: str
    weight: int
    blocks: tuple[tuple[int, ...], ...]  # per ModuleList
    unmatched: int
    leaf: int
    act: int


@dataclass(frozen=True)
class Peaks:
    gpu: tuple[int, ...]
    cpu: int
    device_map: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Placement:
    """One way to place the weights: its speed class, GPU needs and how to apply it."""

    name: str
    label: str
    slowdown: float
    peaks: Callable[[list[View], tuple[int, ...]], Peaks]
    min_gpus: int = 1
    offload: str | None = None
    offload_options: Mapping[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------- peak formulas

def _act(views: list[View]) -> int:
    return max((v.act for v in views), default=0)


def _whole_gpu(views: list[View], usable: tuple[int, ...]) -> Peaks:
    return Peaks((sum(v.weight for v in views) + _act(views),), 0)


def _cpu_only(views: list[View], usable: tuple[int, ...]) -> Peaks:
    return Peaks((), sum(v.weight for v in views) + _act(views))


def _offloaded(unit: Callable[[View], int]) -> Callable[[list[View], tuple[int, ...]], Peaks]:
    """One component runs at a time; ``unit`` is the weight bytes it keeps on the GPU while running."""
    def peaks(views: list[View], usable: tuple[int, ...]) -> Peaks:
        return Peaks((max((unit(v) + v.act for v in views), default=0),), sum(v.weight for v in views))
    return peaks


def _group_block(n: int, stream: bool) -> Callable[[View], int]:
    def unit(v: View) -> int:
        if not v.blocks:
            return v.weight
        window = 0
        for run in v.blocks:
            groups = [sum(run[i:i + n]) for i in range(0, len(run), n)]
            # A stream prefetches the next group of the same list while the current one runs.
            pairs = [a + b for a, b in zip(groups, groups[1:])] if stream and len(groups) > 1 else groups
            window = max(window, *pairs)
        return v.unmatched + window
    return unit


def _balanced(views: list[View], usable: tuple[int, ...]) -> Peaks:
    """Whole components on the GPU with the most room left, largest first (diffusers' "balanced")."""
    weights = [0] * len(usable)
    acts = [0] * len(usable)
    device_map: dict[str, int] = {}
    for v in sorted(views, key=lambda v: v.weight + v.act, reverse=True):
        i = max(range(len(usable)), key=lambda j: usable[j] - weights[j] - acts[j])
        weights[i] += v.weight
        acts[i] = max(acts[i], v.act)
        device_map[v.name] = i
    return Peaks(tuple(w + a for w, a in zip(weights, acts)), 0, device_map)


def _staged(views: list[View], usable: tuple[int, ...]) -> Peaks:
    """Denoiser blocks filled over the GPUs in order; other components whole where room is left."""
    den = max((v for v in views if v.role == "denoiser"), key=lambda v: v.weight, default=None)
    if den is None or not den.blocks:
        return _balanced(views, usable)
    weights = [0] * len(usable)
    acts = [0] * len(usable)
    i = 0
    split: dict[str, Any] = {}
    for size in (den.unmatched, *(b for run in den.blocks for b in run)):
        while i < len(usable) - 1 and weights[i] and weights[i] + size + den.act > usable[i]:
            i += 1
        weights[i] += size
        acts[i] = den.act
        split.setdefault(den.name, []).append(i)
    device_map: dict[str, Any] = {den.name: sorted(set(split[den.name]))}
    for v in sorted((v for v in views if v is not den), key=lambda v: v.weight, reverse=True):
        j = max(range(len(usable)), key=lambda g: usable[g] - weights[g] - acts[g])
        weights[j] += v.weight
        acts[j] = max(acts[j], v.act)
        device_map[v.name] = j
    return Peaks(tuple(w + a for w, a in zip(weights, acts)), 0, device_map)


def _group(offload_type: str, n: int | None, stream: bool) -> dict[str, Any]:
    options: dict[str, Any] = {"offload_type": offload_type}
    if n is not None:
        options["num_blocks_per_group"] = n
    if stream:
        options["use_stream"] = True
    return options


PLACEMENTS: tuple[Placement, ...] = (
    Placement("gpu", "all on one GPU", 1.0, _whole_gpu),
    Placement("balanced", "components balanced across GPUs", 1.0, _balanced, min_gpus=2),
    Placement("staged", "staged: denoiser split across GPUs", 1.05, _staged, min_gpus=2),
    Placement("model_offload", "model offload", 1.25, _offloaded(lambda v: v.weight), offload="model"),
    Placement("group_block_stream", "group offload, block, stream", 1.35, _offloaded(_group_block(1, True)),
              offload="group", offload_options=_group("block_level", 1, True)),
    Placement("group_leaf_stream", "group offload, leaf, stream", 1.5,
              _offloaded(lambda v: 2 * v.leaf), offload="group", offload_options=_group("leaf_level", None, True)),
    Placement("group_block_4", "group offload, block, 4 per group", 1.7, _offloaded(_group_block(4, False)),
              offload="group", offload_options=_group("block_level", 4, False)),
    Placement("group_block_2", "group offload, block, 2 per group", 1.8, _offloaded(_group_block(2, False)),
              offload="group", offload_options=_group("block_level", 2, False)),
    Placement("group_block_1", "group offload, block, 1 per group", 1.9, _offloaded(_group_block(1, False)),
              offload="group", offload_options=_group("block_level", 1, False)),
    Placement("group_leaf", "group offload, leaf", 3.0, _offloaded(lambda v: v.leaf),
              offload="group", offload_options=_group("leaf_level", None, False)),
    Placement("sequential", "sequential offload", 8.0, _offloaded(lambda v: v.leaf), offload="sequential"),
)
CPU_PLACEMENT = Placement("cpu", "all on the CPU (no GPU budget)", 1.0, _cpu_only, min_gpus=0)


# ----------------------------------------------------------------------------- candidates

@dataclass(frozen=True)
class Candidate:
    """One setup, its estimated peaks and whether it fits (``reason`` says why not)."""

    placement: Placement
    fp8: bool
    switches: tuple[str, ...]
    peaks: Peaks
    devices: tuple[int, ...]
    fits: bool
    reason: str | None = None
    plain_reason: str | None = None  # why the same placement without its switches does not fit

    @property
    def slowdown(self) -> float:
        factor = self.placement.slowdown * (FP8_SLOWDOWN if self.fp8 else 1.0)
        for s in self.switches:
            factor *= SWITCH_SLOWDOWN.get(s, 1.0)
        return factor

    @property
    def name(self) -> str:
        return "+".join([self.placement.name, *(["fp8"] if self.fp8 else []), *self.switches])

    @property
    def label(self) -> str:
        return " + ".join([self.placement.label, *(["fp8 layerwise casting"] if self.fp8 else []),
                           *(s.replace("_", " ") for s in self.switches)])

    def peak_by_device(self) -> dict[str, int]:
        out = {f"cuda:{d}": int(p) for d, p in zip(self.devices, self.peaks.gpu)}
        out["cpu"] = int(self.peaks.cpu)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "label": self.label, "speed": round(self.slowdown, 3),
                "speed_class": speed_class(self.slowdown), "fits": self.fits, "reason": self.reason,
                "peak_bytes": self.peak_by_device(), "fp8": self.fp8, "switches": list(self.switches),
                "device_map": dict(self.peaks.device_map) if self.peaks.device_map else None}


def speed_class(slowdown: float) -> str:
    for limit, name in ((1.0, "fastest"), (1.2, "fast"), (1.6, "moderate"), (2.0, "slower"), (4.0, "slow")):
        if slowdown <= limit + 1e-9:
            return name
    return "very slow"


def view_of(p: ComponentProfile, *, fp8: bool, switches: frozenset[str]) -> View:
    """What component ``p`` weighs under fp8 casting and ``switches`` (those it supports)."""
    key = switch_key(switches & p.switches())
    act = p.activation_bytes.get(key, p.activation_bytes.get(NO_SWITCH, 0))
    weight, blocks, unmatched, leaf = p.weight_bytes, tuple(p.block_runs()), p.unmatched, p.leaf
    if fp8 and fp8_saving(p) > 0:
        stored = weight - fp8_saving(p)
        ratio = stored / weight
        act += leaf  # the layer being run is upcast to the compute dtype
        blocks = tuple(tuple(math.ceil(b * ratio) for b in run) for run in blocks)
        unmatched, leaf, weight = math.ceil(unmatched * ratio), math.ceil(leaf * ratio), stored
    return View(p.name, p.role, weight, blocks, unmatched, leaf, act)


def fp8_saving(p: ComponentProfile) -> int:
    """Bytes fp8 storage saves on ``p`` (castable layers go from ``dtype_bytes`` to 1 byte each)."""
    if p.dtype_bytes <= 1:
        return 0
    return p.castable_bytes - p.castable_bytes // p.dtype_bytes


def _violation(peaks: Peaks, devices: tuple[int, ...], budget: Budget, margin: Margin) -> str | None:
    for d, need in zip(devices, peaks.gpu):
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
    over = sum(max(0, need - margin.usable(budget.gpu_bytes[d], gpu=True)) for d, need in zip(devices, peaks.gpu))
    if budget.cpu_bytes is not None:
        over += max(0, peaks.cpu - margin.usable(budget.cpu_bytes, gpu=False))
    return over


def switch_sets(profiles: Sequence[ComponentProfile]) -> list[frozenset[str]]:
    """Every combination of the switches some component supports, cheapest first."""
    names = sorted(set().union(*(p.switches() for p in profiles)) if profiles else set())
    sets = [frozenset(c) for r in range(len(names) + 1) for c in itertools.combinations(names, r)]
    return sorted(sets, key=lambda s: (math.prod(SWITCH_SLOWDOWN.get(x, 1.0) for x in s), len(s), sorted(s)))


def evaluate(placement: Placement, fp8: bool, profiles: Sequence[ComponentProfile], budget: Budget,
             margin: Margin) -> Candidate:
    """The cheapest switch set with which ``placement`` fits, else the one that comes closest."""
    n = len(budget.gpu_bytes)
    if n < placement.min_gpus:
        return Candidate(placement, fp8, (), Peaks((), 0), (), False,
                         f"needs {placement.min_gpus} or more GPU budgets, got {n}")
    if placement.min_gpus >= 2:
        devices = tuple(range(n))
    elif placement.min_gpus == 1:
        devices = (max(range(n), key=lambda i: budget.gpu_bytes[i]),)
    else:
        devices = ()
    usable = tuple(margin.usable(budget.gpu_bytes[d], gpu=True) for d in devices)
    best: Candidate | None = None
    best_over = math.inf
    plain_reason = None
    for switches in switch_sets(profiles):
        views = [view_of(p, fp8=fp8, switches=switches) for p in profiles]
        peaks = placement.peaks(views, usable)
        used = tuple(sorted(s for s in switches if any(s in p.switches() for p in profiles)))
        reason = _violation(peaks, devices, budget, margin)
        if reason is None:
            return Candidate(placement, fp8, used, peaks, devices, True, plain_reason=plain_reason)
        plain_reason = plain_reason or reason
        over = _overshoot(peaks, devices, budget, margin)
        if over < best_over:
            best, best_over = Candidate(placement, fp8, used, peaks, devices, False, reason), over
    assert best is not None
    return best


def rank(profiles: Sequence[ComponentProfile], budget: Budget, *, margin: Margin = DEFAULT_MARGIN,
         allow_fp8: bool = True, streams: bool = True, exclude: Iterable[str] = ()) -> list[Candidate]:
    """Every candidate setup, fastest first (ties: fewer GPUs, lower peak).

    ``streams=False`` drops the CUDA-stream variants (no CUDA device); ``exclude`` drops placements
    by name or prefix (``"group"``, ``"sequential"``) and ``"fp8"`` drops layerwise casting.
    """
    excluded = tuple(exclude)
    placements = [p for p in (PLACEMENTS if budget.gpu_bytes else (CPU_PLACEMENT,))
                  if not p.name.startswith(excluded) and (streams or not p.offload_options.get("use_stream"))]
    if not placements:
        raise InvalidInputError(f"every placement is excluded ({', '.join(excluded)}); nothing to rank")
    with_fp8 = allow_fp8 and "fp8" not in excluded and any(fp8_saving(p) > 0 for p in profiles)
    candidates = [evaluate(pl, fp8, profiles, budget, margin) for pl in placements
                  for fp8 in ([False, True] if with_fp8 else [False])]
    return sorted(candidates, key=lambda c: (round(c.slowdown, 6), c.placement.min_gpus, sum(c.peaks.gpu)))
