"""diffusers pipeline folders: split or convert every weight-bearing component in one transaction.

A pipeline folder is ``model_index.json`` plus one subfolder per component (see
:mod:`shardkit.formats.layout`). Each component with weights is streamed into shards that keep its
naming (diffusers ``diffusion_pytorch_model*``, transformers ``model*``); every other file
(``model_index.json``, ``config.json``, tokenizer, scheduler, README...) is copied unchanged.
Everything goes through ONE :class:`~shardkit.atomic.commit.OutputTransaction` (see
:func:`~shardkit.sharding.job.run_jobs`), so the output folder appears complete or not at all,
and every copied file is fsynced before it is published, like the shards.

Other weight files of a component (another variant, a ``.bin`` twin of the converted
``.safetensors``) are left out, with a warning that names them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import InvalidInputError, Option
from ..formats.index import naming_from_filename
from ..formats.layout import find_components, is_pipeline_folder
from ..formats.side_files import folder_side_files
from ..formats.suffixes import is_manifest_file, is_saved_weight_file
from ..sources import Source, open_source
from ..sources.ranged import beneath, shown
from .job import ShardJob, SideFile, SplitResult, plan_job, run_jobs, settle_source
from .options import WriteOptions, warn
from .plan import ShardPlan, ShardSpec

__all__ = ["PipelineResult", "is_pipeline_folder", "split_pipeline"]



@dataclass
class PipelineResult(SplitResult):
    """A split of a whole pipeline: ``plan`` lists every component's shards (``unet/...``)."""

    components: dict[str, SplitResult] = field(default_factory=dict)

    @property
    def files(self) -> list[str]:
        return [os.path.join(self.output, name, f) for name, r in self.components.items() for f in r.plan.filenames()]

    def to_dict(self) -> dict[str, object]:
        doc = super().to_dict()
        doc["index"] = None
        doc["components"] = {name: r.to_dict() for name, r in self.components.items()}
        return doc


ComponentView = Callable[[str, Source], Source]  # (component name, its source) → the source written


def split_pipeline(folder: str | os.PathLike[str], output: str | os.PathLike[str],
                   *, options: WriteOptions | None = None, key: str | None = None,
                   view: ComponentView | None = None) -> PipelineResult:
    """Shard every weight-bearing component of a diffusers pipeline folder; copy everything else.

    Args:
        folder: the pipeline folder (``model_index.json`` plus component subfolders); a
            :class:`~shardkit.sources.ranged.RangedCheckpoint` reads every component by range.
        output: the output folder; with ``options.overwrite`` it may be ``folder`` itself.
        options: shard size, cast, variant... (default: :class:`WriteOptions` defaults); ``name``
            must be None, since every component keeps its own naming.
        key: must be None (each component has its own state dict).
        view: wraps a component's source before it is planned (a LoRA merged into the UNet).

    Returns:
        A :class:`PipelineResult`: the combined plan, one result per component, the copied files.

    result = split_pipeline("sdxl/", "sdxl-sharded/", options=WriteOptions(max_shard_bytes=2 * 10**9))
    sorted(result.components)
    ['text_encoder', 'text_encoder_2', 'unet', 'vae']
    """
    given, folder, output = folder, os.fspath(folder), os.fspath(output)
    options = options or WriteOptions()
    if options.name is not None or key is not None:
        option = Option("name") if options.name is not None else Option("key")
        raise InvalidInputError(option, f" does not apply to a pipeline folder ({folder}): every component keeps "
                                "its own naming and state dict; run it on a component folder instead")
    settle_source(folder, output, dry_run=options.dry_run)  # rolled forward only in place
    jobs, left_out = _open_components(given, options, view)
    try:
        _warn_left_out(jobs, left_out)
        in_place = os.path.realpath(folder) == os.path.realpath(output)
        copied = [] if in_place else pipeline_side_files(folder, jobs)  # in place, they stay where they are
        copies: list[SideFile] = [(os.path.join(folder, rel), rel) for rel in copied]
        run_jobs(output, jobs, options=options, side_files=copies)
        return _result(shown(given), output, jobs, options, copied)
    finally:
        for job in jobs:
            job.source.close()


def _open_components(folder: str | os.PathLike[str], options: WriteOptions,
                     view: ComponentView | None = None) -> tuple[list[ShardJob], dict[str, list[str]]]:
    """One planned job per weight-bearing component, and the weight files each one leaves out."""
    opened: list[Source] = []
    jobs: list[ShardJob] = []
    left_out: dict[str, list[str]] = {}
    try:
        for component in find_components(folder):
            if not component.has_weights:
                continue
            opened.append(open_source(beneath(folder, component.path)))  # by range too where folder is read so
            left_out[component.name] = _other_weight_files(component.path, opened[-1])
            if view is not None:
                opened[-1] = view(component.name, opened[-1])  # closing the view closes the component's source
            jobs.append(plan_job(opened[-1], options=options, folder=component.name))
    except BaseException:
        for source in opened:
            source.close()
        raise
    if not jobs:
        raise InvalidInputError(f"{folder}: pipeline folder has no component with weights (.safetensors or .bin)")
    return jobs, left_out


def _warn_left_out(jobs: list[ShardJob], left_out: dict[str, list[str]]) -> None:
    for job in jobs:
        if left_out[job.folder]:
            warn(f"{job.folder}: left out {', '.join(left_out[job.folder])} (other weight files of this "
                 f"component; only {job.source.description} was converted)")


def _other_weight_files(component_path: str, source: Source) -> list[str]:
    """Weight files of the component that the chosen checkpoint does not use."""
    used = {os.path.basename(p) for p in source.paths}
    used |= {naming_from_filename(p).index() for p in source.paths}
    index_path = getattr(getattr(source, "index", None), "path", None)
    if index_path:
        used.add(os.path.basename(index_path))
    return sorted(n for n in os.listdir(component_path)
                  if not n.startswith(".") and is_saved_weight_file(n) and n not in used
                  and os.path.isfile(os.path.join(component_path, n)))


def pipeline_side_files(folder: str, jobs: list[ShardJob]) -> list[str]:
    """Every file (relative path) to copy: all but the weight files of the rewritten components
    (see :func:`~shardkit.formats.side_files.folder_side_files`)."""
    return [rel for rel in folder_side_files(folder, rewritten=[job.folder for job in jobs])
            if not is_manifest_file(os.path.basename(rel))]


def _result(folder: str, output: str, jobs: list[ShardJob], options: WriteOptions, copied: list[str]) -> PipelineResult:
    return pipeline_result(f"diffusers pipeline {folder}", output, jobs, options, copied)


def pipeline_result(description: str, output: str, jobs: list[ShardJob], options: WriteOptions,
                    copied: list[str]) -> PipelineResult:
    """One :class:`PipelineResult` over the component jobs written into ``output``."""
    components = {job.folder: job.result(output, options) for job in jobs}
    shards = tuple(ShardSpec(job.path(s.filename), s.names, s.nbytes) for job in jobs for s in job.plan.shards)
    combined = ShardPlan(shards, None, sum(s.nbytes for s in shards), options.max_shard_bytes)
    return PipelineResult(output, combined, description, options.cast_to, options.dry_run,
                          components=components, copied=copied, cloned_bytes=sum(job.cloned_bytes for job in jobs))
