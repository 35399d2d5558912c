"""Key matching: the skeleton's tensor names and shapes against a checkpoint's headers.

``prepare_skeleton`` builds the meta skeleton, matches it, and gives each meta tensor its final
dtype, so that placement and loading both start from the same skeleton.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import KeyMismatchError, Option, ShardkitWarning
from .lazy import LazyCheckpoint
from .scaled import ScaledLoad, attach_scales
from .skeleton import ModelSpec, build_skeleton, cast_floating, keeps_fp32

if TYPE_CHECKING:
    import torch

_SHOWN = 5


@dataclass
class KeyMatch:
    """How model tensor names map to checkpoint names.

    ``loads`` holds one name per storage (tied parameters are re-tied after loading);
    ``source_of`` covers every model name that has data, tied and aliased names included.
    """

    loads: dict[str, str] = field(default_factory=dict)
    source_of: dict[str, str] = field(default_factory=dict)
    tied: list[list[str]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: dict[str, str] = field(default_factory=dict)  # name → "checkpoint [..], model [..]"
    ignored: list[str] = field(default_factory=list)  # left alone as the model class asks (see ignored_by_class)

    def problems(self) -> str:
        parts = []
        shapes = [f"{name} ({detail})" for name, detail in self.mismatched.items()]
        for label, names in (("missing from the checkpoint", self.missing), ("unexpected", self.unexpected),
                             ("with a different shape", shapes)):
            if names:
                more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
                parts.append(f"{len(names)} key(s) {label}: {', '.join(names[:_SHOWN])}{more}")
        return "; ".join(parts)


def match_keys(skeleton: torch.nn.Module, checkpoint: LazyCheckpoint) -> KeyMatch:
    """Compare the skeleton's state-dict names and shapes with the checkpoint's headers."""
    from accelerate.utils import find_tied_parameters

    state = skeleton.state_dict(keep_vars=True)
    match = KeyMatch(tied=find_tied_parameters(skeleton))
    group_of = {name: group for group in match.tied for name in group}
    aliases = checkpoint.aliases

    def source(name: str) -> str | None:
        if name in checkpoint:
            return name
        return aliases.get(name)

    for name, tensor in state.items():
        src = source(name) or next((s for s in map(source, group_of.get(name, ())) if s), None)
        if src is None:
            if tensor.is_meta:  # buffers built with real values keep them
                match.missing.append(name)
            continue
        match.source_of[name] = src
        if checkpoint.shape_of(src) != tuple(tensor.shape):
            match.mismatched[name] = f"checkpoint {list(checkpoint.shape_of(src))}, model {list(tensor.shape)}"
            continue
        group = group_of.get(name)
        if group is None or not any(member in match.loads for member in group):
            match.loads[name] = src
    used = set(match.source_of.values())
    match.unexpected = [k for k in checkpoint if k not in used and k not in state]
    _drop_ignored(match, skeleton, state)
    return match


def _drop_ignored(match: KeyMatch, skeleton: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Leave out what the model class itself says to ignore, as transformers and diffusers do:
    checkpoint tensors that are non-persistent buffers of the model (the legacy
    ``embeddings.position_ids`` of BERT-family checkpoints), and names matching the class's
    ``_keys_to_ignore_on_load_unexpected`` / ``_keys_to_ignore_on_load_missing`` patterns (``re.search``)
    and transformers' two built-in ones (legacy ``position_ids`` and ``rotary_emb.inv_freq`` buffers).
    Non-persistent buffers keep the values the model built."""
    all_buffers = [name for name, _ in skeleton.named_buffers()]
    buffers = set(all_buffers) - set(state)
    unexpected_patterns = _patterns(skeleton, "_keys_to_ignore_on_load_unexpected")
    # transformers' own two exceptions for buffers that moved or stopped being saved (modeling_utils.py)
    for suffix, pattern in (("rotary_emb.inv_freq", r"rotary_emb\.inv_freq"), ("position_ids", r"(^|\.)position_ids$")):
        if any(name.endswith(suffix) for name in all_buffers):
            unexpected_patterns.append(re.compile(pattern))
    missing_patterns = _patterns(skeleton, "_keys_to_ignore_on_load_missing")
    unexpected = [k for k in match.unexpected if k not in buffers and not _matches(unexpected_patterns, k)]
    missing = [k for k in match.missing if not _matches(missing_patterns, k)]
    match.ignored = sorted(set(match.unexpected) - set(unexpected)) + sorted(set(match.missing) - set(missing))
    match.unexpected, match.missing = unexpected, missing


def _patterns(skeleton: torch.nn.Module, attribute: str) -> list[re.Pattern[str]]:
    found = getattr(skeleton, attribute, None) or ()  # transformers gathers its submodules' into the instance
    if isinstance(found, str):
        found = (found,)
    patterns = []
    for pattern in found:
        try:
            patterns.append(re.compile(pattern))
        except (re.error, TypeError):  # a class attribute we cannot read as a pattern: ignore nothing by it
            continue
    return patterns


def _matches(patterns: list[re.Pattern[str]], name: str) -> bool:
    return any(p.search(name) for p in patterns)


def check_match(match: KeyMatch, *, strict: bool, model: str, checkpoint: str) -> None:
    """Strict: one error naming every problem. Otherwise a warning saying exactly what was done with
    each kind of problem: unexpected tensors are not loaded, missing and mis-shaped ones are zeros."""
    problems = match.problems()
    if not problems:
        return
    if strict:
        raise KeyMismatchError(
            f"{checkpoint} does not match {model}: {problems}; check that the model class and config (",
                               Option("model"), ", ",
            Option("config"), ") are the ones this checkpoint was saved from, or load it anyway with ",
            Option("strict", False)
        )
    done = [what for what, names in (("unexpected tensors are not loaded", match.unexpected),
                                     ("missing tensors are zeros", match.missing),
                                     ("mis-shaped tensors are zeros", match.mismatched)) if names]
    warnings.warn(ShardkitWarning(f"{checkpoint} vs {model} (", Option("strict", False),
                                  f"): {problems}; {', '.join(done)}"),
                  stacklevel=3)


def final_dtypes(skeleton: torch.nn.Module, checkpoint: LazyCheckpoint | None, match: KeyMatch | None,
                 dtype: torch.dtype | None) -> Callable[[str], torch.dtype | None]:
    """The dtype each tensor ends up in: ``dtype`` if given (fp32 for keep-in-fp32 modules), else the checkpoint's."""
    import torch

    def dtype_for(name: str) -> torch.dtype | None:
        if dtype is not None:
            return torch.float32 if keeps_fp32(skeleton, name) else dtype
        src = match.source_of.get(name) if match is not None else None
        if checkpoint is None or src is None:
            return None
        stored = checkpoint.dtype_of(src)
        return stored if stored.is_floating_point else None

    return dtype_for


def prepare_skeleton(model: ModelSpec, checkpoint: LazyCheckpoint | None, *, config: Any, dtype: torch.dtype | None,
                     strict: bool) -> tuple[torch.nn.Module, KeyMatch | None, str | None]:
    """Build the skeleton, check it against ``checkpoint`` and give its meta tensors their final dtypes."""
    skeleton = build_skeleton(model, config=config)
    match, scaled = None, ScaledLoad()
    if checkpoint is not None:
        scaled = attach_scales(skeleton, checkpoint)  # fp8 weights with scales stay fp8, dequantized at compute
        match = match_keys(skeleton, checkpoint)
        match.unexpected = [k for k in match.unexpected if k not in scaled.extra]
        check_match(match, strict=strict, model=type(skeleton).__name__, checkpoint=checkpoint.description)
    cast_floating(skeleton, scaled.dtype_for(final_dtypes(skeleton, checkpoint, match, dtype)))
    return skeleton, match, checkpoint.description if checkpoint is not None else None
