"""``convert --to diffusers --component all``: a single-file checkpoint → a whole diffusers pipeline folder.

Each component of the ``--config`` pipeline is handled as ``from_single_file`` handles it for a
pipeline (``diffusers.loaders.single_file.load_single_file_sub_model``), with diffusers' own
functions and the local config only:

- a diffusers model with a single-file mapping (unet, transformer, vae, controlnet...) is
  converted as a single component is (:mod:`shardkit.sharding.to_diffusers`), file-backed;
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
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import InvalidInputError
from ..formats.index import DIFFUSERS_PREFIX, TRANSFORMERS_PREFIX, Naming
from ..formats.layout import Component, find_components, is_pipeline_folder
from ..sources import Source
from ..sources.file_backed import FileBacked, file_backed_source, load_file_backed
from ..sources.memory import MemorySource
from .job import ShardJob, plan_job, run_jobs
from .native import transformers_state_dict
from .options import WriteOptions, warn
from .pipeline import PipelineResult, pipeline_result, pipeline_side_files
from .to_diffusers import DiffusersTarget, convert_checkpoint, has_single_file_mapping, missing_config_error

__all__ = ["convert_pipeline_to_diffusers"]


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
        raise InvalidInputError(f"component='all' writes a whole pipeline: config=... must be a pipeline folder "
                                f"(with model_index.json), not {folder}")
    if options.name is not None:
        raise InvalidInputError("name=... does not apply to a pipeline: every component keeps its own naming")
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
            raise InvalidInputError(f"{component.name} ({component.class_name}) is not in {where} and config={folder!r} "
                                    f"has no weights for it: add them to {component.path}, or set it to "
                                    "[null, null] in model_index.json if the pipeline can run without it")
        warn(f"{component.name} ({component.class_name}) is not in {where}: its weights are copied from config={folder!r}")
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
    from diffusers.loaders import single_file_utils as sfu

    if not isinstance(cls, type):
        return None
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
        first = str(e).splitlines()[0][:200] if str(e) else ""
        raise InvalidInputError(f"{component.name} ({component.class_name}): diffusers could not build it from the "
                                f"checkpoint with config={folder!r} ({type(e).__name__}: {first})") from e


def _refuse_missing(state: Mapping[str, Any], component: Component, where: str) -> None:
    """diffusers leaves parameters the checkpoint lacks on the meta device; name them rather than write a hole."""
    missing = [name for name, t in state.items() if t.is_meta]
    if missing:
        raise InvalidInputError(f"{where}: {len(missing)} parameter(s) of {component.name} ({component.class_name}) "
                                f"are not in the checkpoint, e.g. {', '.join(missing[:3])}; check config=...")


def _result(path: str, output: str, jobs: list[ShardJob], options: WriteOptions, copied: list[str]) -> PipelineResult:
    return pipeline_result(f"{path} as a diffusers pipeline", output, jobs, options, copied)
