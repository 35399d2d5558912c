"""Learn how to undo diffusers' single-file conversion by running it forward on meta probes.

diffusers' ``from_single_file`` maps an original checkpoint (LDM, SGM, SAI, BFL key names) to
its own names with functions such as ``convert_ldm_unet_checkpoint``: renames, views
(``w[:, :, 0, 0]``, ``torch.chunk``), copies (``clone``, ``.T.contiguous()``) and
concatenations (``swap_scale_shift``). :func:`trace_conversion` runs such a function on
tensors of the original shapes, on the meta device (no memory, any size), under a
``TorchFunctionMode`` that records where every element of every output comes from: an original
tensor, an offset and strides into it. :func:`invert` turns that record around: for each
original tensor, which diffusers tensors (and which slabs of them) fill it, and whether it is a
plain rename (the same bytes in the same order) or must be assembled.

The original names and shapes fed in come from :mod:`shardkit.layouts.single_file`;
if those disagree with diffusers in any way, the trace says so (a model parameter that no
original produces, an original that is not used whole), so the mapping cannot drift from the
diffusers release installed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidInputError, first_line

__all__ = ["Original", "Piece", "invert", "trace_conversion"]

Shape = tuple[int, ...]
# Ops that return their input's elements unchanged (a copy or an alias); everything else that
# is not a view or a concatenation makes tensors with no origin (diffusers' torch.eye...).
_COPIES = frozenset({"clone", "detach", "contiguous", "to", "float", "half", "bfloat16", "type", "cpu"})
_CATS = frozenset({"cat", "concat", "concatenate"})


@dataclass(frozen=True)
class _Leaf:
    """Elements of original tensor ``source``: ``source.as_strided(shape, strides, offset)``."""

    source: str
    offset: int
    strides: Shape
    shape: Shape


@dataclass(frozen=True)
class _Origin:
    """A traced tensor: ``leaves`` concatenated along ``dim``."""

    dim: int
    leaves: tuple[_Leaf, ...]


@dataclass(frozen=True)
class Piece:
    """The part of an original tensor that one slab of a diffusers tensor fills.

    The slab is ``diffusers[target].narrow(dim, start, length)``; its elements go to
    ``original.as_strided(shape, strides, offset)`` (``shape`` is the slab's shape).
    """

    target: str
    dim: int
    start: int
    length: int
    offset: int
    strides: Shape
    shape: Shape


@dataclass(frozen=True)
class Original:
    """One tensor of the original layout and the diffusers slabs that make it."""

    name: str
    shape: Shape
    pieces: tuple[Piece, ...]

    @property
    def renamed_from(self) -> str | None:
        """The diffusers name when this tensor is that tensor's bytes in the same order, else None."""
        if len(self.pieces) != 1:
            return None
        p = self.pieces[0]
        whole = p.start == 0 and p.offset == 0 and p.strides == contiguous_strides(p.shape)
        return p.target if whole and math.prod(p.shape) == math.prod(self.shape) else None


def contiguous_strides(shape: Shape) -> Shape:
    """Row-major strides of ``shape``, in elements.

    >>> contiguous_strides((2, 3, 4))
    (12, 4, 1)
    """
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class _Untraced(Exception):
    """A tensor whose elements do not come from the probes in a way this module follows."""


class _Tracker:
    """Origins of the tensors an ongoing conversion makes (kept alive so that ids stay unique)."""

    def __init__(self, probes: Mapping[str, Any]) -> None:
        self.known: dict[int, tuple[Any, _Origin]] = {
            id(t): (t, _Origin(0, (_Leaf(name, 0, tuple(t.stride()), tuple(t.shape)),))) for name, t in probes.items()
        }

    def origin(self, t: Any) -> _Origin:
        if id(t) in self.known:
            return self.known[id(t)][1]
        base = getattr(t, "_base", None)
        if base is None or id(base) not in self.known:
            raise _Untraced()
        leaves = self.known[id(base)][1].leaves
        if len(leaves) != 1 or leaves[0].strides != contiguous_strides(leaves[0].shape):
            raise _Untraced()  # a view of something assembled: not made by the conversions followed here
        leaf = leaves[0]
        offset = leaf.offset + t.storage_offset() - base.storage_offset()
        return _Origin(0, (_Leaf(leaf.source, offset, tuple(t.stride()), tuple(t.shape)),))

    def record(self, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any], out: Any) -> None:
        try:
            if name in _COPIES and args and out is not args[0]:
                self.known[id(out)] = (out, self.origin(args[0]))
            elif name in _CATS:
                tensors = args[0]
                dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
                self.known[id(out)] = (out, _concat([self.origin(t) for t in tensors], dim % out.dim()))
        except _Untraced:
            pass  # its result stays untraced; a model parameter built from it is reported below


def _concat(origins: list[_Origin], dim: int) -> _Origin:
    leaves: list[_Leaf] = []
    for origin in origins:
        if len(origin.leaves) > 1 and origin.dim != dim:
            raise _Untraced()
        leaves.extend(origin.leaves)
    return _Origin(dim, tuple(leaves))


def _mode(tracker: _Tracker) -> Any:
    from torch.overrides import TorchFunctionMode

    class Recording(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                               kwargs: Mapping[str, Any] | None = None) -> Any:
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = getattr(func, "__name__", "")
            tracker.record(name, args, kwargs, out)
            return out

    return Recording()


def trace_conversion(convert: Callable[[dict[str, Any]], Mapping[str, Any]], shapes: Mapping[str, Shape], *,
                     where: str) -> dict[str, Original]:
    """Run ``convert`` on meta probes of ``shapes`` and describe each original tensor by its diffusers slabs.

    Args:
        convert: diffusers' mapping, ``{original name: tensor} → {diffusers name: tensor}``.
        shapes: every original tensor's shape.
        where: what is converted, for errors.

    Returns:
        Original name → :class:`Original` (see :func:`invert`), in the order of ``shapes``.

    >>> import torch
    >>> swap = lambda ck: {"norm.weight": torch.cat(list(reversed(ck["adaLN.weight"].chunk(2))))}
    >>> trace_conversion(swap, {"adaLN.weight": (4, 2)}, where="demo")["adaLN.weight"].renamed_from is None
    True
    """
    import torch

    probes = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    tracker = _Tracker(probes)
    try:
        with _mode(tracker):
            converted = dict(convert(dict(probes)))
    except Exception as e:  # diffusers raises KeyError/IndexError/RuntimeError on a layout it does not expect
        first = first_line(e)
        raise InvalidInputError(f"{where}: diffusers' own single-file conversion cannot read the original layout of "
                                f"this model back ({type(e).__name__}: {first}), so it is not exported") from e
    origins: dict[str, _Origin] = {}
    for name, t in converted.items():
        if isinstance(t, torch.Tensor):
            try:
                origins[name] = tracker.origin(t)
            except _Untraced:
                continue
    return invert(origins, shapes)


def invert(origins: Mapping[str, _Origin], shapes: Mapping[str, Shape]) -> dict[str, Original]:
    """Diffusers name → origin, turned into original name → the slabs that fill it."""
    pieces: dict[str, list[Piece]] = {name: [] for name in shapes}
    for target, origin in origins.items():
        start = 0
        for leaf in origin.leaves:
            length = leaf.shape[origin.dim] if leaf.shape else 1
            pieces[leaf.source].append(Piece(target, origin.dim, start, length, leaf.offset, leaf.strides, leaf.shape))
            start += length
    return {name: Original(name, tuple(shapes[name]), tuple(found)) for name, found in pieces.items()}


def check_complete(originals: Mapping[str, Original], expected: Mapping[str, Shape], produced: set[str], *,
                   where: str) -> None:
    """Every model parameter comes from an original, and every original is filled exactly.

    Raises:
        InvalidInputError: the layout and diffusers' conversion disagree (named).
    """
    missing = [name for name in expected if name not in produced]
    if missing:
        raise InvalidInputError(f"{where}: diffusers' single-file conversion does not produce {len(missing)} of the "
                                f"model's tensors from the original layout (e.g. {', '.join(missing[:3])}); this model "
                                "variant cannot be exported")
    for original in originals.values():
        filled = sum(math.prod(p.shape) for p in original.pieces)
        if filled != math.prod(original.shape):
            raise InvalidInputError(f"{where}: {original.name} of the original layout is not filled exactly by diffusers' "
                                    f"conversion ({filled} of {math.prod(original.shape)} elements); this model "
                                    "variant cannot be exported")


def produced_names(originals: Mapping[str, Original]) -> set[str]:
    return {p.target for o in originals.values() for p in o.pieces}
