"""Peak accelerator memory per offload strategy, from a meta skeleton and the checkpoint's dtypes.

Two layers. :func:`measure_component` (:mod:`shardkit.estimate_sizes`) walks a module (a meta
skeleton is enough) once and reduces it to :class:`ComponentSizes` — plain numbers. :func:`strategy_peaks` is a pure function
of those numbers: it knows how each diffusers/accelerate hook moves weights and returns one
:class:`StrategyEstimate` per strategy. The auto-fit planner ranks these same rows.

What each strategy keeps on the accelerator at its peak (``P`` = parameter + buffer bytes):

* ``none``: every component's ``P``.
* ``model``: the largest component's ``P`` (the previous one is offloaded before the next loads).
* ``group block_level n``: the component's ungrouped modules (embeddings, norms, heads: kept for
  the whole forward) plus the largest window of ``n`` consecutive blocks of one ``ModuleList``;
  with ``use_stream`` the next window is prefetched, so two adjacent windows.
* ``group leaf_level`` / ``sequential``: the largest single layer plus the tensors owned by
  non-leaf modules (an upper bound); streams prefetch the next layer (two largest layers).
* fp8 layerwise casting: cast layers count 1 byte per element, plus the largest cast layer
  upcast to the compute dtype during its forward.

Activation allowance (documented heuristic, override with ``activation_bytes=``): eight live
tensors of ``tokens × widest layer output × compute itemsize`` — residual stream, norm output,
q/k/v, attention output and the MLP's widened hidden state — with ``tokens=4096`` (a 1024² image
in a Flux-like latent space, batch 1). The CUDA context (~0.3–0.5 GB) is not included: numbers
compare with ``torch.cuda.max_memory_allocated``.

>>> report = estimate_memory(skeleton, gpu_bytes=16 * 10**9, dtype="bf16")   # doctest: +SKIP
>>> print(report.table())                                                     # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ..errors import InvalidInputError
from ..units import format_size
from .estimate_sizes import (
    FP8_ITEMSIZE,
    ZERO,
    ComponentSizes,
    Footprint,
    ItemSize,
    measure_component,
    widest_features,
)

if TYPE_CHECKING:
    from torch import nn

__all__ = ["DEFAULT_TOKENS", "FP8_ITEMSIZE", "LIVE_ACTIVATIONS", "ZERO", "ComponentSizes", "Footprint", "MemoryEstimate",
           "StrategyEstimate", "StrategySpec", "component_peak", "default_activation_bytes", "estimate_memory",
           "measure_component", "strategy_peaks", "strategy_specs"]

DEFAULT_TOKENS = 4096
LIVE_ACTIVATIONS = 8


@dataclass(frozen=True)
class StrategySpec:
    """A candidate setup: arguments for ``apply_offload`` / ``apply_layerwise_casting``."""

    name: str
    offload: str
    options: Mapping[str, Any]
    fp8: bool
    speed_rank: int            # 0 = fastest; a class, not a measurement

    @property
    def layerwise_casting(self) -> tuple[str, str] | None:
        return ("float8_e4m3fn", "bfloat16") if self.fp8 else None


@dataclass(frozen=True)
class StrategyEstimate:
    spec: StrategySpec
    param_bytes: int
    activation_bytes: int
    fits: bool | None = None

    @property
    def peak_bytes(self) -> int:
        return self.param_bytes + self.activation_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.spec.name, "offload": self.spec.offload, "offload_options": dict(self.spec.options),
            "layerwise_casting": list(self.spec.layerwise_casting or []) or None, "speed_rank": self.spec.speed_rank,
            "param_bytes": self.param_bytes, "activation_bytes": self.activation_bytes,
            "peak_bytes": self.peak_bytes, "fits": self.fits,
        }


def _base_specs() -> list[tuple[str, str, dict[str, Any], int]]:
    block = {"offload_type": "block_level"}
    return [
        ("none", "none", {}, 0),
        ("model", "model", {}, 1),
        ("group-block-4", "group", {**block, "num_blocks_per_group": 4}, 3),
        ("group-block-2", "group", {**block, "num_blocks_per_group": 2}, 4),
        ("group-block-1-stream", "group", {**block, "num_blocks_per_group": 1, "use_stream": True}, 2),
        ("group-block-1", "group", {**block, "num_blocks_per_group": 1}, 5),
        ("group-leaf-stream", "group", {"offload_type": "leaf_level", "use_stream": True}, 6),
        ("group-leaf", "group", {"offload_type": "leaf_level"}, 7),
        ("sequential", "sequential", {}, 8),
    ]


def strategy_specs() -> list[StrategySpec]:
    """Every candidate, each without and with fp8 layerwise casting (casting costs one speed class)."""
    specs = []
    for name, offload, options, rank in _base_specs():
        specs.append(StrategySpec(name, offload, options, False, rank * 2))
        specs.append(StrategySpec(f"{name}+fp8", offload, options, True, rank * 2 + 1))
    return specs


# --- the pure model ------------------------------------------------------------------------------

def _block_peak(sizes: ComponentSizes, n: int, stream: bool, fp8: bool) -> int:
    if not sizes.block_lists:
        return sizes.total.pick(fp8)
    window = 0
    for blocks in sizes.block_lists:
        groups = [sum(b.pick(fp8) for b in blocks[i:i + n]) for i in range(0, len(blocks), n)]
        pairs = [a + b for a, b in zip(groups, groups[1:])] if stream and len(groups) > 1 else groups
        window = max(window, *pairs)
    return sizes.rest.pick(fp8) + window


def _leaf_peak(sizes: ComponentSizes, stream: bool, fp8: bool) -> int:
    leaves = sorted((leaf.pick(fp8) for leaf in sizes.leaves), reverse=True) or [sizes.total.pick(fp8)]
    resident = sum(leaves[:2] if stream else leaves[:1])
    if fp8:
        # Only the running layer is upcast; it may be smaller than the largest (uncast) layer.
        upcast = sizes.upcast_bytes + sizes.upcast_fp8_bytes + (leaves[0] if stream else 0)
        resident = max(resident, upcast)
    return resident + sizes.nonleaf.pick(fp8)


def component_peak(sizes: ComponentSizes, spec: StrategySpec) -> int:
    """Parameter bytes ``sizes`` keeps on the accelerator at its peak under ``spec`` (pure)."""
    fp8, options = spec.fp8, spec.options
    if spec.offload in ("none", "model"):
        return sizes.total.pick(fp8) + (sizes.upcast_bytes if fp8 else 0)
    if spec.offload == "group" and options.get("offload_type") == "block_level":
        peak = _block_peak(sizes, int(options.get("num_blocks_per_group", 1)), bool(options.get("use_stream")), fp8)
        return peak + (sizes.upcast_bytes if fp8 else 0)
    return _leaf_peak(sizes, bool(options.get("use_stream")), fp8)


def strategy_peaks(
    components: Sequence[ComponentSizes], *, activation_bytes: int = 0, gpu_bytes: int | None = None,
    specs: Sequence[StrategySpec] | None = None,
) -> list[StrategyEstimate]:
    """One :class:`StrategyEstimate` per spec for a model (one component) or a pipeline (several).

    Pure: a function of the sizes only. ``none`` keeps every component resident; every offload
    strategy runs one component at a time, so its peak is the largest component's.

    >>> c = ComponentSizes("m", Footprint(100, 40), rest=Footprint(10, 10),
    ...                    block_lists=((Footprint(45, 15), Footprint(45, 15)),))
    >>> [e.param_bytes for e in strategy_peaks([c])][:2]
    [100, 40]
    """
    if not components:
        raise InvalidInputError("memory estimate: no components with parameters")
    rows = []
    for spec in specs if specs is not None else strategy_specs():
        peaks = [component_peak(c, spec) for c in components]
        params = sum(peaks) if spec.offload == "none" else max(peaks)
        fits = None if gpu_bytes is None else params + activation_bytes <= gpu_bytes
        rows.append(StrategyEstimate(spec, params, activation_bytes, fits))
    return rows


def default_activation_bytes(widest_features: int, itemsize: int, *, tokens: int = DEFAULT_TOKENS) -> int:
    """The documented allowance: ``8 × tokens × widest layer output × itemsize``."""
    return LIVE_ACTIVATIONS * tokens * widest_features * itemsize


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

    def to_dict(self) -> dict[str, Any]:
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
    skeleton: Any, *, gpu_bytes: int | str | None = None, dtype: Any = None, checkpoint: Any = None,
    activation_bytes: int | None = None, tokens: int = DEFAULT_TOKENS, compute_dtype: Any = "bfloat16",
    cast_components: Sequence[str] | None = None,
) -> MemoryEstimate:
    """Estimate the peak accelerator memory of every offload strategy, with and without fp8 casting.

    ``skeleton``: an ``nn.Module`` (a meta skeleton from ``init_empty_weights`` is enough), a
    ``{name: module}`` mapping or a diffusers pipeline. Bytes per element come from ``dtype``
    (what ``load_model(dtype=)`` would cast floating tensors to), else from the ``checkpoint``
    headers (a file/folder, or for a mapping a pipeline folder with one subfolder per
    component), else from the skeleton. fp8 applies to ``cast_components`` (default: the
    denoiser, or the single module).

    >>> with accelerate.init_empty_weights():                                   # doctest: +SKIP
    ...     unet = UNet2DConditionModel.from_config(config)
    >>> print(estimate_memory(unet, gpu_bytes="8GB", dtype="fp16").table())     # doctest: +SKIP
    """
    from torch import nn

    from ..runtime.casting import DEFAULT_PIPELINE_COMPONENTS
    from ..units import parse_size

    modules = _component_modules(skeleton)
    per_component = not isinstance(skeleton, nn.Module)
    budget = None if gpu_bytes is None else parse_size(gpu_bytes, name="gpu size")
    load_dtype, compute = _resolve(dtype), _resolve(compute_dtype)
    if not per_component:
        cast_names = set(modules)
    else:
        cast_names = set(cast_components if cast_components is not None else DEFAULT_PIPELINE_COMPONENTS)
    notes, components = [], []
    for name, module in modules.items():
        headers = _checkpoint_itemsizes(checkpoint, name, per_component)
        itemsize = _itemsize_fn(load_dtype, headers)
        components.append(measure_component(module, name=name, itemsize=itemsize, cast=name in cast_names,
                                            compute_itemsize=compute.itemsize))
        notes.append(f"{name}: dtypes from {'dtype=' + str(load_dtype) if load_dtype else 'checkpoint headers' if headers else 'the skeleton'}")
    if activation_bytes is None:
        largest = max(modules, key=lambda n: next(c for c in components if c.name == n).total.plain_bytes)
        activation_bytes = default_activation_bytes(widest_features(modules[largest]), compute.itemsize, tokens=tokens)
        notes.append(f"activations: {LIVE_ACTIVATIONS} x {tokens} tokens x widest layer of {largest} x {compute.itemsize} B "
                     "(heuristic; pass activation_bytes= to override)")
    notes.append("peaks exclude the CUDA context (~0.3-0.5 GB); fp8 rows cast " + ", ".join(sorted(cast_names & set(modules))))
    rows = strategy_peaks(components, activation_bytes=activation_bytes, gpu_bytes=budget)
    return MemoryEstimate(rows, components, budget, notes)


def _component_modules(skeleton: Any) -> dict[str, "nn.Module"]:
    from torch import nn

    if isinstance(skeleton, nn.Module):
        return {"model": skeleton}
    items = getattr(skeleton, "components", skeleton)
    if isinstance(items, Mapping):
        modules = {k: v for k, v in items.items() if isinstance(v, nn.Module)}
        if modules:
            return modules
    raise InvalidInputError(f"memory estimate needs an nn.Module, a {{name: module}} mapping or a pipeline, got {type(skeleton).__name__}")


def _resolve(value: Any) -> Any:
    from ..formats.dtypes import resolve_torch_dtype

    return resolve_torch_dtype(value)


def _checkpoint_itemsizes(checkpoint: Any, name: str, per_component: bool) -> dict[str, float]:
    """Tensor name → bytes per element from the checkpoint headers (no tensor data is read)."""
    import os

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
        return {e.name: e.nbytes / max(1, _numel(e.shape)) for e in source.entries()}


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize_fn(load_dtype: Any, headers: dict[str, float]) -> ItemSize:
    def itemsize(name: str, tensor: Any) -> float:
        if load_dtype is not None and tensor.is_floating_point():
            return load_dtype.itemsize
        if name in headers:
            return headers[name]
        return tensor.element_size()

    return itemsize
