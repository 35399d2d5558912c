"""What every layout is to the registry: a mapping from the plain names (Hugging Face, diffusers) to its own, and back.

A layout is a small strategy (:class:`LayoutStrategy`) in its own module: ``forward`` maps a plain table
of tensors (names, dtypes, shapes) to the layout's table and the config that records it, ``inverse``
reads it back, and ``sample`` is the table the layout is proven on. :mod:`shardkit.layouts.registry`
lists them; a test runs every one of them forward and back (:func:`round_trip_problems`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import InvalidInputError
from ..formats.header import TensorEntry

__all__ = ["LayoutStrategy", "Mapped", "round_trip_problems"]


@dataclass(frozen=True)
class Mapped:
    """A table of tensors in one layout and the config beside it (``config.json``, or GGUF metadata).

    Attributes:
        entries: the tensors (names, dtypes, shapes; no data).
        config: what records the layout: a ``quantization_config``, a model config, GGUF metadata.
    """

    entries: tuple[TensorEntry, ...]
    config: Mapping[str, Any] = field(default_factory=dict)

    def table(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """``{name: (dtype code, shape)}``: what a round trip must give back."""
        return {e.name: (e.dtype, tuple(e.shape)) for e in self.entries}


class LayoutStrategy(Protocol):
    """One layout: its mapping from the plain names, its inverse, and the table it is proven on."""

    def sample(self) -> Mapped:
        """A small plain table that the layout maps (every rule of the layout is used at least once)."""
        ...

    def forward(self, plain: Mapped) -> Mapped:
        """The plain table in this layout (names, dtypes, shapes, and the config that records it)."""
        ...

    def inverse(self, stored: Mapped) -> Mapped:
        """A table in this layout back in the plain names, as the layout's readers see it."""
        ...


def round_trip_problems(strategy: LayoutStrategy) -> list[str]:
    """What ``strategy`` gets wrong on its sample: forward must change the table, inverse must give it back.

    Returns:
        One line per difference, or the inverse's refusal (empty when the layout round-trips).
    """
    plain = strategy.sample()
    stored = strategy.forward(plain)
    try:
        back = strategy.inverse(stored)
    except InvalidInputError as e:  # e.g. a fused tensor filled in another order than the layout puts it
        return [str(e)]
    want, got = plain.table(), back.table()
    problems = []
    if stored.table() == want:
        problems.append("forward leaves the sample as it is: the layout maps nothing")
    problems += [f"{name}: lost on the way back" for name in want if name not in got]
    problems += [f"{name}: not in the sample, made on the way back" for name in got if name not in want]
    problems += [f"{name}: {want[name]} became {got[name]}" for name in want if name in got and got[name] != want[name]]
    return problems
