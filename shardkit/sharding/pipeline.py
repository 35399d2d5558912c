"""diffusers pipeline folders: split or convert every weight-bearing component in one transaction.

A pipeline folder is ``model_index.json`` plus one subfolder per component (see
:mod:`shardkit.components`). Each component with weights is streamed into shards that keep its
naming (diffusers ``diffusion_pytorch_model*``, transformers ``model*``); every other file
(``model_index.json``, ``config.json``, tokenizer, scheduler, README...) is copied unchanged.
Everything goes through ONE :class:`~shardkit.commit.OutputTransaction`, so the output folder
appears complete or not at all.

Other weight files of a component (another variant, a ``.bin`` twin of the converted
``.safetensors``) are left out, with a warning that names them.
"""

from __future__ import annotations

import os
import shutil
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

from ..atomic.commit import OutputTransaction, recover
from ..errors import InvalidInputError, ShardkitWarning
from ..formats.index import dump_index, naming_from_filename
from ..formats.layout import find_components, is_pipeline_folder
from ..sources import Source, open_source
from ..units import parse_size
from .plan import ShardPlan, ShardSpec
from .split import SplitResult, prepare_split, resolve_cast
from .writer import ByteCounter, Placement, write_safetensors

__all__ = ["PipelineResult", "split_pipeline", "is_pipeline_folder"]

ProgressCallback = Callable[[int, int], None]
_INDEX_MARK = ".index"


@dataclass
class PipelineResult(SplitResult):
    """A split of a whole pipeline: ``plan`` lists every component's shards (``unet/...``)."""

    components: dict[str, SplitResult] = field(default_factory=dict)
    copied: list[str] = field(default_factory=list)

    @property
    def files(self) -> list[str]:
        return [os.path.join(self.output, name, f) for name, r in self.components.items() for f in r.plan.filenames()]

    def to_dict(self) -> dict[str, Any]:
        doc = super().to_dict()
        doc["index"] = None
        doc["components"] = {name: r.to_dict() for name, r in self.components.items()}
        doc["copied"] = list(self.copied)
        return doc


@dataclass
class _Work:
    """One component to write: its open source, placements and plan."""

    name: str
    source: Source
    placements: list[Placement]
    plan: ShardPlan
    skipped: list[str]


def split_pipeline(folder: str | os.PathLike[str], output: str | os.PathLike[str], *,
                   max_shard_size: str | int = "5GB", dtype: str | None = None, name: str | None = None,
                   variant: str | None = None, allow_lossy: bool = False, overwrite: bool = False,
                   dry_run: bool = False, key: str | None = None, metadata: dict[str, str] | None = None,
                   progress: ProgressCallback | None = None) -> PipelineResult:
    """Shard every weight-bearing component of a diffusers pipeline folder; copy everything else.

    >>> result = split_pipeline("sdxl-pipeline/", "sdxl-sharded/", max_shard_size="2GB")  # doctest: +SKIP
    >>> sorted(result.components)                                                         # doctest: +SKIP
    ['text_encoder', 'text_encoder_2', 'unet', 'vae']
    """
    folder, output = os.fspath(folder), os.fspath(output)
    if name is not None or key is not None:
        option = "--name" if name is not None else "--key"
        raise InvalidInputError(f"{option} does not apply to a pipeline folder ({folder}): every component keeps "
                                "its own naming and state dict; run it on a component folder instead")
    max_shard_bytes = parse_size(max_shard_size, name="max shard size")
    cast_to = resolve_cast(dtype, allow_lossy=allow_lossy)
    if not dry_run:
        recover(folder)
    works = _open_components(folder, max_shard_bytes=max_shard_bytes, cast_to=cast_to, variant=variant)
    try:
        copied = [] if dry_run else _side_files(folder, works)
        result = _result(folder, output, works, cast_to=cast_to, dry_run=dry_run, copied=copied)
        for work in works:
            if work.skipped:
                warnings.warn(f"{work.name}: left out {', '.join(work.skipped)} (other weight files of this "
                              f"component; only {work.source.description} was converted)", ShardkitWarning, stacklevel=3)
        if not dry_run:
            _write(folder, output, works, copied, overwrite=overwrite, metadata=metadata, progress=progress,
                   total_bytes=result.plan.total_bytes)
    finally:
        for work in works:
            work.source.close()
    return result


def _open_components(folder: str, *, max_shard_bytes: int, cast_to: str | None, variant: str | None) -> list[_Work]:
    works: list[_Work] = []
    try:
        for component in find_components(folder):
            if not component.has_weights:
                continue
            source = open_source(component.path)
            works.append(_Work(component.name, source, [], ShardPlan((), None, 0, max_shard_bytes), []))
            works[-1].placements, works[-1].plan = prepare_split(source, max_shard_bytes=max_shard_bytes,
                                                                 cast_to=cast_to, name=None, variant=variant)
            works[-1].skipped = _other_weight_files(component.path, source)
    except BaseException:
        for work in works:
            work.source.close()
        raise
    if not works:
        raise InvalidInputError(f"{folder}: pipeline folder has no component with weights (.safetensors or .bin)")
    return works


def _is_weight_file(filename: str) -> bool:
    return filename.endswith((".safetensors", ".bin")) or (_INDEX_MARK in filename and filename.endswith(".json")
                                                          and (".safetensors" in filename or ".bin" in filename))


def _other_weight_files(component_path: str, source: Source) -> list[str]:
    """Weight files of the component that the chosen checkpoint does not use."""
    used = {os.path.basename(p) for p in source.paths}
    used |= {naming_from_filename(p).index() for p in source.paths}
    index_path = getattr(getattr(source, "index", None), "path", None)
    if index_path:
        used.add(os.path.basename(index_path))
    return sorted(n for n in os.listdir(component_path)
                  if not n.startswith(".") and _is_weight_file(n) and n not in used
                  and os.path.isfile(os.path.join(component_path, n)))


def _side_files(folder: str, works: list[_Work]) -> list[str]:
    """Every non-hidden file (relative path) that is not a weight file of a component."""
    components = {w.name for w in works}
    found = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        rel_dir = os.path.relpath(dirpath, folder)
        top = rel_dir.split(os.sep)[0]
        for filename in sorted(filenames):
            if filename.startswith("."):
                continue
            if top in components and rel_dir == top and _is_weight_file(filename):
                continue
            found.append(os.path.normpath(os.path.join(rel_dir, filename)))
    return found


def _result(folder: str, output: str, works: list[_Work], *, cast_to: str | None, dry_run: bool,
            copied: list[str]) -> PipelineResult:
    components = {
        w.name: SplitResult(os.path.join(output, w.name), w.plan, w.source.description, cast_to, dry_run,
                            w.source.aliases())
        for w in works
    }
    shards = tuple(ShardSpec(f"{w.name}/{s.filename}", s.names, s.nbytes) for w in works for s in w.plan.shards)
    combined = ShardPlan(shards, None, sum(s.nbytes for s in shards), works[0].plan.max_shard_bytes)
    return PipelineResult(output, combined, f"diffusers pipeline {folder}", cast_to, dry_run,
                          components=components, copied=copied)


def _stale(output: str, works: list[_Work]) -> list[str]:
    """Checkpoint files already in the output's component folders with the naming we write."""
    stale = []
    for work in works:
        sub = os.path.join(output, work.name)
        if not os.path.isdir(sub):
            continue
        for filename in os.listdir(sub):
            if not filename.startswith(".") and _is_weight_file(filename) \
                    and naming_from_filename(filename) == work.plan.naming:
                stale.append(f"{work.name}/{filename}")
    return stale


def _write(folder: str, output: str, works: list[_Work], copied: list[str], *, overwrite: bool,
           metadata: dict[str, str] | None, progress: ProgressCallback | None, total_bytes: int) -> None:
    tick = ByteCounter(total_bytes, progress)
    in_place = os.path.abspath(folder) == os.path.abspath(output)
    with OutputTransaction(output, overwrite=overwrite, stale=_stale(output, works)) as tx:
        for rel in copied:
            if not in_place:
                shutil.copyfile(os.path.join(folder, rel), tx.path_for(rel))
        for work in works:
            _write_component(tx, work, metadata=metadata, tick=tick)
        tx.commit(last=None)


def _write_component(tx: OutputTransaction, work: _Work, *, metadata: dict[str, str] | None,
                     tick: Callable[[int], None]) -> None:
    by_name = {p.out.name: p for p in work.placements}
    shard_metadata = {"format": "pt", **work.source.metadata(), **(metadata or {}), **work.source.aliases()}
    for shard in work.plan.shards:
        write_safetensors(tx.path_for(f"{work.name}/{shard.filename}"), [by_name[n] for n in shard.names],
                          work.source, metadata=shard_metadata, progress=tick)
    if work.plan.index_filename:
        tx.write_bytes(f"{work.name}/{work.plan.index_filename}",
                       dump_index(work.plan.weight_map(), total_size_bytes=work.plan.total_bytes))
