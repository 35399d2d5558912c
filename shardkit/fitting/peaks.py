"""The one peak-memory model: every inference strategy, its speed class and its peak formula.

:data:`STRATEGIES` is the table both :func:`shardkit.estimate_memory` (``shardkit plan
--strategies``) and :func:`shardkit.fit` price; a strategy is a row, never a branch on its name.
Pure: every formula works on :class:`View` numbers (one component's
:class:`~shardkit.fitting.weights.ComponentSizes` plus its activation bytes for one switch set).

What a strategy keeps on the GPU at its peak (``stored``: a component's weights, fp8-stored
where cast; ``live``: its activations plus, with fp8, the running layer upcast to the compute
dtype):

==========================  =====  ======================================================
strategy                    speed  peak on the GPU
==========================  =====  ======================================================
gpu (all on one GPU)        1.0x   Σ stored + largest live
balanced across GPUs        1.0x   per GPU: its whole components + their largest live
staged (denoiser split)     1.05x  per GPU: its share of denoiser blocks + other components
model_offload               1.25x  largest (stored + live)
group_block_stream          4.0x   rest + 2 blocks run one after the other (the next is prefetched) + live
group_leaf_stream           4.2x   2 largest leaves + nonleaf tensors + live
sequential                  17.5x  largest leaf + nonleaf tensors + live
group_block_4/2/1           18x–20x  rest + the largest window of n blocks + live
group_leaf                  21x    largest leaf + nonleaf tensors + live
==========================  =====  ======================================================

Speeds are time per step relative to all on one GPU, measured on an NVIDIA H200 (PCIe gen 5) with
the SDXL UNet (bf16, 1024x1024) and the SD 1.5 UNet (fp16, 512x512), rounded (docs/benchmarks.md,
"GPU"): where the two models agreed (sequential ahead of every non-stream group offload, leaf level
last) that order; where they did not (4, 2 or 1 blocks per group), fewer per group slower. Staged,
balanced and model offload were not measured (model offload moves whole components once per image). A GPU with less compute per PCIe byte
than an H200 pays less for offloading; the order is what ``fit`` uses.

Offloading strategies run one component at a time and hold every offloaded weight in CPU RAM.
fp8 layerwise casting multiplies the time by the strategy's ``fp8_slowdown``: 1.8x where the weights
stay on the GPU (every layer is upcast at every step, measured); 1.0 where they are offloaded (it
measured 0.56-0.95x there, fewer bytes crossing the bus, but it changes the outputs, so ``fit`` never
picks it for speed, only to fit). With leaf units the running layer may be the cast one (fp8 copy +
upcast copy) or the largest uncast one, whichever is larger.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeAlias

# Where a component goes: a GPU index or "cpu", or the GPUs one denoiser is split over.
DeviceSpread: TypeAlias = "int | str | list[int]"

from .activations import NO_SWITCH, switch_key
from .profile import ComponentProfile
from .weights import ComponentSizes

FP8_RESIDENT_SLOWDOWN = 1.8  # fp8 casting where the weights stay on the GPU: measured 1.78-1.84x on an H200
SWITCH_SLOWDOWN = {"vae_slicing": 1.0, "vae_tiling": 1.03, "attention_slicing": 1.10}


@dataclass(frozen=True)
class View:
    """A component as one setup sees it: its sizes, whether fp8 storage applies, its activations."""

    name: str
    role: str
    sizes: ComponentSizes
    fp8: bool
    activation: int

    @property
    def stored(self) -> int:
        return self.sizes.total.pick(self.fp8)

    @property
    def upcast(self) -> int:
        return self.sizes.upcast_bytes if self.fp8 else 0

    @property
    def live(self) -> int:
        """What running the component adds to the GPU besides its stored weights."""
        return self.activation + self.upcast


@dataclass(frozen=True)
class Peaks:
    """Peak bytes per GPU (in the order of the setup's devices) and in CPU RAM.

    ``activation_bytes``: the activations inside the (first) GPU's peak, so a report can split it.
    """

    gpu: tuple[int, ...]
    cpu: int
    device_map: Mapping[str, DeviceSpread] | None = None
    activation_bytes: int = 0


PeakFormula = Callable[[list[View], tuple[int, ...]], Peaks]


@dataclass(frozen=True)
class Strategy:
    """One row of the table: where weights live, its speed class, its peak and how to install it.

    ``resident``: where whole components go when nothing offloads them (``"device"``: the compute
    device, ``"cpu"``), None when the offload hooks or a device map place them.
    """

    name: str
    label: str
    slowdown: float
    peaks: PeakFormula
    min_gpus: int = 1
    offload: str | None = None
    offload_options: Mapping[str, object] = field(default_factory=dict)
    resident: str | None = None
    fp8_slowdown: float = 1.0  # what fp8 layerwise casting multiplies the time by (never below 1: see above)

    def slowdown_with(self, fp8: bool, switches: Iterable[str] = ()) -> float:
        """Expected time per image relative to all on one GPU, with fp8 casting and switches."""
        factor = self.slowdown * (self.fp8_slowdown if fp8 else 1.0)
        for s in switches:
            factor *= SWITCH_SLOWDOWN.get(s, 1.0)
        return factor


def view_of(p: ComponentProfile, *, fp8: bool, switches: frozenset[str] = frozenset()) -> View:
    """What component ``p`` weighs under fp8 casting and ``switches`` (those it supports)."""
    key = switch_key(switches & p.switches())
    act = p.activation_bytes.get(key, p.activation_bytes.get(NO_SWITCH, 0))
    return View(p.name, p.role, p.weights, fp8, act)


# ----------------------------------------------------------------------------- weights of the running unit

Unit = Callable[[View], int]


def _whole(v: View) -> int:
    return v.stored + v.upcast


def _blocks(n: int, stream: bool) -> Unit:
    def unit(v: View) -> int:
        lists = [[sum(b.pick(v.fp8) for b in blocks[i:i + n]) for i in range(0, len(blocks), n)]
                 for blocks in v.sizes.block_lists if blocks]
        if not lists:
            return _whole(v)
        window = _prefetch_window(lists) if stream else max(max(groups) for groups in lists)
        return v.sizes.rest.pick(v.fp8) + window + v.upcast
    return unit


def _prefetch_window(lists: list[list[int]]) -> int:
    """The most a stream holds: the running group and the next one it prefetches.

    The next group is the next in execution order, which crosses from one block list into another:
    an SDXL UNet holds ``down_blocks.2`` and ``up_blocks.0`` together (measured on an H200, 2026-11-26).
    Which list runs after which is not in the sizes, so every list's last group is paired with every
    other list's first.

    >>> _prefetch_window([[1, 5], [7, 1]]), _prefetch_window([[3]])
    (12, 3)
    """
    pairs = [a + b for groups in lists for a, b in zip(groups, groups[1:], strict=False)]
    pairs += [x[-1] + y[0] for i, x in enumerate(lists) for j, y in enumerate(lists) if i != j]
    return max(pairs or [max(groups) for groups in lists])


def _leaves(stream: bool) -> Unit:
    def unit(v: View) -> int:
        s = v.sizes
        leaves = sorted((leaf.pick(v.fp8) for leaf in s.leaves), reverse=True) or [s.total.pick(v.fp8)]
        resident = sum(leaves[:2] if stream else leaves[:1])
        if v.fp8 and s.upcast_bytes:
            # Only the running layer is upcast; it may be smaller than the largest (uncast) layer.
            resident = max(resident, s.upcast_bytes + s.upcast_fp8_bytes + (leaves[0] if stream else 0))
        return resident + s.nonleaf.pick(v.fp8)
    return unit


# ----------------------------------------------------------------------------- peak formulas

def _all_on_one(views: list[View], usable: tuple[int, ...]) -> tuple[int, int]:
    """Σ stored + the largest live: every component resident, one running at a time."""
    busiest = max(views, key=lambda v: v.live)
    return sum(v.stored for v in views) + busiest.live, busiest.activation


def _whole_gpu(views: list[View], usable: tuple[int, ...]) -> Peaks:
    peak, act = _all_on_one(views, usable)
    return Peaks((peak,), 0, activation_bytes=act)


def _cpu_only(views: list[View], usable: tuple[int, ...]) -> Peaks:
    return Peaks((), _all_on_one(views, usable)[0])


def _offloaded(unit: Unit) -> PeakFormula:
    """One component runs at a time; ``unit`` is the weight bytes it keeps on the GPU while running."""
    def peaks(views: list[View], usable: tuple[int, ...]) -> Peaks:
        busiest = max(views, key=lambda v: unit(v) + v.activation)
        return Peaks((unit(busiest) + busiest.activation,), sum(v.stored for v in views),
                     activation_bytes=busiest.activation)
    return peaks


def _place_whole(views: Iterable[View], usable: tuple[int, ...], weights: list[int], lives: list[int],
                 device_map: dict[str, DeviceSpread]) -> None:
    """Whole components on the GPU with the most room left, largest first (diffusers' "balanced")."""
    for v in sorted(views, key=lambda v: v.stored + v.live, reverse=True):
        i = max(range(len(usable)), key=lambda j: usable[j] - weights[j] - lives[j])
        weights[i] += v.stored
        lives[i] = max(lives[i], v.live)
        device_map[v.name] = i


def _balanced(views: list[View], usable: tuple[int, ...]) -> Peaks:
    weights, lives = [0] * len(usable), [0] * len(usable)
    device_map: dict[str, DeviceSpread] = {}
    _place_whole(views, usable, weights, lives, device_map)
    return Peaks(tuple(w + a for w, a in zip(weights, lives, strict=True)), 0, device_map)


def _staged(views: list[View], usable: tuple[int, ...]) -> Peaks:
    """Denoiser blocks filled over the GPUs in order; other components whole where room is left."""
    den = max((v for v in views if v.role == "denoiser"), key=lambda v: v.stored, default=None)
    if den is None or not den.sizes.block_lists:
        return _balanced(views, usable)
    weights, lives = [0] * len(usable), [0] * len(usable)
    i = 0
    used: set[int] = set()
    units = (den.sizes.rest, *(b for blocks in den.sizes.block_lists for b in blocks))
    for size in (u.pick(den.fp8) for u in units):
        while i < len(usable) - 1 and weights[i] and weights[i] + size + den.live > usable[i]:
            i += 1
        weights[i] += size
        lives[i] = den.live
        used.add(i)
    device_map: dict[str, DeviceSpread] = {den.name: sorted(used)}
    _place_whole((v for v in views if v is not den), usable, weights, lives, device_map)
    return Peaks(tuple(w + a for w, a in zip(weights, lives, strict=True)), 0, device_map)


def _group(offload_type: str, n: int | None, stream: bool) -> dict[str, object]:
    options: dict[str, object] = {"offload_type": offload_type}
    if n is not None:
        options["num_blocks_per_group"] = n
    if stream:
        options["use_stream"] = True
    return options


def _group_strategy(name: str, label: str, slowdown: float, unit: Unit, options: dict[str, object]) -> Strategy:
    return Strategy(name, label, slowdown, _offloaded(unit), offload="group", offload_options=options)


STRATEGIES: tuple[Strategy, ...] = (
    Strategy("gpu", "all on one GPU", 1.0, _whole_gpu, resident="device", fp8_slowdown=FP8_RESIDENT_SLOWDOWN),
    Strategy("balanced", "components balanced across GPUs", 1.0, _balanced, min_gpus=2,
             fp8_slowdown=FP8_RESIDENT_SLOWDOWN),
    Strategy("staged", "staged: denoiser split across GPUs", 1.05, _staged, min_gpus=2,
             fp8_slowdown=FP8_RESIDENT_SLOWDOWN),
    Strategy("model_offload", "model offload", 1.25, _offloaded(_whole), offload="model",
             fp8_slowdown=FP8_RESIDENT_SLOWDOWN),
    _group_strategy("group_block_stream", "group offload, block, stream", 4.0, _blocks(1, True),
                    _group("block_level", 1, True)),
    _group_strategy("group_leaf_stream", "group offload, leaf, stream", 4.2, _leaves(True),
                    _group("leaf_level", None, True)),
    Strategy("sequential", "sequential offload", 17.5, _offloaded(_leaves(False)), offload="sequential"),
    _group_strategy("group_block_4", "group offload, block, 4 per group", 18.0, _blocks(4, False),
                    _group("block_level", 4, False)),
    _group_strategy("group_block_2", "group offload, block, 2 per group", 19.0, _blocks(2, False),
                    _group("block_level", 2, False)),
    _group_strategy("group_block_1", "group offload, block, 1 per group", 20.0, _blocks(1, False),
                    _group("block_level", 1, False)),
    _group_strategy("group_leaf", "group offload, leaf", 21.0, _leaves(False), _group("leaf_level", None, False)),
)
CPU_STRATEGY = Strategy("cpu", "all on the CPU (no GPU budget)", 1.0, _cpu_only, min_gpus=0, resident="cpu")
