"""Adapter (LoRA) key maps: which base tensor each adapter tensor changes, and by how much (no tensor data).

PEFT saves a LoRA as ``adapter_config.json`` + ``adapter_model.safetensors`` whose keys are the
model's module paths under ``base_model.model.`` with the adapter name removed:

=========================================  ===========================================================
adapter key                                base tensor changed
=========================================  ===========================================================
``M.lora_A.weight`` + ``M.lora_B.weight``  ``M.weight += scale · (B @ A)`` (Linear; Conv: flattened)
``M.lora_B.bias``                          ``M.bias += scale · bias`` (``lora_bias=True``)
``M.lora_magnitude_vector`` (DoRA)         ``M.weight = m / norm(W + ΔW) · (W + ΔW)``, per output row (Linear)
``M.lora_embedding_A`` / ``_B``            ``M.weight += scale · (B @ A)ᵀ`` (Embedding)
any other ``base_model.model.N``           ``N`` replaced whole, before any pair is added (``modules_to_save``;
                                           ``M.base_layer.weight``: a targeted embedding's own weight)
=========================================  ===========================================================

``scale`` is ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``), with ``r`` and
``lora_alpha`` taken from ``rank_pattern`` / ``alpha_pattern`` where a pattern matches the module as
PEFT matches it (``(.*\\.)?PATTERN$``). ``fan_in_fan_out`` (GPT-2's Conv1D) transposes the product.
:class:`PeftLora` is the registry's strategy for this map (:mod:`shardkit.layouts.registry`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from ..errors import InvalidInputError
from ..formats.header import TensorEntry
from ..formats.json_types import Config
from .table import Mapped

__all__ = ["PEFT_PREFIX", "SUPPORTED", "AdapterKeys", "LoraPair", "PeftLora", "lora_scale", "peft_keys",
           "pattern_value", "target_matches"]

PEFT_PREFIX = "base_model.model."
SUPPORTED = ("PEFT LoRA folders (adapter_config.json with peft_type LORA + adapter_model.safetensors or "
             "adapter_model.bin: Linear, Embedding and Conv targets, rsLoRA, rank_pattern/alpha_pattern, "
             "lora_bias, modules_to_save, DoRA on Linear layers), and diffusers or kohya LoRA .safetensors files for a UNet or "
             "transformer (what diffusers' load_lora_weights reads)")
PairKind = Literal["linear", "embedding"]
_SUFFIXES: dict[str, tuple[PairKind, str]] = {".lora_A.weight": ("linear", "A"), ".lora_B.weight": ("linear", "B"),
             ".lora_embedding_A": ("embedding", "A"), ".lora_embedding_B": ("embedding", "B")}
_BIAS = ".lora_B.bias"
_MAGNITUDE = ".lora_magnitude_vector"  # DoRA: one magnitude per output row
_UNSUPPORTED_KEYS = (".trainable_tokens_delta", ".lora_E", ".hada_w", ".lokr_w", ".ia3_l")


@dataclass(frozen=True)
class LoraPair:
    """One target module's low-rank pair, by adapter key.

    Attributes:
        module: the module path as PEFT named it (``model.layers.0.self_attn.q_proj``).
        kind: ``linear`` (``B @ A``) or ``embedding`` (``(B @ A)ᵀ``).
        a, b: the adapter keys of A and B.
        bias: the adapter key of ``lora_B.bias``, if any.
        magnitude: the adapter key of DoRA's ``lora_magnitude_vector``, if any.
    """

    module: str
    kind: PairKind
    a: str
    b: str
    bias: str | None = None
    magnitude: str | None = None


@dataclass(frozen=True)
class AdapterKeys:
    """Every adapter key sorted into low-rank pairs and whole-tensor replacements (``modules_to_save``)."""

    pairs: tuple[LoraPair, ...]
    replaced: tuple[tuple[str, str], ...] = field(default_factory=tuple)  # (adapter key, name as PEFT's model has it)


def peft_keys(names: Iterable[str], *, where: str) -> AdapterKeys:
    """Sort a PEFT adapter's keys (see the module docstring).

    >>> keys = peft_keys(["base_model.model.m.q.lora_A.weight", "base_model.model.m.q.lora_B.weight",
    ...                   "base_model.model.score.weight"], where="a")
    >>> keys.pairs[0].module, keys.replaced
    ('m.q', (('base_model.model.score.weight', 'score.weight'),))

    Raises:
        InvalidInputError: a key outside ``base_model.model.``, half a pair, or a kind of adapter
            that is not LoRA (DoRA magnitudes, LoHa, LoKr, IA³); one line naming the key.
    """
    halves: dict[tuple[str, PairKind], dict[str, str]] = {}
    biases: dict[str, str] = {}
    magnitudes: dict[str, str] = {}
    replaced: list[tuple[str, str]] = []
    for key in names:
        if not key.startswith(PEFT_PREFIX):
            raise InvalidInputError(f"{where}: key {key!r} does not start with {PEFT_PREFIX!r}, as PEFT saves "
                                    f"adapters; supported: {SUPPORTED}")
        name = key[len(PEFT_PREFIX):]
        if any(marker in name for marker in _UNSUPPORTED_KEYS):
            raise InvalidInputError(f"{where}: key {key!r} belongs to an adapter kind shardkit does not merge (DoRA, "
                                    f"trainable tokens, LoHa, LoKr, IA³); supported: {SUPPORTED}")
        suffix = next((s for s in _SUFFIXES if name.endswith(s)), None)
        if suffix is not None:
            kind, half = _SUFFIXES[suffix]
            halves.setdefault((name[: -len(suffix)], kind), {})[half] = key
        elif name.endswith(_BIAS):
            biases[name[: -len(_BIAS)]] = key
        elif name.endswith(_MAGNITUDE) or name.endswith(_MAGNITUDE + ".weight"):
            magnitudes[name.rpartition(_MAGNITUDE)[0]] = key
        else:  # modules_to_save, or an embedding's base weight PEFT saved beside its pair (loaded before the merge)
            replaced.append((key, name.replace(".base_layer.", ".")))
    pairs = []
    for (module, kind), got in halves.items():
        if set(got) != {"A", "B"}:
            missing = "B" if "A" in got else "A"
            raise InvalidInputError(f"{where}: {next(iter(got.values()))!r} has no lora_{missing} beside it; "
                                    "the adapter file is incomplete: save it again")
        pairs.append(LoraPair(module, kind, got["A"], got["B"], biases.pop(module, None), magnitudes.pop(module, None)))
    if biases or magnitudes:
        raise InvalidInputError(f"{where}: {next(iter({**biases, **magnitudes}.values()))!r} has no lora_A/lora_B "
                                "beside it; the adapter file is incomplete: save it again")
    return AdapterKeys(tuple(pairs), tuple(replaced))


def pattern_value(patterns: Mapping[str, object], module: str) -> object | None:
    """The value of the first pattern matching ``module`` as PEFT matches it (``(.*\\.)?PATTERN$``), or None.

    >>> pattern_value({"q_proj": 4}, "model.layers.0.self_attn.q_proj"), pattern_value({"q_proj": 4}, "x.k_proj")
    (4, None)
    """
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return None


def lora_scale(config: Config, module: str) -> tuple[int, float]:
    """``(rank, scale)`` of ``module``'s pair under a PEFT LoRA config (rank_pattern, alpha_pattern, rsLoRA).

    >>> lora_scale({"r": 8, "lora_alpha": 16}, "q"), lora_scale({"r": 4, "lora_alpha": 8, "use_rslora": True}, "q")
    ((8, 2.0), (4, 4.0))
    """
    rank = pattern_value(config.get("rank_pattern") or {}, module)
    alpha = pattern_value(config.get("alpha_pattern") or {}, module)
    r = int(rank if isinstance(rank, (int, float)) else config.get("r", 8))
    a = alpha if isinstance(alpha, (int, float)) else config.get("lora_alpha", 8)
    if r <= 0:
        raise InvalidInputError(f"rank {r} for {module}: a LoRA rank is positive; fix adapter_config.json")
    return r, (a / math.sqrt(r) if config.get("use_rslora") else a / r)


def target_matches(target: str, module: str) -> bool:
    """Whether a ``target_modules`` entry names ``module`` as PEFT matches it (the name, or its last parts).

    >>> target_matches("q_proj", "model.layers.0.self_attn.q_proj"), target_matches("proj", "a.q_proj")
    (True, False)
    """
    return module == target or module.endswith("." + target)


@dataclass(frozen=True)
class PeftLora:
    """The registry's strategy for PEFT LoRA keys: the targeted base weights ↔ the adapter's tensors.

    ``forward`` gives each 2-D weight a rank-2 pair (``embed`` modules the transposed embedding pair),
    each bias a ``lora_B.bias``, and keeps the modules named in ``config["modules_to_save"]`` whole;
    ``inverse`` reads the base table back from the pairs' shapes.
    """

    rank: int = 2

    def sample(self) -> Mapped:
        return Mapped((TensorEntry("model.layers.0.self_attn.q_proj.weight", "F32", (8, 4), 128),
                       TensorEntry("model.layers.0.self_attn.q_proj.bias", "F32", (8,), 32),
                       TensorEntry("model.embed_tokens.weight", "F32", (16, 4), 256),
                       TensorEntry("score.weight", "F32", (3, 4), 48)), {"modules_to_save": ["score"]})

    def forward(self, plain: Mapped) -> Mapped:
        saved = tuple(plain.config.get("modules_to_save") or ())
        out: list[TensorEntry] = []
        for e in plain.entries:
            module, _, leaf = e.name.rpartition(".")
            if any(target_matches(t, module) for t in saved):
                out.append(TensorEntry(PEFT_PREFIX + e.name, e.dtype, e.shape, e.nbytes))
            elif leaf == "bias":
                out.append(TensorEntry(PEFT_PREFIX + module + _BIAS, e.dtype, e.shape, e.nbytes))
            else:
                out += _pair_entries(PEFT_PREFIX + module, e, self.rank, embedding="embed" in module)
        return Mapped(tuple(out), dict(plain.config))

    def inverse(self, stored: Mapped) -> Mapped:
        by_name = {e.name: e for e in stored.entries}
        keys = peft_keys(by_name, where="adapter")
        out = [TensorEntry(name, by_name[key].dtype, by_name[key].shape, by_name[key].nbytes)
               for key, name in keys.replaced]
        for pair in keys.pairs:
            a, b = by_name[pair.a], by_name[pair.b]
            shape = (a.shape[1], b.shape[0]) if pair.kind == "embedding" else (b.shape[0], *a.shape[1:])
            out.append(TensorEntry(pair.module + ".weight", b.dtype, shape, math.prod(shape) * b.nbytes
                                   // max(1, math.prod(b.shape))))
            if pair.bias is not None:
                out.append(TensorEntry(pair.module + ".bias", by_name[pair.bias].dtype, by_name[pair.bias].shape,
                                       by_name[pair.bias].nbytes))
        return Mapped(tuple(out))


def _pair_entries(module: str, weight: TensorEntry, rank: int, *, embedding: bool) -> Sequence[TensorEntry]:
    item = weight.nbytes // max(1, math.prod(weight.shape))
    rows, cols = weight.shape[0], math.prod(weight.shape[1:])
    if embedding:  # lora_embedding_A: (r, num_embeddings), lora_embedding_B: (embedding_dim, r)
        return (TensorEntry(module + ".lora_embedding_A", weight.dtype, (rank, rows), rank * rows * item),
                TensorEntry(module + ".lora_embedding_B", weight.dtype, (cols, rank), cols * rank * item))
    return (TensorEntry(module + ".lora_A.weight", weight.dtype, (rank, *weight.shape[1:]), rank * cols * item),
            TensorEntry(module + ".lora_B.weight", weight.dtype, (rows, rank), rows * rank * item))
