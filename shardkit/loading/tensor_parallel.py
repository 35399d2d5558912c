"""Tensor-parallel slices: each rank reads only the bytes it keeps, straight onto its device.

A rule names a parameter pattern and how it is split across ``world`` ranks, the way Megatron and
vLLM split them: *column parallel* (``dim=0`` of a ``[out, in]`` weight: q/k/v, gate/up, embeddings,
the LM head), *row parallel* (``dim=1``: o_proj, down_proj), *fused* (``sections``: a fused qkv or
gate_up weight, each section split on its own and the rank's parts concatenated), or *replicated*
(norms: every rank reads the whole tensor). A slice along the leading dimension is one range of
the file; along a later one it is one range per leading index, read packed into the ring's slots
and copied out as one block per slot.

>>> spec = SliceSpec("w", dim=1, sections=())
>>> [(o, n) for o, n in slice_ranges((4, 8), 2, spec, rank=1, world=4, offset=100)]
[(104, 4), (120, 4), (136, 4), (152, 4)]
>>> slice_shape((4, 8), SliceSpec("qkv", dim=0, sections=(2, 1, 1)), world=2)
(2, 8)
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..devices import DeviceKey
from ..errors import InvalidInputError
from ..formats.json_types import Config
from .device_reads import FileReaders, RingSource
from .pipeline_copy import (
    CopyJob,
    HostCopyStage,
    Piece,
    RingReport,
    byte_view,
    default_stage,
    plan_pieces,
    plan_strided,
    run_pieces,
)

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SliceRule:
    """Tensors whose name matches ``pattern`` (a regular expression, searched) split on ``dim``
    (None: replicated); ``sections``: the sizes of fused parts along ``dim``, each split on its own."""

    pattern: str
    dim: int | None
    sections: tuple[int, ...] = ()


@dataclass(frozen=True)
class SliceSpec:
    """How one tensor is split: on ``dim`` (None: every rank reads it whole), by ``sections``."""

    name: str
    dim: int | None
    sections: tuple[int, ...]


def rules_for(config: Config) -> list[SliceRule]:
    """Megatron/vLLM splits for Llama-family decoders (Llama, Mistral, Qwen2/3, Gemma, Phi-3's fused
    projections) from their ``config.json``; first matching rule wins, unmatched tensors are replicated.

    >>> [r.sections for r in rules_for({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
    ...                                 "intermediate_size": 96})[:2]]
    [(64, 32, 32), (96, 96)]
    """
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    kv = int(config.get("num_key_value_heads") or heads) * head_dim
    inter = int(config["intermediate_size"])
    return [
        SliceRule(r"\.qkv_proj\.(weight|bias)$", 0, (heads * head_dim, kv, kv)),
        SliceRule(r"\.gate_up_proj\.weight$", 0, (inter, inter)),
        SliceRule(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$", 0),
        SliceRule(r"\.(o_proj|down_proj)\.weight$", 1),
        SliceRule(r"(^|\.)(embed_tokens|lm_head)\.weight$", 0),
    ]


def spec_for(name: str, rules: Sequence[SliceRule]) -> SliceSpec:
    """The first rule matching ``name`` (a 1-D tensor split on a later dimension stays whole)."""
    for rule in rules:
        if re.search(rule.pattern, name):
            return SliceSpec(name, rule.dim, rule.sections)
    return SliceSpec(name, None, ())


def _parts(size: int, spec: SliceSpec, world: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each fused section along the split dimension, before picking a rank."""
    sections = spec.sections or (size,)
    if sum(sections) != size:
        raise InvalidInputError(f"tensor {spec.name!r}: fused sections {list(sections)} add up to {sum(sections)}, "
                                f"but its dimension {spec.dim} is {size}: check the rule against config.json")
    out, start = [], 0
    for section in sections:
        if section % world:
            raise InvalidInputError(f"tensor {spec.name!r}: dimension {spec.dim} part of {section} does not split "
                                    f"evenly over {world} ranks: use a tensor-parallel degree that divides it")
        out.append((start, section))
        start += section
    return out


def slice_shape(shape: tuple[int, ...], spec: SliceSpec, *, world: int) -> tuple[int, ...]:
    """The shape one rank keeps."""
    if spec.dim is None:
        return shape
    _check_dim(shape, spec)
    return shape[:spec.dim] + (shape[spec.dim] // world,) + shape[spec.dim + 1:]


def _check_dim(shape: tuple[int, ...], spec: SliceSpec) -> None:
    if spec.dim is None or not 0 <= spec.dim < len(shape):
        raise InvalidInputError(f"tensor {spec.name!r} of shape {list(shape)} has no dimension {spec.dim} to split")


def slice_ranges(shape: tuple[int, ...], itemsize: int, spec: SliceSpec, *, rank: int, world: int,
                 offset: int) -> Iterator[tuple[int, int]]:
    """The file ranges ``(offset, nbytes)`` rank ``rank`` keeps, in the order of its slice's bytes."""
    if not 0 <= rank < world:
        raise InvalidInputError(f"rank {rank} is outside 0..{world - 1}")
    nbytes = math.prod(shape) * itemsize
    if spec.dim is None:
        if nbytes:
            yield offset, nbytes
        return
    _check_dim(shape, spec)
    size = shape[spec.dim]
    inner = math.prod(shape[spec.dim + 1:]) * itemsize
    parts = _parts(size, spec, world)
    for outer in range(math.prod(shape[:spec.dim])):
        row = offset + outer * size * inner
        for start, length in parts:
            share = length // world
            if share * inner:
                yield row + (start + rank * share) * inner, share * inner


@dataclass(frozen=True)
class RankRead:
    """One tensor of a rank's read: its spec, the shape kept and the file ranges read."""

    spec: SliceSpec
    shape: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]


def rank_read(checkpoint: RingSource, spec: SliceSpec, *, rank: int, world: int) -> RankRead:
    """What rank ``rank`` of ``world`` reads of the tensor ``spec`` names: its shape and file ranges."""
    entry = checkpoint.entry(spec.name)
    ranges = tuple(slice_ranges(entry.shape, checkpoint.dtype_of(spec.name).itemsize, spec, rank=rank, world=world,
                                offset=entry.offset))
    return RankRead(spec, slice_shape(entry.shape, spec, world=world), ranges)


class TensorParallelPlan:
    """Which bytes each of ``world`` ranks reads for every tensor of a checkpoint.

        plan = TensorParallelPlan(ckpt, world=4, rules=rules_for(config))
        plan.read_bytes(rank=1)            # what rank 1 reads, counted from the plan
        state = plan.read(rank=1, device="cuda:1")
    """

    def __init__(self, checkpoint: RingSource, *, world: int, rules: Sequence[SliceRule],
                 names: Sequence[str] | None = None) -> None:
        if world < 1:
            raise InvalidInputError(f"a tensor-parallel degree must be at least 1, got {world}")
        self.checkpoint = checkpoint
        self.world = world
        self.specs = {n: spec_for(n, rules) for n in (names if names is not None else list(checkpoint))}

    def rank_reads(self, rank: int) -> dict[str, RankRead]:
        """Tensor name → what rank ``rank`` reads of it."""
        out = {}
        for name, spec in self.specs.items():
            if len(self.checkpoint.entry(name).shape) <= (spec.dim or 0):  # a bias a row rule names: whole
                spec = SliceSpec(name, None, ())
            out[name] = rank_read(self.checkpoint, spec, rank=rank, world=self.world)
        return out

    def read_bytes(self, rank: int) -> int:
        """Bytes rank ``rank`` reads (replicated tensors whole, split ones its share)."""
        return sum(n for read in self.rank_reads(rank).values() for _, n in read.ranges)

    def read(self, rank: int, *, device: DeviceKey = "cpu", dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Rank ``rank``'s tensors on ``device`` (cast there to ``dtype`` if given), read through the ring."""
        values, _ = read_rank(self.checkpoint, self.rank_reads(rank), device=device, dtype=dtype)
        return values


def read_rank(checkpoint: RingSource, reads: Mapping[str, RankRead], *, device: DeviceKey = "cpu",
              dtype: torch.dtype | None = None) -> tuple[dict[str, torch.Tensor], RingReport]:
    """Every tensor in ``reads`` onto ``device`` through one ring run; the run's byte counts."""
    import torch

    target = torch.device(device)
    values: dict[str, torch.Tensor] = {}
    whole: dict[int, list[CopyJob]] = defaultdict(list)    # file -> one-range reads, planned together
    strided: dict[int, list[tuple[torch.Tensor, tuple[tuple[int, int], ...], str]]] = defaultdict(list)
    with ExitStack() as stack:
        readers = FileReaders(checkpoint, stack)
        for name, read in reads.items():
            dest = values[name] = torch.empty(read.shape, dtype=checkpoint.dtype_of(name), device=target)
            where = f"{checkpoint.entry(name).file}: tensor {name!r}"
            if len(read.ranges) == 1:
                offset, nbytes = read.ranges[0]
                whole[readers.index_of(name)].append(CopyJob(byte_view(dest), 0, offset, nbytes, where))
            elif read.ranges:
                strided[readers.index_of(name)].append((byte_view(dest), read.ranges, where))
        tuning = readers.tuning()
        pieces: list[Piece] = []
        for source in sorted(set(whole) | set(strided)):
            pieces += plan_pieces(whole[source], source=source, slot_bytes=tuning.slot_bytes, gap_bytes=0)
            for flat, ranges, where in strided[source]:
                pieces += plan_strided(flat, ranges, source=source, slot_bytes=tuning.slot_bytes, where=where)
        stage = HostCopyStage() if target.type == "cpu" else default_stage(device)
        report = run_pieces(readers.readers, pieces, stage=stage, tuning=tuning)
    if dtype is not None:
        values = {n: v.to(dtype) if v.is_floating_point() else v for n, v in values.items()}
    return values, report
