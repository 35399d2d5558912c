"""A plan's source as a worker opens it: the checkpoint the writers read, what each of its files is called in
the plan, and each one's identity now (a task refuses a source that is not the one planned).

A local source is the path itself, its files known by size and mtime. Any other (an ``s3://`` prefix)
is opened by a :data:`SourceOpener` the application layer hands in (:mod:`shardkit.api.plans`: a
header-only mirror read by range, its objects known by size and ETag, named by URL), so the same
plan names the same files on every worker, whatever temporary folder its mirror is in.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

from ..errors import InvalidInputError
from ..sharding.job import ShardJob, SideFile, open_settled, plan_job, side_files
from ..sources.base import Source
from ..sources.keymap import KeyMapSource
from .plan_file import ConversionPlan, Identity, PlanSpec, same_path, shard_tasks, source_identity

__all__ = ["OpenedSource", "PlanRun", "SourceOpener", "adapter_files", "check_sources", "job_source", "local_source",
           "opened_job"]


@dataclass
class PlanRun:
    """What one call did: the tasks it wrote, those already done, and whether it published."""

    plan_id: str
    output: str
    written: list[int]
    skipped: list[int]
    published: bool = False


@dataclass(frozen=True)
class OpenedSource:
    """A plan's source, open: ``checkpoint`` for the readers, ``name_of`` (a file they open → its name in
    the plan), ``identity`` (plan names → each file's :class:`SourceFile` now; a missing one raises)."""

    checkpoint: str | os.PathLike[str]
    name_of: Callable[[str], str] = same_path
    identity: Identity = source_identity


SourceOpener = Callable[[str], AbstractContextManager[OpenedSource]]


@contextlib.contextmanager
def local_source(source: str) -> Iterator[OpenedSource]:
    """A local path: itself, its files named by path, known by size and mtime (one ``stat`` each)."""
    yield OpenedSource(source)


def check_sources(plan: ConversionPlan, opened: OpenedSource) -> None:
    """Refuse (one line) when a source file's size, mtime or ETag is not what the plan recorded."""
    adapters = set(adapter_files(plan.spec))
    try:
        now = {f.path: f for f in opened.identity([f.path for f in plan.sources if f.path not in adapters])}
        now.update((f.path, f) for f in source_identity(sorted(adapters)))
    except (OSError, KeyError) as e:
        raise InvalidInputError(f"{plan.spec.source}: a file of the plan's source is gone ({e}); "
                                "write the plan again from the source as it is now") from e
    for f in plan.sources:
        found = now[f.path]
        if (found.size_bytes, found.mtime_ns, found.etag) != (f.size_bytes, f.mtime_ns, f.etag):
            what = f"size {found.size_bytes}, planned {f.size_bytes}" if found.size_bytes != f.size_bytes \
                else f"ETag {found.etag!r}, planned {f.etag!r}" if f.etag else "modified"
            raise InvalidInputError(f"{f.path}: the source changed since the plan was written ({what}); nothing "
                                    "was written: write the plan again")



@contextlib.contextmanager
def opened_job(plan: ConversionPlan, opener: SourceOpener = local_source,
               ) -> Iterator[tuple[ShardJob, list[SideFile], OpenedSource]]:
    """The job the plan describes, planned again from its source: refused unless it is the same plan."""
    spec = plan.spec
    with opener(spec.source) as opened:
        check_sources(plan, opened)  # before a tensor byte is read
        with open_settled(opened.checkpoint, key=spec.key, dry_run=False, output=spec.output) as inner:
            job = plan_job(job_source(inner, spec), options=spec.options)
            if shard_tasks(job, spec.options, name_of=opened.name_of) != plan.tasks:
                raise InvalidInputError(f"{spec.source}: planned again, it does not give the plan's tasks (the source "
                                        "or shardkit changed); nothing was written: write the plan again")
            yield job, side_files(opened.checkpoint, spec.output), opened


def job_source(inner: Source, spec: PlanSpec) -> Source:
    """What the plan's job writes: the source opened, the LoRA adapters merged, the key map applied (as ``convert``)."""
    merged = inner
    if spec.lora:
        from ..sharding.lora import merged_view

        merged = merged_view(inner, spec.lora, scale=spec.lora_scale, options=spec.options)
    return merged if spec.keymap.is_identity() else KeyMapSource(merged, spec.keymap)


def adapter_files(spec: PlanSpec) -> list[str]:
    """The files of the plan's LoRA adapters (a file, or every file of an adapter folder): known by size and mtime."""
    files: list[str] = []
    for adapter in spec.lora:
        if os.path.isdir(adapter):
            files += sorted(os.path.join(adapter, n) for n in os.listdir(adapter)
                            if os.path.isfile(os.path.join(adapter, n)))
        else:
            files.append(adapter)
    return files
