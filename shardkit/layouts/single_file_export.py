"""Which diffusers folders a single-file export reads, and where each one's tensors go: the export plan.

The way back from :mod:`shardkit.layouts.diffusers`, for the checkpoints ComfyUI, A1111/Forge and
stable-diffusion.cpp load:

==========  =============================================  ==========================================
type        what                                           original names
==========  =============================================  ==========================================
sd1, sd2    UNet, VAE, or the pipeline (``--component all``)  ``model.diffusion_model.*``,
                                                           ``first_stage_model.*``, ``cond_stage_model.*``
sdxl        UNet, VAE, or the pipeline (base; refiner)     ``conditioner.embedders.N.*`` for the text encoders
sd3         SD3 / SD3.5 transformer                        ``model.diffusion_model.joint_blocks.*``
flux        Flux.1 transformer                             BFL: ``double_blocks.*``, ``single_blocks.*``
==========  =============================================  ==========================================

A VAE exported alone has no prefix, as standalone VAE files (``sdxl_vae.safetensors``) have.
:func:`plan_export` names the parts (folder, layout of :data:`shardkit.layouts.single_file.LAYOUTS`,
prefix); :func:`trace_part` learns, from diffusers' own single-file conversion run forward
(:mod:`shardkit.layouts.single_file_trace`), which original tensor each diffusers tensor becomes and
how fused tensors (q/k/v, Flux's ``linear1``) are put together. Writing the result is
:mod:`shardkit.sharding.to_single_file`'s.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

from ..errors import InvalidInputError, Option, Part, parts_of
from ..formats.header import TensorEntry
from ..formats.json_types import Config, JsonObject
from ..formats.layout import (
    Component,
    check_config_numbers,
    find_components,
    is_pipeline_folder,
    read_config,
    read_model_index,
)
from .single_file import LAYOUTS, original_shapes
from .single_file_trace import Original, check_complete, produced_names, trace_conversion
from .table import Mapped

__all__ = ["SUPPORTED", "ExportPart", "SingleFileFamily", "plan_export", "trace_part", "unplaced_components"]

SUPPORTED: tuple[Part, ...] = ("SD 1.x / SD 2.x / SDXL UNets and VAEs and their pipelines (", Option("component",
                                                                                                     "all"),
                               "), SD3/SD3.5 transformers and Flux.1 transformers")
UNET, LDM_VAE, LDM_CLIP, SGM_CLIP = "model.diffusion_model.", "first_stage_model.", "cond_stage_model.", "conditioner."
# diffusers class of a model folder → (layout, prefix when exported alone, model type or None: from its config)
_MODELS: dict[str, tuple[str, str, str | None]] = {
    "UNet2DConditionModel": ("unet", UNET, None), "AutoencoderKL": ("vae", "", "vae"),
    "SD3Transformer2DModel": ("sd3", UNET, "sd3"), "FluxTransformer2DModel": ("flux", "", "flux"),
}
# model_index.json _class_name → pipeline family written by --component all
_PIPELINES = {"StableDiffusionPipeline": "sd", "StableDiffusionImg2ImgPipeline": "sd",
              "StableDiffusionInpaintPipeline": "sd", "StableDiffusionXLPipeline": "sdxl",
              "StableDiffusionXLImg2ImgPipeline": "sdxl", "StableDiffusionXLInpaintPipeline": "sdxl"}
# (model type, component) → (layout, prefix) in the combined checkpoint
_COMBINED: dict[tuple[str, str], tuple[str, str]] = {
    **{(t, "unet"): ("unet", UNET) for t in ("sd1", "sd2", "sdxl", "sdxl-refiner")},
    **{(t, "vae"): ("vae", LDM_VAE) for t in ("sd1", "sd2", "sdxl", "sdxl-refiner")},
    ("sd1", "text_encoder"): ("clip", LDM_CLIP + "transformer."),
    ("sd2", "text_encoder"): ("openclip", LDM_CLIP + "model."),
    ("sdxl", "text_encoder"): ("clip", SGM_CLIP + "embedders.0.transformer."),
    ("sdxl", "text_encoder_2"): ("openclip", SGM_CLIP + "embedders.1.model."),
    ("sdxl-refiner", "text_encoder_2"): ("openclip", SGM_CLIP + "embedders.0.model."),
}


@dataclass(frozen=True)
class ExportPart:
    """One diffusers model folder and where its tensors go in the single file."""

    component: str
    folder: str
    layout: str
    prefix: str


def plan_export(source: str, *, component: str | None) -> tuple[str, list[ExportPart]]:
    """The model type and the model folders that ``source`` (a model or pipeline folder) exports.

    Raises:
        InvalidInputError: not a diffusers folder, or a model type with no single-file layout here.

    plan_export("sdxl-pipeline/", component="all")[0]
    'sdxl'
    """
    if is_pipeline_folder(source):
        return _pipeline_parts(source, component)
    if component is not None:
        raise InvalidInputError(Option("component", component),
                                " applies to a pipeline folder (with model_index.json); "
                                f"{source} is one model's folder: drop ", Option("component"))
    class_name, config = _model_config(source)
    if class_name not in _MODELS:
        raise _unsupported(f"{source} holds a {class_name}")
    layout, prefix, model_type = _MODELS[class_name]
    return model_type or _unet_type(config), [ExportPart("", source, layout, prefix)]


def _pipeline_parts(folder: str, component: str | None) -> tuple[str, list[ExportPart]]:
    index = read_model_index(folder)
    family = _PIPELINES.get(str(index.get("_class_name")))
    models = {c.name: c for c in find_components(folder) if c.class_name}
    if component != "all":
        name = component or next((n for n in ("unet", "transformer") if n in models), None)
        if name is None or name not in models:
            raise InvalidInputError(f"{folder}: no component {name or 'unet/transformer'!r}; its model_index.json lists "
                                    f"{', '.join(sorted(models)) or 'none'} (or pass ", Option("component", "all"), ")")
        model_type, parts = plan_export(models[name].path, component=None)
        return (_pipeline_type(folder, family, models) if family else model_type), [replace(parts[0], component=name)]
    if family is None:
        raise _unsupported(Option("component", "all"),
                           f": {folder} is a {index.get('_class_name')}; export its transformer with ",
                           Option("component", "transformer"), ", or")
    model_type = _pipeline_type(folder, family, models)
    return model_type, [ExportPart(name, models[name].path, *_COMBINED[(model_type, name)]) for name in models
                        if (model_type, name) in _COMBINED]


def unplaced_components(folder: str, model_type: str) -> list[str]:
    """The weighted components of the pipeline ``folder`` that the ``model_type`` single file has no place for."""
    return [c.name for c in find_components(folder) if c.class_name and c.has_weights
            and (model_type, c.name) not in _COMBINED and c.library in ("diffusers", "transformers")]


def _pipeline_type(folder: str, family: str, models: Mapping[str, Component]) -> str:
    """sd1 / sd2 (OpenCLIP text encoder, ``gelu``) / sdxl / sdxl-refiner (no first text encoder)."""
    if family == "sdxl":
        return "sdxl" if "text_encoder" in models else "sdxl-refiner"
    if "text_encoder" not in models:
        return _unet_type(_model_config(os.path.join(folder, "unet"))[1])
    text_config = read_config(os.path.join(folder, "text_encoder")) or {}
    return "sd2" if text_config.get("hidden_act") == "gelu" else "sd1"


def _unet_type(config: Config) -> str:
    if config.get("addition_embed_type") == "text_time":
        return "sdxl"
    return "sd2" if config.get("use_linear_projection") else "sd1"


def _model_config(folder: str) -> tuple[str, JsonObject]:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise InvalidInputError(f"{folder}: not a diffusers model or pipeline folder (no config.json or "
                                "model_index.json); ", Option("to", "single-file"),
                                " reads a folder that save_pretrained wrote")
    config = read_config(folder)
    if config is None:
        raise InvalidInputError(f"{path}: not a JSON object; not a diffusers model config")
    class_name = config.get("_class_name") or next(iter(config.get("architectures") or []), None)
    if not isinstance(class_name, str):
        raise InvalidInputError(f"{path}: names no model class (\"_class_name\"); not a diffusers model config")
    if class_name.startswith(("CLIPText", "T5")):
        raise InvalidInputError(f"{folder} holds a text encoder ({class_name}); a text encoder is exported inside its "
                                "pipeline's checkpoint with ", Option("component", "all"),
                                " (alone, its transformers names are "
                                "already what ComfyUI's CLIP loader reads)")
    return class_name, config


def _unsupported(*what: Part) -> InvalidInputError:
    return InvalidInputError(*what, "; ", Option("to", "single-file"), " exports ", *SUPPORTED)


def trace_part(part: ExportPart, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Original]:
    """Original name → :class:`Original` for one model, checked against diffusers' forward conversion."""
    layout = LAYOUTS[part.layout]
    where = part.folder
    config = read_config(part.folder) or {}
    _check_against_model(part.folder, config, shapes)
    originals = original_shapes(layout, shapes, config, part.prefix, where=where)
    traced = trace_conversion(lambda ck: layout.forward(ck, config, part.prefix, shapes), originals, where=where)
    check_complete(traced, shapes, produced_names(traced), where=where)
    return traced


def _check_against_model(folder: str, config: Config, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """A diffusers folder missing parameters of its model (or holding other shapes) would export an incomplete file."""
    import diffusers
    import torch

    cls = getattr(diffusers, str(config.get("_class_name")), None)
    if not (isinstance(cls, type) and hasattr(cls, "from_config")):
        return  # a transformers text encoder: diffusers' loader checks it when the pipeline loads
    check_config_numbers(config, where=f"{folder}/config.json")  # bounded before the model is built
    try:
        with torch.device("meta"):
            expected = {n: tuple(t.shape) for n, t in cls.from_config(dict(config)).state_dict().items()}
    except (TypeError, ValueError) as e:
        raise InvalidInputError(f"{folder}/config.json: {cls.__name__} refuses it (", *parts_of(e), ")") from e
    missing = [n for n in expected if n not in shapes]
    wrong = [f"{n} {list(shapes[n])} (config: {list(expected[n])})" for n in expected
             if n in shapes and shapes[n] != expected[n]]
    if missing or wrong:
        what = f"misses {len(missing)} of its tensors, e.g. {', '.join(missing[:3])}" if missing else \
            f"holds {len(wrong)} tensor(s) of another shape, e.g. {wrong[0]}"
        raise InvalidInputError(f"{folder}: the {cls.__name__} its config.json describes {what}; the folder is not a "
                                "complete save_pretrained output")


@dataclass(frozen=True)
class SingleFileFamily:
    """One family's diffusers ↔ original single-file mapping as a layout of the registry
    (:class:`~shardkit.layouts.table.LayoutStrategy`): forward is the layout's namer
    (:func:`~shardkit.layouts.single_file.original_shapes`), inverse is diffusers' own single-file conversion,
    both run on the meta device (no memory, real sizes cost nothing).

    Attributes:
        layout: the key of :data:`~shardkit.layouts.single_file.LAYOUTS`.
        prefix: where the family's tensors go in the single file.
        library, class_name, config: the model of the sample (``diffusers`` or ``transformers``), built empty.
    """

    layout: str
    prefix: str
    library: str
    class_name: str
    config: Config

    def sample(self) -> Mapped:
        """The diffusers (or transformers) names and shapes of the family's model, and its config."""
        import importlib

        import torch

        cls = getattr(importlib.import_module(self.library), self.class_name)
        with torch.device("meta"):
            if self.library == "diffusers":
                model = cls.from_config(dict(self.config))
                config = dict(model.config)
            else:
                model_config = cls.config_class(**self.config)
                model = cls(model_config)
                config = model_config.to_dict()
        return Mapped(tuple(_entry(n, tuple(t.shape)) for n, t in model.state_dict().items()), config)

    def forward(self, plain: Mapped) -> Mapped:
        """The original names and shapes the family's layout gives the model's tensors."""
        shapes = {e.name: e.shape for e in plain.entries}
        originals = original_shapes(LAYOUTS[self.layout], shapes, plain.config, self.prefix, where=self.class_name)
        return Mapped(tuple(_entry(n, s) for n, s in originals.items()), plain.config)

    def inverse(self, stored: Mapped) -> Mapped:
        """What diffusers' ``from_single_file`` conversion makes of the original tensors (names and shapes).

        Raises:
            InvalidInputError: diffusers fills a fused tensor (q/k/v...) in another order than the layout puts it.
        """
        import torch

        layout = LAYOUTS[self.layout]
        shapes = {e.name: e.shape for e in stored.entries}
        model = {e.name: e.shape for e in self.sample().entries}  # the model's names: for text_model-less CLIPs
        probes = {n: torch.empty(s, device="meta") for n, s in shapes.items()}
        converted = layout.forward(probes, stored.config, self.prefix, {**shapes, **model})
        traced = trace_conversion(lambda ck: layout.forward(ck, stored.config, self.prefix, {**shapes, **model}),
                                  shapes, where=self.class_name)
        name_of = layout.namer(model, stored.config)
        for original in traced.values():
            filled = list(dict.fromkeys(p.target for p in sorted(original.pieces, key=lambda p: p.offset)))
            placed = sorted(filled, key=lambda t: (name_of(t) or ("", -1))[1])
            if filled != placed:
                raise InvalidInputError(f"{original.name}: diffusers fills it from {', '.join(filled)} in that order; "
                                        f"the {self.layout} layout puts {', '.join(placed)}")
        return Mapped(tuple(_entry(n, tuple(t.shape)) for n, t in converted.items()), stored.config)


def _entry(name: str, shape: tuple[int, ...]) -> TensorEntry:
    from ..units import tensor_nbytes

    return TensorEntry(name, "F32", shape, tensor_nbytes("F32", shape))
