"""One :class:`ComponentProfile` per component: its weights per offload unit, activations and switches.

Everything here is computed from checkpoint headers (names, dtypes, shapes), ``config.json`` and
meta skeletons — never from weights. Weights per offload unit are :mod:`shardkit.fitting.weights`,
activations :mod:`shardkit.fitting.activations`; a profile joins them for one component and one
workload, as plain numbers, so the peak model (:mod:`shardkit.fitting.peaks`) stays pure and
testable with fake sizes. Both :func:`shardkit.fit` and :func:`shardkit.estimate_memory` price
the profiles built here.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..errors import InvalidInputError, Option, ShardkitWarning, first_line
from ..formats.json_types import Config, JsonObject
from ..formats.layout import read_config
from ..units import DTYPE_BITS
from .activations import NO_SWITCH, Context, Workload, activations_for
from .weights import (
    ComponentSizes,
    TensorSize,
    cast_layers_of,
    coarse_sizes,
    common_float_bytes,
    guess_cast_layers,
    header_tensors,
    measure,
    module_tensors,
)

if TYPE_CHECKING:
    import torch

_ROLE_BY_NAME = (("unet", "denoiser"), ("transformer", "denoiser"), ("prior", "denoiser"),
                 ("vae", "vae"), ("text_encoder", "text_encoder"))

logger = logging.getLogger("shardkit")


@dataclass(frozen=True)
class ComponentProfile:
    """Sizes of one component for one workload; plain numbers so tests can fake them.

    ``activation_bytes`` maps a switch set (``""``, ``"attention_slicing"``, ``"vae_tiling"``,
    ``"vae_slicing+vae_tiling"``...) to the peak activation bytes with those switches; a switch the
    component does not support simply has no key, so the planner can never choose it.
    ``dtype_bytes`` is the compute dtype's bytes per element.
    """

    name: str
    role: str  # "denoiser" | "text_encoder" | "vae" | "other"
    weights: ComponentSizes
    dtype_bytes: int = 2
    activation_bytes: Mapping[str, int] = field(default_factory=lambda: {NO_SWITCH: 0})
    notes: tuple[str, ...] = ()
    guessed: tuple[str, ...] = ()  # what was assumed for lack of a config.json, in words

    @classmethod
    def from_totals(cls, name: str, role: str, *, weight_bytes: int, dtype_bytes: int = 2,
                    activation_bytes: Mapping[str, int] | None = None, notes: tuple[str, ...] = (),
                    **units: Any) -> ComponentProfile:
        """A hand-written profile: ``units`` are :func:`~shardkit.fitting.weights.coarse_sizes` keywords."""
        sizes = coarse_sizes(name, weight_bytes, dtype_bytes=dtype_bytes, **units)
        return cls(name, role, sizes, dtype_bytes, dict(activation_bytes or {NO_SWITCH: 0}), notes)

    @property
    def weight_bytes(self) -> int:
        return self.weights.total.plain_bytes

    @property
    def fp8_saving_bytes(self) -> int:
        return self.weights.fp8_saving_bytes

    def switches(self) -> set[str]:
        """Every switch some key of the activation table uses."""
        return {s for key in self.activation_bytes for s in key.split("+") if s}


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


def features_of(skeleton: torch.nn.Module | None, role: str) -> tuple[set[str], list[str]]:
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


def profile_component(name: str, role: str, *, tensors: list[TensorSize], config: Config,
                      ctx: Context, skeleton: torch.nn.Module | None = None, cast: bool | None = None,
                      load_bytes: int | None = None) -> ComponentProfile:
    """One component's profile from its tensor list, config and (optional) meta skeleton.

    ``cast`` (default: the denoiser only, as :func:`shardkit.apply_layerwise_casting` does for a
    pipeline) says whether fp8 layerwise casting applies; ``load_bytes`` is the load dtype's bytes
    per element for floats (None: as stored); ``ctx.dtype_bytes`` is the compute dtype's.
    """
    features, notes = features_of(skeleton, role)
    cast_layers: set[str] = set()
    if role == "denoiser" if cast is None else cast:
        cast_layers = guess_cast_layers(tensors) if skeleton is None else cast_layers_of(skeleton)
    sizes = measure(tensors, name=name, dtype_bytes=load_bytes, cast_layers=cast_layers, compute_bytes=ctx.dtype_bytes)
    return ComponentProfile(name, role, sizes, ctx.dtype_bytes, activations_for(role, config, ctx, features=features),
                            tuple(notes))


# ----------------------------------------------------------------------------- folders and modules

def resolve_workload(path: str, workload: Workload) -> Workload:
    """Fill a missing height/width with the pipeline's default (as diffusers' ``__call__`` does), and
    a missing ``guidance`` with classifier-free guidance unless the denoiser embeds guidance (Flux)."""
    if workload.height and workload.width and workload.guidance is not None:
        return workload
    from ..formats.layout import find_components, is_pipeline_folder

    size = 1024
    if is_pipeline_folder(path):
        configs = {c.name: read_config(c.path) or {} for c in find_components(path) if c.has_weights}
        den = next((cfg for n, cfg in configs.items() if role_of(n) == "denoiser"), {})
        vae = next((cfg for n, cfg in configs.items() if role_of(n) == "vae"), {})
        scale = 2 ** (len(vae["block_out_channels"]) - 1) if vae.get("block_out_channels") else 8
        sample = den.get("sample_size")
        if isinstance(sample, int) and "down_block_types" in den:
            size = sample * scale
    else:
        den = (read_config(path) or {}) if os.path.isdir(path) else {}
    guidance = workload.guidance if workload.guidance is not None else not den.get("guidance_embeds", False)
    return replace(workload, height=workload.height or size, width=workload.width or size, guidance=guidance)


def profile_folder(path: str, workload: Workload, *, dtype: str | None = None) -> list[ComponentProfile]:
    """Profiles of every weight-bearing component of a pipeline folder, or of one component folder.

    Sizes come from the safetensors headers; the denoiser's and VAE's meta skeletons (built from
    ``config.json``, no weights) tell which switches and fp8 layers apply.
    """
    from ..formats.layout import find_components, is_pipeline_folder

    if not os.path.isdir(path):
        from ..errors import InvalidInputError, SourceNotFoundError

        if os.path.exists(path):  # a lone weights file has no config to tell its architecture
            raise InvalidInputError(f"{path}: is a file; fit reads a pipeline or component folder (weights with their "
                                    "config.json), e.g. the folder `shardkit split` wrote")
        raise SourceNotFoundError(f"{path}: no such folder (expected a pipeline or component folder)")
    workload = resolve_workload(path, workload)
    if is_pipeline_folder(path):
        specs = [(c.name, c.path, c.library, c.class_name) for c in find_components(path) if c.has_weights]
        if not specs:
            raise InvalidInputError(f"{path}: the pipeline has no component with weights")
    else:
        config = read_config(path) or {}
        library = "diffusers" if "_class_name" in config else "transformers"
        class_name = config.get("_class_name") or (config.get("architectures") or [None])[0]
        specs = [(os.path.basename(os.path.normpath(path)), path, library, class_name)]
        _check_diffusion_part(path, config, role_of(specs[0][0], class_name))
    configs = {name: read_config(folder) or {} for name, folder, _, _ in specs}
    roles = {name: role_of(name, cls) for name, _, _, cls in specs}
    guesses = {name: _guess(name, folder, roles, configs) for name, folder, _, _ in specs if not configs[name]}
    vae_cfg = next((configs[n] for n in configs if roles[n] == "vae"), {})
    den_cfg = next((configs[n] for n in configs if roles[n] == "denoiser"), {})
    vae_scale = 2 ** (len(vae_cfg["block_out_channels"]) - 1) if vae_cfg.get("block_out_channels") else 8
    profiles = [_profile_one(name, folder, library, cls, roles[name], configs[name], workload, dtype=dtype,
                             vae_scale=vae_scale, cfg=not den_cfg.get("guidance_embeds", False))
                for name, folder, library, cls in specs]
    return [replace(p, guessed=(guesses[p.name],)) if p.name in guesses else p for p in profiles]


def _check_diffusion_part(path: str, config: JsonObject, role: str) -> None:
    """``fit`` prices a diffusion pipeline's denoising steps: a folder holding a text model alone
    (a sentence-transformers BERT, an LLM) is refused, naming what it is and what covers it."""
    if not config or role in ("denoiser", "vae"):
        return
    architectures = config.get("architectures")
    cls = architectures[0] if isinstance(architectures, list) and architectures else None
    kind = config.get("model_type") or cls or config.get("_class_name") or "model"
    model = f"transformers:{cls}" if cls else "diffusers:CLASS"
    raise InvalidInputError(f"{path}: a {kind} model on its own; fit plans diffusion pipelines (a pipeline folder, "
                            "or its denoiser or VAE folder) for image generation. For any model's device map "
                            "within a memory budget use plan with ", Option("model", model), " and the budget")


def _guess(name: str, folder: str, roles: dict[str, str], configs: dict[str, JsonObject]) -> str:
    """Fill ``roles``/``configs`` for a component without config.json; warn and return what was assumed."""
    from .guess import guess_component, read_shapes

    known = roles[name] if roles[name] != "other" else None
    guess = guess_component(read_shapes(folder), role=known)
    roles[name] = guess.role or roles[name]
    configs[name] = guess.config
    warnings.warn(ShardkitWarning(f"{name}: {guess.description}"), stacklevel=4)
    return guess.description


def _profile_one(name: str, folder: str, library: str, class_name: str | None, role: str, config: JsonObject,
                 workload: Workload, *, dtype: str | None, vae_scale: int, cfg: bool) -> ComponentProfile:
    from ..units import normalize_dtype

    tensors, stored = header_tensors(folder)
    code = normalize_dtype(dtype) if dtype else (stored or "F32")
    ctx = Context(workload, DTYPE_BITS[code] // 8, vae_scale=vae_scale, cfg=cfg)
    skeleton, why_not = _skeleton(library, class_name, folder) if role in ("denoiser", "vae") else (None, None)
    # A pipeline computes in one dtype: every float is priced at it, whatever the file stores.
    profile = profile_component(name, role, tensors=tensors, config=config, ctx=ctx, skeleton=skeleton,
                                load_bytes=ctx.dtype_bytes)
    if why_not is None:
        return profile
    return replace(profile, notes=(*profile.notes, f"model not built ({why_not}): planned from the "
                                                                "weights' headers alone, without its memory switches"))


def _skeleton(library: str, class_name: str | None, folder: str) -> tuple[torch.nn.Module | None, str | None]:
    """The component's meta skeleton, or None and why when its class cannot be built here (sizes still work).

    Only the expected failures are turned into a note: a class or package that is not installed
    (``ImportError``), a class or config the library refuses (``InvalidInputError``). Anything
    else is a bug and propagates.
    """
    if not class_name or library not in ("diffusers", "transformers"):
        return None, None
    from ..loading.skeleton import build_skeleton

    try:
        return build_skeleton(f"{library}:{class_name}", config=folder), None
    except (ImportError, InvalidInputError) as e:
        reason = first_line(e)
        logger.debug("%s: no %s:%s skeleton: %s", folder, library, class_name, reason)
        return None, reason


def profile_module(module: Any,  # a model, by duck typing (fit() checks named_parameters)
                   workload: Workload, *, name: str = "model", role: str | None = None,
                   config: Config | None = None, dtype_bytes: int | None = None,
                   stored_bytes: Mapping[str, int] | None = None, cast: bool | None = None,
                   compute_bytes: int | None = None) -> ComponentProfile:
    """Profile an ``nn.Module`` (a meta skeleton or a loaded model) as one component.

    ``dtype_bytes`` is the load (and compute) dtype's bytes per element (None: the module's own
    tensors as they are, computing in their most common float dtype); ``stored_bytes`` (tensor name
    → bytes, from checkpoint headers) overrides the module's own sizes; ``cast`` as for
    :func:`profile_component`; ``compute_bytes`` overrides the compute dtype alone.
    """
    tensors = module_tensors(module, stored_bytes)
    cfg = module_config(module) if config is None else dict(config)
    role = role or role_of(name, type(module).__name__)
    compute = compute_bytes or dtype_bytes or common_float_bytes(tensors) or 4
    ctx = Context(workload, compute, cfg=not cfg.get("guidance_embeds", False))
    return profile_component(name, role, tensors=tensors, config=cfg, ctx=ctx, skeleton=module, cast=cast,
                             load_bytes=dtype_bytes)


def module_config(module: Any) -> JsonObject:
    """The module's config as a plain dict (diffusers ``FrozenDict``, transformers ``PretrainedConfig``)."""
    config = getattr(module, "config", None)
    if config is None:
        return {}
    return config.to_dict() if hasattr(config, "to_dict") else dict(config)
