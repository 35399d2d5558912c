"""Reducing a module to :class:`ComponentSizes`: plain numbers the strategy model prices.

:func:`measure_component` walks a module (a meta skeleton is enough) once, sizing every tensor as
it will be loaded and as fp8 layerwise casting would store it, and groups the bytes the way the
offload hooks move them: block lists, leaf layers, everything else. See :mod:`shardkit.estimate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from torch import nn

FP8_ITEMSIZE = 1


@dataclass(frozen=True)
class Footprint:
    """Bytes of one unit (layer, block, component) stored plainly and with fp8 layerwise storage."""

    plain_bytes: int
    fp8_bytes: int

    def pick(self, fp8: bool) -> int:
        return self.fp8_bytes if fp8 else self.plain_bytes

    def __add__(self, other: "Footprint") -> "Footprint":
        return Footprint(self.plain_bytes + other.plain_bytes, self.fp8_bytes + other.fp8_bytes)


ZERO = Footprint(0, 0)


@dataclass(frozen=True)
class ComponentSizes:
    """Everything :func:`strategy_peaks` needs to know about one model; build by hand for tests."""

    name: str
    total: Footprint
    rest: Footprint = ZERO                                   # not inside any block list
    block_lists: tuple[tuple[Footprint, ...], ...] = ()      # each ModuleList's blocks, in order
    leaves: tuple[Footprint, ...] = ()                       # direct tensors of each leaf module
    nonleaf: Footprint = ZERO                                # direct tensors of non-leaf modules
    upcast_bytes: int = 0                                    # largest cast layer in compute dtype
    upcast_fp8_bytes: int = 0                                # ... and the same layer in fp8


ItemSize = Callable[[str, Any], int]


def measure_component(module: "nn.Module", *, name: str = "model", itemsize: ItemSize | None = None,
                      cast: bool = True, compute_itemsize: int = 2) -> ComponentSizes:
    """Reduce ``module`` (a meta skeleton is enough) to :class:`ComponentSizes`.

    ``itemsize(tensor_name, tensor)`` gives bytes per element as loaded (default: the tensor's
    own dtype); ``cast=False`` prices fp8 storage as no change (components that are not cast).
    """
    from ..runtime.casting import casting_targets

    size_of = itemsize or (lambda _n, t: t.element_size())
    cast_ids = {id(m) for _, m in casting_targets(module)[0]} if cast else set()
    seen: set[int] = set()
    direct: dict[str, Footprint] = {}
    upcast = upcast_fp8 = 0
    for mod_name, mod in module.named_modules():
        fp = ZERO
        tensors = [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]
        for t_name, tensor in tensors:
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            full = f"{mod_name}.{t_name}" if mod_name else t_name
            plain = tensor.numel() * size_of(full, tensor)
            fp8 = tensor.numel() * FP8_ITEMSIZE if id(mod) in cast_ids and tensor.is_floating_point() else plain
            fp = fp + Footprint(plain, fp8)
        numel = sum(t.numel() for _, t in tensors)
        if id(mod) in cast_ids and numel * compute_itemsize > upcast:
            upcast, upcast_fp8 = numel * compute_itemsize, numel * FP8_ITEMSIZE
        direct[mod_name] = fp
    return _assemble(module, name, direct, (upcast, upcast_fp8))


def _assemble(module: "nn.Module", name: str, direct: dict[str, Footprint], upcast: tuple[int, int]) -> ComponentSizes:
    from torch import nn

    def subtree(prefix: str) -> Footprint:
        total = ZERO
        for key, fp in direct.items():
            if key == prefix or key.startswith(prefix + "."):
                total = total + fp
        return total

    block_lists, grouped = [], ZERO
    for child_name, child in module.named_children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)) and len(child):
            blocks = tuple(subtree(f"{child_name}.{i}") for i in range(len(child)))
            block_lists.append(blocks)
            grouped = grouped + sum(blocks, ZERO)
    total = sum(direct.values(), ZERO)
    children = {n for n, m in module.named_modules() if next(iter(m.children()), None) is None}
    leaves = tuple(fp for key, fp in direct.items() if key in children and fp.plain_bytes)
    nonleaf = sum((fp for key, fp in direct.items() if key not in children), ZERO)
    rest = Footprint(total.plain_bytes - grouped.plain_bytes, total.fp8_bytes - grouped.fp8_bytes)
    return ComponentSizes(name, total, rest, tuple(block_lists), leaves, nonleaf, *upcast)


def widest_features(module: "nn.Module") -> int:
    """The widest output (``out_features``/``out_channels``) of any Linear or Conv layer."""
    from torch import nn

    widest = 1
    for mod in module.modules():
        if isinstance(mod, nn.Linear):
            widest = max(widest, mod.out_features)
        elif isinstance(mod, nn.modules.conv._ConvNd):
            widest = max(widest, mod.out_channels)
    return widest
