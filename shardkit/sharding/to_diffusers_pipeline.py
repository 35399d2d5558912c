"""``convert --to diffusers``: a single-file SD/SDXL/SD3/Flux... checkpoint → a diffusers model or pipeline folder.

The mapping (which model, diffusers' own ``checkpoint_mapping_fn``, checked against the config's model)
is :mod:`shardkit.layouts.diffusers`; this module writes its result. One model
(:func:`convert_to_diffusers`): the checkpoint's tensors are backed by the file (safetensors mmap,
``torch.load(mmap=True)``), so the conversion holds no copy of the checkpoint in RAM, except for the
tensors diffusers itself builds (fused or reshaped weights); the tensors it only renames or slices are
still runs of the file, and are copied kernel-side (see :mod:`shardkit.sources.file_backed`), through the
normal writer: sharded, atomic, with its ``config.json``.

``--component all`` (:func:`convert_pipeline_to_diffusers`): each component of the ``--config`` pipeline
is handled as ``from_single_file`` handles it for a pipeline
(``diffusers.loaders.single_file.load_single_file_sub_model``), with diffusers' own functions and the
local config only:

- a diffusers model with a single-file mapping (unet, transformer, vae, controlnet...) is
  converted as a single component is, file-backed;
- a CLIP or T5 text encoder is built by ``create_diffusers_clip_model_from_ldm`` /
  ``create_diffusers_t5_model_from_checkpoint`` and saved in transformers' layout (these
  functions load the model, so a text encoder is held in memory while it is written);
- everything else (tokenizers, schedulers, ``model_index.json``, every component's config) is
  copied from the config folder; a model component that the checkpoint does not hold is copied
  from the config folder too when that folder has its weights (with a warning), else an error.

All components go into ONE transaction, like a pipeline split.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import InvalidInputError, Option, first_line
from ..formats.index import DIFFUSERS_PREFIX, TRANSFORMERS_PREFIX, Naming
from ..formats.layout import Component, find_components, is_pipeline_folder
from ..layouts.diffusers import (
    DiffusersTarget,
    find_target,
    has_single_file_mapping,
    map_to_diffusers,
    missing_config_error,
)
from ..sources import Source
from ..sources.file_backed import FileBacked, file_backed_source, load_file_backed
from ..sources.memory import MemorySource
from .job import ShardJob, SplitResult, plan_job, run_jobs, split_source
from .native import transformers_state_dict
from .options import WriteOptions, warn
from .pipeline import PipelineResult, pipeline_result, pipeline_side_files
from .quant import dequantized_for_mapping

__all__ = ["convert_checkpoint", "convert_pipeline_to_diffusers", "convert_to_diffusers"]

SHOWN = 3


def convert_to_diffusers(source: str | os.PathLike[str], output: str, *, options: WriteOptions,
                         config: str | os.PathLike[str] | None, component: str | None = None,
                         key: str | None = None) -> tuple[SplitResult, int]:
    """Convert a single-file checkpoint into a diffusers model folder that ``from_pretrained`` loads.

    Args:
        source: a ``.safetensors`` file or a pickle (``.ckpt``/``.pt``/``.bin``, loaded with
            ``weights_only=True``), in the original (LDM, BFL...) key names.
        output: the model folder to write (``config.json`` + ``diffusion_pytorch_model*``).
        options: the write options (shard size, cast, variant, overwrite, dry run...).
        config: see :func:`find_target`; None raises an error that says which config is needed.
        component: see :func:`find_target`.
        key: for pickles, the nested dict holding the state dict (default: auto).

    Returns:
        The :class:`SplitResult` and how many source tensors the model does not use.

    Raises:
        InvalidInputError: no config, a checkpoint diffusers cannot convert, or a conversion that
            does not give exactly the config's model.

    convert_to_diffusers("v1-5-pruned.safetensors", "unet/", options=WriteOptions(),
                         config="sd15-pipeline/", component="unet")
    """
    path = os.fspath(source)
    backing = load_file_backed(path, key=key, dequantize_to=_gguf_dtype(path, options))
    checkpoint = dequantized_for_mapping(backing.tensors, options=options, where=path)  # fp8 scales applied first
    if config is None:
        raise missing_config_error(path, checkpoint)
    target = find_target(config, component=component)
    converted, model = convert_checkpoint(checkpoint, target, where=path)
    with tempfile.TemporaryDirectory(prefix="shardkit-config-") as folder:
        model.save_config(folder)
        description = f"{path} as diffusers {target.class_name}"
        with file_backed_source(converted, backing, description=description, naming=Naming(DIFFUSERS_PREFIX)) as src:
            result = split_source(src, output, options=options,
                                  side_files=[(os.path.join(folder, "config.json"), "config.json")])
    return result, len(checkpoint) - len(converted)


def _gguf_dtype(path: str, options: WriteOptions) -> str:
    """What a GGUF's quantized tensors are dequantized to before diffusers' mapping: ``--dtype``, bf16 without it."""
    from ..units import LOSSLESS_TARGETS

    if path.endswith(".gguf") and options.cast_to is None:
        from ..sources.gguf import GgufSource

        src = GgufSource(path)
        quantized = len(src.quantized())
        src.close()
        if quantized:
            warn(f"{path}: {quantized} ggml-quantized tensor(s) dequantized to bf16 (choose with ", Option("dtype"),
                 ")")
    return options.cast_to if options.cast_to in LOSSLESS_TARGETS else "BF16" if options.cast_to is None else "F32"



def convert_checkpoint(checkpoint: Mapping[str, Any], target: DiffusersTarget, *,
                       where: str) -> tuple[dict[str, Any], Any]:
    """:func:`~shardkit.layouts.diffusers.map_to_diffusers`, saying which converted tensors are left out.

    Returns:
        The converted ``{name: tensor}`` (only the model's parameters) and the model, on the meta device.
    """
    mapped = map_to_diffusers(checkpoint, target, where=where)
    if mapped.unused:
        warn(f"{where}: {len(mapped.unused)} converted tensor(s) are not parameters of {target.class_name} and are "
             f"left out, e.g. {', '.join(mapped.unused[:SHOWN])}")
    return mapped.tensors, mapped.model


def convert_pipeline_to_diffusers(source: str | os.PathLike[str], output: str, *, options: WriteOptions,
                                  config: str | os.PathLike[str] | None, key: str | None = None) -> PipelineResult:
    """Convert a single-file checkpoint into a pipeline folder shaped like the ``config`` pipeline.

    Args:
        source: a ``.safetensors`` file or a pickle in the original key names.
        output: the pipeline folder to write.
        options: the write options; ``name`` must be None (each component keeps its naming).
        config: a local pipeline folder (``model_index.json`` + component configs); its
            weights are not needed, except for components the checkpoint does not hold.
        key: for pickles, the nested dict holding the state dict (default: auto).

    Returns:
        A ``PipelineResult`` with one result per written component and the copied files.

    convert_pipeline_to_diffusers("v1-5-pruned.safetensors", "sd15/", options=WriteOptions(),
                                  config="sd15-configs/")
    """
    path = os.fspath(source)
    backing = load_file_backed(path, key=key)
    if config is None:
        raise missing_config_error(path, backing.tensors)
    folder = os.fspath(config)
    if not is_pipeline_folder(folder):
        raise InvalidInputError(Option("component", "all"), " writes a whole pipeline: ", Option("config"),
                                " must be a pipeline folder "
                                f"(with model_index.json), not {folder}")
    if options.name is not None:
        raise InvalidInputError(Option("name"), " does not apply to a pipeline: every component keeps its own naming")
    jobs: list[ShardJob] = []
    try:
        for component in find_components(folder):
            src = _component_source(component, backing, folder, where=path)
            if src is not None:
                jobs.append(plan_job(src, options=options, folder=component.name))
        copied = pipeline_side_files(folder, jobs)
        run_jobs(output, jobs, options=options, side_files=[(os.path.join(folder, rel), rel) for rel in copied])
        return _result(path, output, jobs, options, copied)
    finally:
        for job in jobs:
            job.source.close()


def _component_source(component: Component, backing: FileBacked, folder: str, *, where: str) -> Source | None:
    """The converted tensors of one component, or None when its files are copied from the config folder."""
    cls = _component_class(component)
    checkpoint = backing.tensors
    if component.library == "diffusers" and has_single_file_mapping(component.class_name):
        target = DiffusersTarget(component.class_name, os.path.join(component.path, "config.json"))
        converted, _ = convert_checkpoint(checkpoint, target, where=f"{where} ({component.name})")
        return file_backed_source(converted, backing, description=f"{where} as {component.name}",
                                  naming=Naming(DIFFUSERS_PREFIX))
    model = _text_encoder(cls, component, checkpoint, folder) if component.library == "transformers" else None
    if model is not None:
        state, keep = transformers_state_dict(model)
        _refuse_missing(state, component, where)
        return MemorySource(state, description=f"{where} as {component.name}", naming=Naming(TRANSFORMERS_PREFIX),
                            keep=keep)
    if _is_model(cls):
        if not component.has_weights:
            raise InvalidInputError(f"{component.name} ({component.class_name}) is not in {where} and ",
                                    Option("config", folder), " "
                                    f"has no weights for it: add them to {component.path}, or set it to "
                                    "[null, null] in model_index.json if the pipeline can run without it")
        warn(f"{component.name} ({component.class_name}) is not in {where}: its weights are copied from ",
             Option("config", folder))
    return None


def _component_class(component: Component) -> Any:
    """The class ``model_index.json`` names (a diffusers pipeline module such as ``stable_diffusion`` too)."""
    module: Any
    try:
        module = importlib.import_module(component.library)
    except ImportError:
        import diffusers.pipelines

        module = getattr(diffusers.pipelines, component.library, None)
    return getattr(module, component.class_name, None)


def _is_model(cls: Any) -> bool:
    import torch

    return isinstance(cls, type) and issubclass(cls, torch.nn.Module)


def _text_encoder(cls: Any, component: Component, checkpoint: Mapping[str, Any], folder: str) -> Any:
    """A CLIP or T5 text encoder built by diffusers from the checkpoint, or None when it holds none."""
    from diffusers.loaders import single_file_utils

    if not isinstance(cls, type):
        return None
    sfu: Any = single_file_utils  # untyped
    build: Callable[..., Any]
    if sfu.is_clip_model_in_single_file(cls, checkpoint):
        build = sfu.create_diffusers_clip_model_from_ldm
    elif sfu.is_t5_in_single_file(checkpoint) and "T5" in cls.__name__:
        build = sfu.create_diffusers_t5_model_from_checkpoint
    else:
        return None
    try:
        return build(cls, checkpoint=dict(checkpoint), config=folder, subfolder=component.name, local_files_only=True)
    except Exception as e:  # diffusers raises ValueError/KeyError/OSError for a checkpoint or config that differ
        first = first_line(e)
        raise InvalidInputError(f"{component.name} ({component.class_name}): diffusers could not build it from the "
                                "checkpoint with ", Option("config", folder), f" ({type(e).__name__}: {first})") from e


def _refuse_missing(state: Mapping[str, Any], component: Component, where: str) -> None:
    """diffusers leaves parameters the checkpoint lacks on the meta device; name them rather than write a hole."""
    missing = [name for name, t in state.items() if t.is_meta]
    if missing:
        raise InvalidInputError(f"{where}: {len(missing)} parameter(s) of {component.name} ({component.class_name}) "
                                f"are not in the checkpoint, e.g. {', '.join(missing[:3])}; check ", Option("config"))


def _result(path: str, output: str, jobs: list[ShardJob], options: WriteOptions, copied: list[str]) -> PipelineResult:
    return pipeline_result(f"{path} as a diffusers pipeline", output, jobs, options, copied)
