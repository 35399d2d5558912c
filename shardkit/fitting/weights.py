"""Weights per offload unit: reduce a component's tensors to :class:`ComponentSizes`.

This is the one place that decides how many bytes each offload unit weighs, for both the memory
report (:func:`shardkit.estimate_memory`) and the planner (:func:`shardkit.fit`). The tensors come
from safetensors headers (:func:`header_tensors`) or from a module, a meta skeleton being enough
(:func:`module_tensors`); either way only names, shapes and dtypes are read, never weights.

Units, matching how the diffusers/accelerate hooks move weights:

* a **block** is one element of a top-level ``ModuleList``/``Sequential``, found by name
  (``<child>.<index>.…``: ``down_blocks.0``, ``transformer_blocks.7``); block-level group
  offloading moves ``n`` consecutive blocks of one list at a time;
* **rest**: every tensor outside the block lists, which block-level group offloading keeps loaded
  for the whole forward;
* a **leaf** is the set of tensors a module owns directly when it has no submodule with tensors
  (a ``Linear``/``Conv``): the unit of leaf-level and sequential offloading; tensors of modules
  that do have such submodules are **nonleaf**;
* every unit is priced twice (:class:`Footprint`): as loaded, and with fp8 layerwise casting,
  which stores the float tensors of the cast layers in one byte per element.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..units import DTYPE_BITS, FLOAT_DTYPES

if TYPE_CHECKING:
    import torch

FP8_ITEMSIZE = 1

# Layers diffusers' layerwise casting leaves in the compute dtype by default (its
# DEFAULT_SKIP_MODULES_PATTERN plus the models' "norm" patterns); used only without a skeleton.
_SKIP_CAST = re.compile(r"pos_embed|patch_embed|norm|^proj_in$|^proj_out$")


@dataclass(frozen=True)
class Footprint:
    """Bytes of one unit (layer, block, component) stored plainly and with fp8 layerwise storage."""

    plain_bytes: int
    fp8_bytes: int

    def pick(self, fp8: bool) -> int:
        return self.fp8_bytes if fp8 else self.plain_bytes

    def __add__(self, other: Footprint) -> Footprint:
        return Footprint(self.plain_bytes + other.plain_bytes, self.fp8_bytes + other.fp8_bytes)


ZERO = Footprint(0, 0)


@dataclass(frozen=True)
class ComponentSizes:
    """One component's weights per offload unit: all the peak model knows; build by hand for tests."""

    name: str
    total: Footprint
    rest: Footprint = ZERO                                   # not inside any block list
    block_lists: tuple[tuple[Footprint, ...], ...] = ()      # each ModuleList's blocks, in order
    leaves: tuple[Footprint, ...] = ()                       # direct tensors of each leaf module
    nonleaf: Footprint = ZERO                                # direct tensors of non-leaf modules
    upcast_bytes: int = 0                                    # largest cast layer in compute dtype
    upcast_fp8_bytes: int = 0                                # ... and the same layer in fp8

    @property
    def fp8_saving_bytes(self) -> int:
        """Bytes fp8 layerwise casting saves on this component (0: nothing is cast)."""
        return self.total.plain_bytes - self.total.fp8_bytes


@dataclass(frozen=True)
class TensorSize:
    """One tensor as stored; ``follows_dtype`` when loading with a dtype converts it (16+ bit floats)."""

    name: str
    numel: int
    stored_bytes: int
    ndim: int
    follows_dtype: bool

    def loaded_bytes(self, dtype_bytes: int | None) -> int:
        return self.numel * dtype_bytes if dtype_bytes and self.follows_dtype else self.stored_bytes


# ----------------------------------------------------------------------------- tensor lists

def header_tensors(folder: str) -> tuple[list[TensorSize], str | None]:
    """Every tensor of a component folder's safetensors headers, and its most common float dtype."""
    from ..layouts.registry import find_quant_layout, quant_config
    from ..sources.safetensors import open_safetensors_folder

    with open_safetensors_folder(folder) as source:
        entries = source.entries()
        layout = find_quant_layout(entries, config=quant_config(folder), metadata=source.metadata(), where=folder)
    scales = layout.extra if layout is not None else frozenset()  # loaded as stored, beside their fp8/fp4 weights
    counts: dict[str, int] = {}
    out = []
    for e in entries:
        # Only 16/32/64-bit floats follow the load dtype; ints, fp8 and fp8 scales stay as stored.
        follows = e.dtype in FLOAT_DTYPES and DTYPE_BITS[e.dtype] >= 16 and e.name not in scales
        out.append(TensorSize(e.name, math.prod(e.shape), e.nbytes, len(e.shape), follows))
        if follows:
            counts[e.dtype] = counts.get(e.dtype, 0) + e.nbytes
    return out, max(counts, key=lambda k: counts[k]) if counts else None


def module_tensors(module: torch.nn.Module, stored_bytes: Mapping[str, int] | None = None) -> list[TensorSize]:
    """Parameters and buffers of a module (meta tensors welcome), tied tensors counted once.

    ``stored_bytes`` (tensor name → bytes, e.g. from checkpoint headers) overrides the size the
    module's own dtype gives.
    """
    stored = stored_bytes or {}
    seen = set()
    out = []
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        nbytes = stored.get(name, t.numel() * t.element_size())
        follows = t.is_floating_point() and nbytes >= 2 * t.numel()
        out.append(TensorSize(name, t.numel(), nbytes, t.dim(), follows))
    return out


def common_float_bytes(tensors: Iterable[TensorSize]) -> int | None:
    """Bytes per element of most of the float tensors (the component's compute dtype)."""
    sizes = [t.stored_bytes // t.numel for t in tensors if t.follows_dtype and t.numel]
    return max(set(sizes), key=sizes.count) if sizes else None


def cast_layers_of(skeleton: torch.nn.Module) -> set[str]:
    """Names of the layers fp8 layerwise casting would store in 8 bits (the same walk as diffusers')."""
    from ..runtime.casting import casting_targets

    return {name for name, _ in casting_targets(skeleton)[0]}


def guess_cast_layers(tensors: Iterable[TensorSize]) -> set[str]:
    """Without a skeleton: layers owning a float matrix/kernel outside norm/embedding layers."""
    layers = set()
    for t in tensors:
        layer, _, leaf = t.name.rpartition(".")
        if t.follows_dtype and leaf == "weight" and t.ndim >= 2 and not _SKIP_CAST.search(layer):
            layers.add(layer)
    return layers


# ----------------------------------------------------------------------------- measuring

def measure(tensors: Iterable[TensorSize], *, name: str = "model", dtype_bytes: int | None = None,
            cast_layers: Collection[str] = (), compute_bytes: int = 2) -> ComponentSizes:
    """Reduce tensors to :class:`ComponentSizes`.

    Args:
        tensors: the component's tensors (:func:`header_tensors`, :func:`module_tensors`).
        name: the component's name.
        dtype_bytes: bytes per element of the load dtype for floats that follow it (None: as stored).
        cast_layers: layers fp8 layerwise casting stores in 8 bits (empty: not cast).
        compute_bytes: bytes per element of the compute dtype the running cast layer is upcast to.

    Returns:
        The sizes per offload unit, plain and with fp8 storage.

    >>> t = [TensorSize("blocks.0.w.weight", 4, 16, 2, True), TensorSize("norm.weight", 2, 8, 1, True)]
    >>> s = measure(t, dtype_bytes=2, cast_layers={"blocks.0.w"})
    >>> s.total, s.rest, s.block_lists
    (Footprint(plain_bytes=12, fp8_bytes=8), Footprint(plain_bytes=4, fp8_bytes=4), ((Footprint(plain_bytes=8, fp8_bytes=4),),))
    """
    cast = set(cast_layers)
    direct: dict[str, Footprint] = {}
    cast_numel: dict[str, int] = {}
    for t in tensors:
        layer = t.name.rpartition(".")[0]
        plain = t.loaded_bytes(dtype_bytes)
        in_cast = layer in cast and t.follows_dtype
        direct[layer] = direct.get(layer, ZERO) + Footprint(plain, t.numel * FP8_ITEMSIZE if in_cast else plain)
        if layer in cast:
            cast_numel[layer] = cast_numel.get(layer, 0) + t.numel
    upcast_numel = max(cast_numel.values(), default=0)
    return _assemble(name, direct, upcast_numel * compute_bytes, upcast_numel * FP8_ITEMSIZE)


def _assemble(name: str, direct: Mapping[str, Footprint], upcast_bytes: int, upcast_fp8_bytes: int) -> ComponentSizes:
    """Group each layer's direct tensors into blocks, rest, leaves and nonleaf."""
    blocks: dict[tuple[str, int], Footprint] = {}
    parents = {""} if len(direct) > 1 or "" not in direct else set()
    for layer, fp in direct.items():
        parts = layer.split(".")
        parents.update(".".join(parts[:i]) for i in range(1, len(parts)))
        if len(parts) >= 2 and parts[1].isdigit():
            key = (parts[0], int(parts[1]))
            blocks[key] = blocks.get(key, ZERO) + fp
    keys = sorted(blocks)
    lists = tuple(tuple(blocks[k] for k in keys if k[0] == child) for child in dict.fromkeys(k[0] for k in keys))
    total = sum(direct.values(), ZERO)
    grouped = sum(blocks.values(), ZERO)
    rest = Footprint(total.plain_bytes - grouped.plain_bytes, total.fp8_bytes - grouped.fp8_bytes)
    leaves = tuple(fp for layer, fp in direct.items() if layer not in parents and fp.plain_bytes)
    nonleaf = sum((fp for layer, fp in direct.items() if layer in parents), ZERO)
    return ComponentSizes(name, total, rest, lists, leaves, nonleaf, upcast_bytes, upcast_fp8_bytes)


def coarse_sizes(name: str, weight_bytes: int, *, block_bytes: tuple[int, ...] = (),
                 block_lists: tuple[int, ...] = (), unmatched_bytes: int | None = None,
                 leaf_bytes: int | None = None, castable_bytes: int = 0, dtype_bytes: int = 2) -> ComponentSizes:
    """Sizes from a few totals, for hand-written profiles (tests, docs) where no tensor list exists.

    ``block_lists`` cuts ``block_bytes`` into lists (empty: one list); ``unmatched_bytes``
    defaults to what the blocks leave; the largest leaf (default: everything) stands for the two
    largest; fp8 storage shrinks every unit by the same ratio, ``castable_bytes`` going from
    ``dtype_bytes`` to one byte per element, and upcasts one largest leaf.
    """
    saving = castable_bytes - castable_bytes // dtype_bytes if dtype_bytes > 1 else 0
    ratio = (weight_bytes - saving) / weight_bytes if weight_bytes else 1.0

    def fp(plain: int) -> Footprint:
        return Footprint(plain, math.ceil(plain * ratio))

    runs, start = [], 0
    for length in block_lists or (len(block_bytes),):
        runs.append(tuple(fp(b) for b in block_bytes[start:start + length]))
        start += length
    unmatched = weight_bytes - sum(block_bytes) if unmatched_bytes is None else unmatched_bytes
    leaf = weight_bytes if leaf_bytes is None else leaf_bytes
    upcast = (leaf, math.ceil(leaf * ratio)) if saving > 0 else (0, 0)
    return ComponentSizes(name, Footprint(weight_bytes, weight_bytes - saving), fp(unmatched),
                          tuple(r for r in runs if r), (fp(leaf), fp(leaf)), ZERO, *upcast)
