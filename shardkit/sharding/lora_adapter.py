"""Adapters read whole into memory and checked against a base, before anything is written.

An adapter is small (megabytes beside a base of gigabytes), so it is held; the base streams
(:mod:`shardkit.sharding.lora`). :func:`plan_merge` turns the adapters into one list of updates per
base tensor and refuses, in one line naming the first offending key: a target with no weight in the
base, a shape that does not fit it, a rank that disagrees with the config, ``target_modules`` that
match no weight, two adapters touching one weight with different dtypes, and adapter kinds that are
not LoRA (the message names what is supported).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import InvalidInputError, Option, SourceNotFoundError
from ..formats.header import TensorEntry
from ..formats.json_types import Config, JsonObject
from ..formats.links import parse_json, read_inside
from ..layouts.adapters import SUPPORTED, AdapterKeys, LoraPair, lora_scale, peft_keys, target_matches
from ..layouts.fp8 import matrix_shape
from ..sources import open_source
from ..sources.dequantized import read_whole
from ..sources.ranged import beneath, shown
from ..stores.urls import url_scheme
from .lora_original import Placement

if TYPE_CHECKING:
    import torch

__all__ = ["Adapter", "LowRank", "Replace", "Update", "is_peft_folder", "load_adapter", "plan_merge"]

CONFIG_NAME = "adapter_config.json"
WEIGHT_NAMES = ("adapter_model.safetensors", "adapter_model.bin")
DIFFUSERS_NAME = "pytorch_lora_weights.safetensors"  # what diffusers' save_lora_weights writes
_KOHYA = ("lora_unet_", "lora_te_", "lora_te1_", "lora_te2_", "transformer.", "unet.", "text_encoder.")


@dataclass
class Adapter:
    """A PEFT LoRA held in memory: its config, its tensors as stored, and its keys sorted."""

    path: str
    config: Config
    tensors: dict[str, torch.Tensor]
    keys: AdapterKeys

    def to_dict(self) -> JsonObject:
        return {"adapter": self.path, "base_model": self.config.get("base_model_name_or_path"),
                "r": self.config.get("r"), "lora_alpha": self.config.get("lora_alpha"),
                "use_rslora": bool(self.config.get("use_rslora")), "pairs": len(self.keys.pairs),
                "replaced": len(self.keys.replaced)}


@dataclass(frozen=True)
class LowRank:
    """``W += scale · (B @ A)`` (transposed for embeddings and ``fan_in_fan_out``), A and B as stored; with
    DoRA's ``magnitude`` m, ``W = m / norm(W + ΔW) · (W + ΔW)`` per output row."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float
    transpose: bool
    adapter: str
    magnitude: torch.Tensor | None = None
    row0: int = 0  # the first row of the base tensor the product adds to (a part of a fused tensor)

    @property
    def rows(self) -> int:
        """How many rows of the base tensor the product covers."""
        return int(self.a.shape[1] if self.transpose else self.b.shape[0])


@dataclass(frozen=True)
class Replace:
    """The whole tensor replaced (``modules_to_save``), or a bias added to (``lora_B.bias``, ``add=True``)."""

    value: torch.Tensor
    adapter: str
    add: bool = False
    scale: float = 1.0


Update = LowRank | Replace


def load_adapter(path: str | os.PathLike[str], *, base_config: Config | None = None, component: str | None = None,
                 base_names: frozenset[str] = frozenset()) -> Adapter:
    """Read a PEFT LoRA folder (or its weight file beside ``adapter_config.json``), or a diffusers/kohya
    LoRA file (:mod:`shardkit.sharding.lora_diffusers`; ``base_config``: an SDXL UNet's numbering;
    ``component``: which of its components' keys; ``base_names``: the base's tensor names), into memory.
    A :class:`~shardkit.sources.ranged.RangedCheckpoint` (an adapter in a bucket: its files mirrored, headers
    only) has its weights read by range.

    Raises:
        SourceNotFoundError: no such path.
        InvalidInputError: not a LoRA shardkit merges (the message names what is supported).
    """
    given, path = path, os.fspath(path)
    if url_scheme(path) is not None:
        raise InvalidInputError(f"adapter {path}: adapters are read from a local folder or file, or through "
                                "shardkit.convert (which opens s3:// and hf:// adapters); download it first")
    if not os.path.exists(path):
        raise SourceNotFoundError(f"adapter {shown(given)}: no such file or folder")
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    weights = path if os.path.isfile(path) else next(
        (os.path.join(folder, n) for n in WEIGHT_NAMES if os.path.isfile(os.path.join(folder, n))), None)
    if not is_peft_folder(path):
        return _diffusers_file(given, folder, weights, base_config=base_config, component=component,
                               base_names=base_names)
    path = shown(given)
    config = _read_config(folder, where=path)
    if weights is None:
        raise InvalidInputError(f"adapter {path}: no {' or '.join(WEIGHT_NAMES)} in it; supported: {SUPPORTED}")
    with open_source(beneath(given, weights)) as src:
        entries = src.entries()
        _refuse_other_formats(path, config, [e.name for e in entries])
        tensors = {e.name: read_whole(src, e) for e in entries}
    return Adapter(path, config, tensors, peft_keys(tensors, where=f"adapter {path}"))


def is_peft_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a PEFT adapter (a folder, or a file beside ``adapter_config.json``)."""
    path = os.fspath(path)
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    return os.path.isfile(os.path.join(folder, CONFIG_NAME))


def _diffusers_file(given: str | os.PathLike[str], folder: str, weights: str | None, *, base_config: Config | None,
                    component: str | None, base_names: frozenset[str]) -> Adapter:
    """A LoRA file without ``adapter_config.json``: diffusers' or kohya's (one ``.safetensors`` file)."""
    from .lora_diffusers import diffusers_adapter

    path = shown(given)
    if weights is None and os.path.isfile(os.path.join(folder, DIFFUSERS_NAME)):
        weights = os.path.join(folder, DIFFUSERS_NAME)
    if weights is None or not weights.endswith(".safetensors"):
        raise InvalidInputError(f"adapter {path}: neither {CONFIG_NAME} (PEFT) nor a .safetensors LoRA file "
                                f"(diffusers, kohya); supported: {SUPPORTED}")
    with open_source(beneath(given, weights)) as src:
        tensors = {e.name: read_whole(src, e) for e in src.entries()}
        metadata = src.metadata()
    return Adapter(path, *diffusers_adapter(path, tensors, metadata, base_config=base_config, component=component,
                                            base_names=base_names))


def _read_config(folder: str, *, where: str) -> Config:
    doc = parse_json(read_inside(folder, CONFIG_NAME, where=folder), path=os.path.join(folder, CONFIG_NAME))
    if not isinstance(doc, dict):
        raise InvalidInputError(f"adapter {where}: {CONFIG_NAME} is not a JSON object; supported: {SUPPORTED}")
    return doc


def _refuse_other_formats(where: str, config: Config, names: Sequence[str]) -> None:
    kind = str(config.get("peft_type") or "LORA").upper()
    if kind != "LORA":
        raise InvalidInputError(f"adapter {where}: peft_type {kind} is not supported; supported: {SUPPORTED}")
    if config.get("layer_replication"):
        raise InvalidInputError(f"adapter {where}: layer_replication changes the model's layers; not supported")
    if names and all(n.startswith(_KOHYA) for n in names):
        raise InvalidInputError(f"adapter {where}: diffusers/kohya LoRA keys ({names[0]}) are not supported yet; "
                                f"supported: {SUPPORTED}")


@dataclass
class MergePlan:
    """The updates of each base tensor, in adapter order, and what each adapter changes."""

    updates: dict[str, list[Update]] = field(default_factory=dict)
    reports: list[JsonObject] = field(default_factory=list)


def plan_merge(adapters: Sequence[Adapter], base: Sequence[TensorEntry], *, scale: float = 1.0,
               where: str, placements: Mapping[str, tuple[Placement, ...]] | None = None) -> MergePlan:
    """Each base tensor's updates from ``adapters`` (applied in order), after every check.

    ``placements``: for a base in another layout than the adapters' names (an original Flux file), where
    each named tensor's rows lie in the base (:mod:`shardkit.sharding.lora_original`).

    Raises:
        InvalidInputError: see the module docstring; the first problem found, in one line.
    """
    by_name = {e.name: e for e in base}
    placed = placements or {}
    plan = MergePlan()
    for adapter in adapters:
        prefix = _base_prefix(adapter.keys, by_name)
        _check_targets(adapter, [*by_name, *placed], prefix, where=where)
        for key, name in adapter.keys.replaced:  # first: PEFT loads them before it merges the pairs
            _plan_replace(plan, adapter, key, prefix + name, by_name, where=where)
        for pair in adapter.keys.pairs:
            if prefix + pair.module + ".weight" not in by_name and prefix + pair.module + ".weight" in placed:
                _plan_placed_pair(plan, adapter, pair, by_name, placed, scale=scale, where=where)
            else:
                _plan_pair(plan, adapter, pair, by_name, prefix, scale=scale, where=where)
        plan.reports.append({**adapter.to_dict(), "scale": scale})
    _check_dtypes(plan)
    return plan


def _base_prefix(keys: AdapterKeys, base: Mapping[str, TensorEntry]) -> str:
    """What the base's names have before PEFT's module paths: ``""``, or e.g. ``"model."`` when the
    adapter was trained on a bare ``LlamaModel`` and the base is a ``LlamaForCausalLM`` checkpoint."""
    modules = [p.module for p in keys.pairs] or [n.rpartition(".")[0] for _, n in keys.replaced]
    if not modules or any(m + ".weight" in base for m in modules):
        return ""
    for prefix in ("model.", "transformer.", "language_model.model."):
        if any(prefix + m + ".weight" in base for m in modules):
            return prefix
    return ""


def _check_targets(adapter: Adapter, base: Iterable[str], prefix: str, *, where: str) -> None:
    targets = adapter.config.get("target_modules")
    if isinstance(targets, str) or not targets:
        return  # a regex (or none): the keys themselves are checked below
    modules = [n.removeprefix(prefix).removesuffix(".weight") for n in base if n.endswith(".weight")]
    for target in targets:
        if not any(target_matches(str(target), m) for m in modules):
            raise InvalidInputError(f"adapter {adapter.path}: target module {target!r} (the adapter's "
                                    f"target_modules) matches no weight of {where}; is this the adapter's base model?")


def _plan_pair(plan: MergePlan, adapter: Adapter, pair: LoraPair, base: Mapping[str, TensorEntry], prefix: str, *,
               scale: float, where: str) -> None:
    name = prefix + pair.module + ".weight"
    entry = _base_entry(adapter, pair.a, name, base, where=where)
    a, b = adapter.tensors[pair.a], adapter.tensors[pair.b]
    rank, factor = lora_scale(adapter.config, pair.module)
    if a.shape[0] != b.shape[1] or a.shape[0] != rank:
        raise InvalidInputError(f"adapter {adapter.path}: {pair.a} has rank {a.shape[0]} and {pair.b} rank "
                                f"{b.shape[1]}, but {CONFIG_NAME} says r={rank} for {pair.module} (r, rank_pattern); "
                                "the config does not belong to these weights")
    transpose = pair.kind == "embedding" or bool(adapter.config.get("fan_in_fan_out"))
    rows, cols = matrix_shape(entry.shape)
    a_cols, b_rows = matrix_shape(tuple(a.shape))[1], b.shape[0]
    if (b_rows, a_cols) != ((cols, rows) if transpose else (rows, cols)) or len(b.shape) > 2 and b.numel() != b_rows \
            * rank:
        raise InvalidInputError(f"adapter {adapter.path}: {pair.a} {tuple(a.shape)} / {pair.b} {tuple(b.shape)} do "
                                f"not fit {name} {entry.shape} of {where}; is this the adapter's base model?")
    magnitude = _magnitude(adapter, pair, rows, transpose, name)
    plan.updates.setdefault(name, []).append(LowRank(a, b.reshape(b_rows, rank), factor * scale, transpose,
                                                     adapter.path, magnitude))
    if pair.bias is not None:
        bias = _base_entry(adapter, pair.bias, prefix + pair.module + ".bias", base, where=where)
        value = adapter.tensors[pair.bias]
        if tuple(value.shape) != bias.shape:
            raise InvalidInputError(f"adapter {adapter.path}: {pair.bias} {tuple(value.shape)} does not fit "
                                    f"{bias.name} {bias.shape} of {where}")
        plan.updates.setdefault(bias.name, []).append(Replace(value, adapter.path, add=True, scale=factor * scale))


def _plan_placed_pair(plan: MergePlan, adapter: Adapter, pair: LoraPair, base: Mapping[str, TensorEntry],
                      placed: Mapping[str, tuple[Placement, ...]], *, scale: float, where: str) -> None:
    """A pair whose weight is rows of fused base tensors: one update per run of rows, B cut to those rows."""
    a, b = adapter.tensors[pair.a], adapter.tensors[pair.b]
    rank, factor = lora_scale(adapter.config, pair.module)
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank or pair.magnitude is not None:
        raise InvalidInputError(f"adapter {adapter.path}: {pair.a} {tuple(a.shape)} / {pair.b} {tuple(b.shape)} "
                                f"(r={rank}) is not a Linear LoRA pair of rank r; only those merge into a fused tensor")
    rows = 0
    for part in placed[pair.module + ".weight"]:
        entry = _base_entry(adapter, pair.a, part.name, base, where=where)
        rows += part.rows
        if matrix_shape(entry.shape)[1] != a.shape[1] or part.start + part.rows > b.shape[0]:
            raise InvalidInputError(f"adapter {adapter.path}: {pair.a} {tuple(a.shape)} / {pair.b} {tuple(b.shape)} do "
                                    f"not fit {part.name} {entry.shape} of {where}; is this the adapter's base model?")
        plan.updates.setdefault(part.name, []).append(LowRank(
            a, b[part.start: part.start + part.rows], factor * scale, False, adapter.path, row0=part.row0))
    if rows != b.shape[0]:
        raise InvalidInputError(f"adapter {adapter.path}: {pair.b} has {b.shape[0]} rows, but {pair.module} is "
                                f"{rows} rows of {where}; is this the adapter's base model?")
    if pair.bias is not None:
        raise InvalidInputError(f"adapter {adapter.path}: {pair.bias} (lora_bias) on a fused tensor of {where} is "
                                "not supported; merge into the diffusers folder instead")


def _magnitude(adapter: Adapter, pair: LoraPair, rows: int, transpose: bool, name: str) -> torch.Tensor | None:
    """DoRA's magnitude vector of ``pair`` (one per output row), checked; None for a plain LoRA pair."""
    if pair.magnitude is None:
        return None
    if transpose or adapter.tensors[pair.a].dim() != 2:
        raise InvalidInputError(f"adapter {adapter.path}: DoRA on {name} (an embedding, conv or fan_in_fan_out layer) "
                                "is not supported, only on Linear layers; merge it with PEFT's merge_and_unload()")
    value = adapter.tensors[pair.magnitude]
    if value.numel() != rows:
        raise InvalidInputError(f"adapter {adapter.path}: {pair.magnitude} {tuple(value.shape)} does not fit {name} "
                                f"({rows} output rows)")
    return value.reshape(rows)


def _plan_replace(plan: MergePlan, adapter: Adapter, key: str, name: str, base: Mapping[str, TensorEntry], *,
                  where: str) -> None:
    entry = _base_entry(adapter, key, name, base, where=where)
    value = adapter.tensors[key]
    if tuple(value.shape) != entry.shape:
        raise InvalidInputError(f"adapter {adapter.path}: {key} {tuple(value.shape)} does not fit {name} "
                                f"{entry.shape} of {where}; is this the adapter's base model?")
    if name in plan.updates:
        raise InvalidInputError(f"adapter {adapter.path}: {key} replaces {name}, which another adapter also changes; "
                                "merge them one at a time")
    plan.updates[name] = [Replace(value, adapter.path)]


def _base_entry(adapter: Adapter, key: str, name: str, base: Mapping[str, TensorEntry], *, where: str) -> TensorEntry:
    entry = base.get(name)
    if entry is None:
        near = sorted(n for n in base if n.rpartition(".")[2] == name.rpartition(".")[2])[:2]
        hint = f" (its names look like {', '.join(near)})" if near else ""
        raise InvalidInputError(f"adapter {adapter.path}: {key} targets {name}, which {where} does not have{hint}; "
                                "is this the adapter's base model?")
    if entry.dtype not in ("F32", "F16", "BF16", "F64"):
        raise InvalidInputError(f"{where}: {name} is stored as {entry.dtype}; a LoRA merges into floating weights "
                                "(dequantize the base first, e.g. with ", Option("dtype", "bf16"), ")")
    return entry


def _check_dtypes(plan: MergePlan) -> None:
    for name, updates in plan.updates.items():
        low = [u for u in updates if isinstance(u, LowRank)]
        if len(low) > 1 and any(u.magnitude is not None for u in low):
            raise InvalidInputError(f"{name}: a DoRA adapter and another adapter both change it "
                                    f"({', '.join(u.adapter for u in low)}); merge the DoRA adapter alone")
        dtypes = {str(u.b.dtype).removeprefix("torch.") for u in low}
        if len(dtypes) > 1:
            raise InvalidInputError(f"{name}: changed by adapters stored in different dtypes ({', '.join(sorted(dtypes))}: "
                                    f"{', '.join(u.adapter for u in low)}); save them in one dtype")
