"""No scale left behind: the quantized weights of a checkpoint whose scales or recipe are unusable.

``verify`` (and ``info``) report them; ``convert``, ``split`` and ``push`` refuse such a checkpoint
(see :mod:`shardkit.layouts.registry`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..errors import InvalidInputError
from ..formats.header import TensorEntry

__all__ = ["scale_problems_of"]


def scale_problems_of(path: str, root: str, entries: Sequence[TensorEntry], metadata: Mapping[str, str], *,
                      where: str, read_scales: bool) -> list[str]:
    """One line per quantized weight whose scale or recipe is missing, misshapen or (``read_scales``) unusable
    (non-finite, fused scales that disagree), for the checkpoint at ``path`` (its folder ``root``; ``where`` names
    it in messages)."""
    from ..formats.links import UntrustedFileError
    from ..layouts.registry import dequantizer, find_quant_layout, quant_config

    try:
        config = quant_config(root)
    except UntrustedFileError:  # a config leaving the folder or no regular file: the file scan reports it
        return []
    try:
        found = find_quant_layout(list(entries), config=config, metadata=dict(metadata), where=where,
                                  allow_lossy=True)
        if found is None:  # or an inconsistent fp8 layout: this call says why
            find_quant_layout(list(entries), config=config, metadata=dict(metadata), where=where)
    except InvalidInputError as e:
        return [str(e).removeprefix(f"{where}: ")]
    if found is None:
        return []
    problems = list(found.problems)
    if read_scales and found.weights:  # the values, through the layout's own strategy
        from ..sources import open_source
        from ..sources.dequantized import SourceReader

        with open_source(path) as source:
            reader = SourceReader(source, {e.name: e for e in source.entries()})
            problems += [line for _, line in dequantizer(found, list(entries)).scale_problems(reader)]
    return [f"{found.scheme}: {p}" for p in problems]
