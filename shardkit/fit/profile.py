"""What the fit planner knows about each component: weight sizes by offload unit, and activations.

Everything here is computed from checkpoint headers (names, dtypes, shapes), ``config.json`` and
meta skeletons — never from weights. The result, one :class:`ComponentProfile` per component, is
plain numbers, so the planner in :mod:`shardkit.autofit` stays pure and testable with fake sizes.

Weight units, matching how diffusers' hooks move weights:

* ``block_bytes``: each element of a top-level ``ModuleList``/``Sequential`` (``down_blocks.0``,
  ``transformer_blocks.7``), the unit of group offloading at block level;
* ``unmatched_bytes``: every other parameter, which block-level group offloading keeps in one
  group loaded for the whole forward;
* ``leaf_bytes``: the largest leaf module (a ``Linear``/``Conv``), the unit of sequential and
  leaf-level offloading;
* ``castable_bytes``: weights fp8 layerwise casting would store in 8 bits (matrices and kernels
  outside norm/embedding/modulation layers).

Activation estimates (bytes, per switch set) are the formulas of :mod:`shardkit.fit_activations`;
the profiles here carry their results.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from ..errors import InvalidInputError
from ..units import DTYPE_BITS, FLOAT_DTYPES
from .activations import NO_SWITCH, Context, activations_for

# Layers diffusers' layerwise casting leaves in the compute dtype by default
# (DEFAULT_SKIP_MODULES_PATTERN plus the models' own "norm" patterns).
_SKIP_CAST = re.compile(r"pos_embed|patch_embed|norm|^proj_in$|^proj_out$")
_ROLE_BY_NAME = (("unet", "denoiser"), ("transformer", "denoiser"), ("prior", "denoiser"),
                 ("vae", "vae"), ("text_encoder", "text_encoder"))


@dataclass(frozen=True)
class ComponentProfile:
    """Sizes of one component for one workload; plain ints so tests can fake them.

    ``activation_bytes`` maps a switch set (``""``, ``"attention_slicing"``, ``"vae_tiling"``,
    ``"vae_slicing+vae_tiling"``...) to the peak activation bytes with those switches; a switch the
    component does not support simply has no key, so the planner can never choose it.
    """

    name: str
    role: str  # "denoiser" | "text_encoder" | "vae" | "other"
    weight_bytes: int
    block_bytes: tuple[int, ...] = ()
    block_lists: tuple[int, ...] = ()  # lengths of the ModuleLists block_bytes walks through (empty: one list)
    unmatched_bytes: int | None = None
    leaf_bytes: int | None = None
    castable_bytes: int = 0
    dtype_bytes: int = 2
    activation_bytes: Mapping[str, int] = field(default_factory=lambda: {NO_SWITCH: 0})
    notes: tuple[str, ...] = ()

    @property
    def unmatched(self) -> int:
        return self.weight_bytes - sum(self.block_bytes) if self.unmatched_bytes is None else self.unmatched_bytes

    def block_runs(self) -> list[tuple[int, ...]]:
        """``block_bytes`` cut into its ModuleLists: groups never span two lists."""
        runs, start = [], 0
        for length in self.block_lists or (len(self.block_bytes),):
            runs.append(tuple(self.block_bytes[start:start + length]))
            start += length
        return [r for r in runs if r]

    @property
    def leaf(self) -> int:
        return self.weight_bytes if self.leaf_bytes is None else self.leaf_bytes

    def switches(self) -> set[str]:
        """Every switch some key of the activation table uses."""
        return {s for key in self.activation_bytes for s in key.split("+") if s}


@dataclass(frozen=True)
class Workload:
    """What one pipeline call computes: image size, batch, guidance and the attention kernel."""

    height: int | None = None  # None: the denoiser's default (sample_size x VAE scale), else 1024
    width: int | None = None
    batch_size: int = 1
    guidance: bool | None = None  # None: classifier-free guidance unless the denoiser embeds guidance
    attention: str = "sdpa"  # "sdpa" (memory-efficient kernels) or "eager" (materialised scores)


def switch_key(switches: Iterable[str]) -> str:
    return "+".join(sorted(s for s in switches if s))


# ----------------------------------------------------------------------------- weights

@dataclass(frozen=True)
class TensorSize:
    """One tensor as the planner sees it; ``follows_dtype`` when it is cast to the compute dtype."""

    name: str
    numel: int
    stored_bytes: int
    ndim: int
    follows_dtype: bool


def weight_units(tensors: Iterable[TensorSize], *, dtype_bytes: int, castable: bool) -> dict[str, Any]:
    """Group tensors into offload units, with floats counted at ``dtype_bytes`` per element.

    >>> units = weight_units([TensorSize("blocks.0.w.weight", 4, 16, 2, True),
    ...                       TensorSize("blocks.1.w.weight", 4, 16, 2, True),
    ...                       TensorSize("norm.weight", 2, 8, 1, True)], dtype_bytes=2, castable=True)
    >>> units["block_bytes"], units["unmatched_bytes"], units["castable_bytes"]
    ((8, 8), 4, 16)
    """
    blocks: dict[tuple[str, int], int] = {}
    leaves: dict[str, int] = {}
    total = castable_bytes = 0
    for t in tensors:
        size = t.numel * dtype_bytes if t.follows_dtype else t.stored_bytes
        total += size
        parts = t.name.split(".")
        # "<child>.<int>.…": an element of a top-level ModuleList/Sequential, diffusers' block unit.
        if len(parts) > 2 and parts[1].isdigit():
            key = (parts[0], int(parts[1]))
            blocks[key] = blocks.get(key, 0) + size
        leaf = ".".join(parts[:-1])
        leaves[leaf] = leaves.get(leaf, 0) + size
        if castable and t.follows_dtype and parts[-1] == "weight" and t.ndim >= 2 and not _SKIP_CAST.search(leaf):
            castable_bytes += size
    keys = sorted(blocks)
    block_bytes = tuple(blocks[k] for k in keys)
    lists = tuple(sum(1 for k in keys if k[0] == child) for child in dict.fromkeys(k[0] for k in keys))
    return {"weight_bytes": total, "block_bytes": block_bytes, "block_lists": lists,
            "unmatched_bytes": total - sum(block_bytes),
            "leaf_bytes": max(leaves.values(), default=0), "castable_bytes": castable_bytes}


def header_tensors(folder: str) -> tuple[list[TensorSize], str | None]:
    """Every tensor of a component folder's safetensors headers, and its most common float dtype."""
    from ..sources.safetensors import open_safetensors_folder

    with open_safetensors_folder(folder) as source:
        entries = source.entries()
    counts: dict[str, int] = {}
    out = []
    for e in entries:
        numel = 1
        for d in e.shape:
            numel *= d
        # Only 16/32/64-bit floats follow the compute dtype; ints and fp8 stay as stored.
        follows = e.dtype in FLOAT_DTYPES and DTYPE_BITS[e.dtype] >= 16
        out.append(TensorSize(e.name, numel, e.nbytes, len(e.shape), follows))
        if follows:
            counts[e.dtype] = counts.get(e.dtype, 0) + e.nbytes
    return out, max(counts, key=lambda k: counts[k]) if counts else None


def module_tensors(module: Any) -> list[TensorSize]:
    """Parameters and buffers of a module (meta tensors welcome), tied tensors counted once."""
    seen = set()
    out = []
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        follows = t.is_floating_point() and t.element_size() >= 2
        out.append(TensorSize(name, t.numel(), t.numel() * t.element_size(), t.dim(), follows))
    return out


# ----------------------------------------------------------------------------- profiles

def role_of(name: str, class_name: str | None = None) -> str:
    """``denoiser``/``vae``/``text_encoder``/``other`` from the component name, else its class."""
    for prefix, role in _ROLE_BY_NAME:
        if name.startswith(prefix):
            return role
    cls = class_name or ""
    if cls.startswith(("Autoencoder", "VQModel")):
        return "vae"
    if "UNet" in cls or "Transformer" in cls and "Model" in cls and not cls.startswith(("T5", "CLIP")):
        return "denoiser"
    return "text_encoder" if "Encoder" in cls or "TextModel" in cls else "other"



def features_of(skeleton: Any, role: str) -> tuple[set[str], list[str]]:
    """Switches the (meta) module supports, and why the others do not apply."""
    from ..runtime.switches import unsupported_reason

    wanted = {"vae": ("vae_slicing", "vae_tiling"), "denoiser": ("attention_slicing",)}.get(role, ())
    features, notes = set(), []
    for name in wanted:
        reason = None if skeleton is None else unsupported_reason(skeleton, name)
        if skeleton is None:
            reason = "unknown model class"
        if reason is None:
            features.add(name)
        else:
            notes.append(f"{name} not applicable: {reason}")
    return features, notes


def castable_bytes_of(skeleton: Any, dtype_bytes: int) -> int | None:
    """Bytes (at ``dtype_bytes`` per element) of the layers fp8 layerwise casting would store."""
    if skeleton is None:
        return None
    from ..runtime.casting import casting_targets

    cast, _ = casting_targets(skeleton)
    return sum(p.numel() for _, m in cast for p in m.parameters(recurse=False)) * dtype_bytes


def profile_component(name: str, role: str, *, tensors: list[TensorSize], config: Mapping[str, Any],
                      ctx: Context, skeleton: Any = None) -> ComponentProfile:
    """One component's profile from its tensor list, config and (optional) meta skeleton."""
    features, notes = features_of(skeleton, role)
    units = weight_units(tensors, dtype_bytes=ctx.dtype_bytes, castable=role == "denoiser")
    if role == "denoiser":
        exact = castable_bytes_of(skeleton, ctx.dtype_bytes)
        units["castable_bytes"] = units["castable_bytes"] if exact is None else min(exact, units["weight_bytes"])
    return ComponentProfile(
        name=name, role=role, dtype_bytes=ctx.dtype_bytes,
        activation_bytes=activations_for(role, config, ctx, features=features), notes=tuple(notes), **units,
    )


def read_config(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidInputError(f"{path}: not valid JSON ({e})") from e
    return doc if isinstance(doc, dict) else {}


# ----------------------------------------------------------------------------- folders and modules

def resolve_workload(path: str, workload: Workload) -> Workload:
    """Fill a missing height/width with the pipeline's default (as diffusers' ``__call__`` does)."""
    if workload.height and workload.width:
        return workload
    from dataclasses import replace

    from ..formats.layout import find_components, is_pipeline_folder

    size = 1024
    if is_pipeline_folder(path):
        configs = {c.name: read_config(c.path) for c in find_components(path) if c.has_weights}
        den = next((cfg for n, cfg in configs.items() if role_of(n) == "denoiser"), {})
        vae = next((cfg for n, cfg in configs.items() if role_of(n) == "vae"), {})
        scale = 2 ** (len(vae["block_out_channels"]) - 1) if vae.get("block_out_channels") else 8
        sample = den.get("sample_size")
        if isinstance(sample, int) and "down_block_types" in den:
            size = sample * scale
    return replace(workload, height=workload.height or size, width=workload.width or size)


def profile_folder(path: str, workload: Workload, *, dtype: str | None = None) -> list[ComponentProfile]:
    """Profiles of every weight-bearing component of a pipeline folder, or of one component folder.

    Sizes come from the safetensors headers; the denoiser's and VAE's meta skeletons (built from
    ``config.json``, no weights) tell which switches and fp8 layers apply.
    """
    from ..formats.layout import find_components, is_pipeline_folder

    if not os.path.isdir(path):
        from ..errors import SourceNotFoundError

        raise SourceNotFoundError(f"{path}: no such folder (expected a pipeline or component folder)")
    workload = resolve_workload(path, workload)
    if is_pipeline_folder(path):
        specs = [(c.name, c.path, c.library, c.class_name) for c in find_components(path) if c.has_weights]
        if not specs:
            raise InvalidInputError(f"{path}: the pipeline has no component with weights")
    else:
        config = read_config(path)
        library = "diffusers" if "_class_name" in config else "transformers"
        class_name = config.get("_class_name") or (config.get("architectures") or [None])[0]
        specs = [(os.path.basename(os.path.normpath(path)), path, library, class_name)]
    configs = {name: read_config(folder) for name, folder, _, _ in specs}
    roles = {name: role_of(name, cls) for name, _, _, cls in specs}
    vae_cfg = next((configs[n] for n in configs if roles[n] == "vae"), {})
    den_cfg = next((configs[n] for n in configs if roles[n] == "denoiser"), {})
    vae_scale = 2 ** (len(vae_cfg["block_out_channels"]) - 1) if vae_cfg.get("block_out_channels") else 8
    return [_profile_one(name, folder, library, cls, roles[name], configs[name], workload, dtype=dtype,
                         vae_scale=vae_scale, cfg=not den_cfg.get("guidance_embeds", False))
            for name, folder, library, cls in specs]


def _profile_one(name: str, folder: str, library: str, class_name: str | None, role: str, config: dict[str, Any],
                 workload: Workload, *, dtype: str | None, vae_scale: int, cfg: bool) -> ComponentProfile:
    from ..units import normalize_dtype

    tensors, stored = header_tensors(folder)
    code = normalize_dtype(dtype) if dtype else (stored or "F32")
    ctx = Context(workload, DTYPE_BITS[code] // 8, vae_scale=vae_scale, cfg=cfg)
    skeleton = _skeleton(library, class_name, folder) if role in ("denoiser", "vae") else None
    return profile_component(name, role, tensors=tensors, config=config, ctx=ctx, skeleton=skeleton)


def _skeleton(library: str, class_name: str | None, folder: str) -> Any:
    """The component's meta skeleton, or None when its class cannot be built here (sizes still work)."""
    if not class_name or library not in ("diffusers", "transformers"):
        return None
    from ..loading.skeleton import build_skeleton

    try:
        return build_skeleton(f"{library}:{class_name}", config=folder)
    except Exception:  # an exotic class: plan from headers alone, without its switches
        return None


def profile_module(module: Any, workload: Workload, *, name: str = "model", role: str | None = None,
                   config: Mapping[str, Any] | None = None, dtype_bytes: int | None = None) -> ComponentProfile:
    """Profile an ``nn.Module`` (a meta skeleton or a loaded model) as one component."""
    tensors = module_tensors(module)
    cfg = dict(config if config is not None else getattr(module, "config", None) or {})
    role = role or role_of(name, type(module).__name__)
    if dtype_bytes is None:
        sizes = [t.stored_bytes // t.numel for t in tensors if t.follows_dtype and t.numel]
        dtype_bytes = max(set(sizes), key=sizes.count) if sizes else 4
    ctx = Context(workload, dtype_bytes, cfg=not cfg.get("guidance_embeds", False))
    return profile_component(name, role, tensors=tensors, config=cfg, ctx=ctx, skeleton=module)
