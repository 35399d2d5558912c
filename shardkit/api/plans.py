"""Conversions as plans: write one (``write_plan``), run it anywhere (``run_plan``), resume a killed one.

The CLI's ``split``/``convert --write-plan`` and ``--resume`` and ``shardkit run`` call these, as
Python callers do (see docs/plans.md). The plan is made by :mod:`shardkit.distributed.plan_file`
from the very job a single process runs, and its tasks run by :mod:`shardkit.distributed.plan_run`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Literal

from ..errors import InvalidInputError, Option
from ..units import ProgressCallback
from .options import WriteKeywords, WriteOptions

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ..distributed.plan_file import ConversionPlan as ConversionPlan
    from ..distributed.plan_source import OpenedSource
    from ..distributed.plan_source import PlanRun as PlanRun

__all__ = ["Command", "Engine", "PlanTo", "open_plan_source", "plan_summary", "read_plan", "resume", "run_plan", "write_plan"]

Command = Literal["split", "convert"]
PlanTo = Literal["gguf"]
Engine = Literal["local", "ray"]
MAX_ENV_TASK = 10**9


def write_plan(source: str | os.PathLike[str], output: str | os.PathLike[str], plan: str | os.PathLike[str] | None = None,
               *, command: Command = "convert", options: WriteOptions | None = None, key: str | None = None,
               include: Iterable[str] = (), exclude: Iterable[str] = (), strip_prefix: str | None = None,
               add_prefix: str | None = None, rename: Iterable[str] | Mapping[str, str] = (),
               lora: str | os.PathLike[str] | Iterable[str | os.PathLike[str]] = (), lora_scale: float = 1.0,
               to: PlanTo | None = None, **shorthands: Unpack[WriteKeywords]) -> ConversionPlan:
    """Plan a split or convert of ``source`` into ``output`` and write the plan to ``plan`` (a JSON file).

    Reads headers only. The same source and options give the same bytes. With ``dry_run=True``
    (or ``plan=None``) nothing is written: the plan is returned (``plan_summary`` prints it).

    Args:
        source: a local checkpoint (safetensors file, index or folder, pickle, DCP folder), or an
            ``s3://BUCKET/PREFIX`` of safetensors (each object known by its size and ETag).
        output: the local folder or ``s3://BUCKET/PREFIX`` the plan publishes (in a store, each task
            uploads its shard as its own multipart upload; finalize puts the index last).
        plan: where to write the plan file.
        command: ``"split"`` or ``"convert"`` (recorded in the plan; both run the same job).
        options, key, include, exclude, strip_prefix, add_prefix, rename, **shorthands: as for
            :func:`shardkit.convert`.
        lora, lora_scale: local LoRA adapters merged into every task's weights, as :func:`shardkit.convert`
            merges them (a ``convert`` plan; the adapters' files are part of the source's identity).
        to: ``"gguf"``: ``output`` is a local ``.gguf`` path and the plan writes what ``shardkit.convert(...,
            to='gguf')`` writes (one task per file: the one file, or each gguf-split part with ``max_shard_size``;
            ``quantize`` sets the ggml type).

    Returns:
        The :class:`~shardkit.distributed.plan_file.ConversionPlan`.

    plan = shardkit.write_plan("ckpt/", "out/", "plan.json", max_shard_size="5GB", dtype="bf16")
    """
    from ..distributed.plan_file import dump_plan
    from ..distributed.plan_run import make_plan
    from ..sharding.convert import build_keymap

    built = WriteOptions.build(options, shorthands, where="write_plan()")
    if command not in ("split", "convert"):
        raise InvalidInputError(f"command={command!r}: a plan is of a 'split' or a 'convert'")
    if to is not None and command != "convert":
        raise InvalidInputError(Option("to", to), ": write the plan with command='convert'")
    keymap = build_keymap(include=include, exclude=exclude, strip_prefix=strip_prefix, add_prefix=add_prefix,
                          rename=dict(rename) if isinstance(rename, Mapping) else rename)
    made = make_plan(command, os.fspath(source), os.fspath(output), options=built, key=key, keymap=keymap,
                     opener=open_plan_source, lora=_adapters(lora, command), lora_scale=lora_scale, to=to)
    if plan is not None and not built.dry_run:
        from ..atomic.commit import file_transaction

        plan_path = os.path.abspath(os.fspath(plan))
        with file_transaction(plan_path, overwrite=True) as tmp:
            _write_new(tmp, dump_plan(made), name=plan_path)
    return made


def _adapters(lora: str | os.PathLike[str] | Iterable[str | os.PathLike[str]], command: Command) -> list[str]:
    """The local adapters of a plan; a remote one is refused (a worker reads the adapter where the plan says)."""
    from ..stores import url_scheme

    adapters = [os.fspath(lora)] if isinstance(lora, (str, os.PathLike)) else [os.fspath(a) for a in lora]
    if adapters and command != "convert":
        raise InvalidInputError(Option("lora"), " merges in a convert; write the plan with command='convert'")
    for adapter in adapters:
        if url_scheme(adapter) is not None:
            raise InvalidInputError(Option("lora", adapter), ": a plan merges local adapters; download it first "
                                    "(shardkit.convert merges a remote adapter in one process)")
        if not os.path.exists(adapter):
            raise InvalidInputError(Option("lora", adapter), ": no such adapter file or folder")
    return adapters


@contextlib.contextmanager
def open_plan_source(source: str) -> Iterator[OpenedSource]:
    """A plan's source as a worker opens it (:class:`~shardkit.distributed.plan_source.OpenedSource`): a local
    path as it is; an ``s3://`` prefix as its header-only mirror read by range, its objects named by URL and
    known by the size and ETag a listing gives (taken after the mirror's own listing, whose ETags every
    ranged read is pinned to: an object replaced since fails the read instead of mixing versions)."""
    from ..distributed.plan_file import SourceFile
    from ..distributed.plan_source import OpenedSource, local_source
    from ..sources.ranged import RangedCheckpoint
    from ..stores import open_store, url_scheme
    from .sources import opened

    if url_scheme(source) is None:
        with local_source(source) as local:
            yield local
        return
    with opened(source) as checkpoint:
        if not isinstance(checkpoint, RangedCheckpoint):
            raise InvalidInputError(f"{source}: a plan reads a local checkpoint or an s3:// prefix; download it first")
        with open_store(source, check_bucket=False) as store:
            listed = {str(store.url.child(o.name)): o for o in store.list_objects()}
            url = store.url
        root = checkpoint.root

        def name_of(path: str) -> str:
            return str(url.child(os.path.relpath(path, root).replace(os.sep, "/")))

        def identity(names: Sequence[str]) -> tuple[SourceFile, ...]:
            return tuple(SourceFile(n, listed[n].size_bytes, 0, listed[n].etag) for n in sorted(set(names)))

        yield OpenedSource(checkpoint, name_of, identity)


def _write_new(path: str, data: bytes, *, name: str) -> None:
    """Write ``data`` to the new file ``path`` (the temporary of the plan file ``name``) and fsync it.

    Raises:
        ShardkitWriteError: a write failed or wrote nothing, naming ``name``.
    """
    from ..formats.links import write_fd
    from ..sharding.flush import write_error

    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            write_fd(fd, data, path=path)  # bookkeeping, not output: no fault points
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise write_error(name, e) from e


def read_plan(plan: str | os.PathLike[str] | ConversionPlan) -> ConversionPlan:
    """A plan file, checked (:func:`~shardkit.distributed.plan_file.parse_plan`: untrusted input)."""
    from ..distributed.plan_file import MAX_PLAN_BYTES, ConversionPlan, parse_plan

    if isinstance(plan, ConversionPlan):
        return plan
    from ..formats.links import read_regular

    path = os.fspath(plan)
    return parse_plan(read_regular(path, where=path, max_bytes=MAX_PLAN_BYTES), path=path)


def plan_summary(plan: str | os.PathLike[str] | ConversionPlan) -> list[str]:
    """The human summary of a plan (what ``--dry-run`` prints), one line each."""
    from ..distributed.plan_file import summary

    return summary(read_plan(plan))


def run_plan(plan: str | os.PathLike[str] | ConversionPlan, *, task: int | Sequence[int] | None = None,
             finalize: bool = False, engine: Engine = "local", progress: ProgressCallback | None = None) -> PlanRun:
    """Run a plan's tasks: one, all of them, or this worker's share; then (or only) publish.

    Which tasks, in order of precedence: ``finalize=True`` publishes only (every task must be done);
    ``task`` runs those tasks only; ``SLURM_ARRAY_TASK_ID`` in the environment runs that task only
    (a Slurm array; publish with a dependent ``finalize=True`` job); torchrun's ``RANK`` and
    ``WORLD_SIZE`` (above 1) run every ``WORLD_SIZE``-th task from ``RANK``, then rank 0 publishes
    once all ranks are done; otherwise every task that is not done, then publish. A done task is
    skipped, a half-written one redone, and a task refuses a source that changed since the plan.

    Args:
        plan: the plan file (or a plan from :func:`write_plan`).
        task: a task index, or several.
        finalize: publish only.
        engine: ``"local"`` (this process, or this worker's share as above) or ``"ray"``: every task
            left as a Ray task on the cluster this process is connected to (``ray.init``), then
            publish here (``pip install shardkit[ray]``; :mod:`shardkit.distributed.ray`).
        progress: called as ``progress(done_bytes, total_bytes)`` while shards are written.

    Returns:
        A :class:`~shardkit.distributed.plan_run.PlanRun`: the tasks written and skipped, and whether it published.

    shardkit.run_plan("plan.json")                 # everything left, then publish
    shardkit.run_plan("plan.json", task=3)         # one worker's task
    shardkit.run_plan("plan.json", finalize=True)  # once every task is done
    shardkit.run_plan("plan.json", engine="ray")   # every task left on a Ray cluster, then publish
    """
    from ..distributed import plan_run

    checked = read_plan(plan)
    if engine not in ("local", "ray"):
        raise InvalidInputError(Option("engine", engine), ": use 'local' or 'ray'")
    if engine == "ray":
        if task is not None or finalize:
            raise InvalidInputError(Option("engine", "ray"), " runs every task left and publishes; drop ",
                                    Option("task"), " and ", Option("finalize", True))
        from ..distributed.ray import run_on_ray

        return run_on_ray(checked, opener=open_plan_source)
    if finalize:
        if task is not None:
            raise InvalidInputError(Option("finalize", True), " publishes; give ", Option("task"), " in another call")
        return plan_run.finalize(checked, opener=open_plan_source)
    if task is not None:
        return plan_run.run_tasks(checked, [task] if isinstance(task, int) else list(task), progress=progress,
                                  opener=open_plan_source)
    array_task = os.environ.get("SLURM_ARRAY_TASK_ID", "").strip()
    if array_task:
        return plan_run.run_tasks(checked, [_env_index("SLURM_ARRAY_TASK_ID", array_task)], progress=progress,
                                  opener=open_plan_source)
    world = os.environ.get("WORLD_SIZE", "").strip()
    if world.isdigit() and int(world) > 1:
        return _run_ranks(checked, progress=progress)
    run = plan_run.run_tasks(checked, range(len(checked.tasks)), progress=progress, opener=open_plan_source)
    published = plan_run.finalize(checked, opener=open_plan_source)
    run.published = published.published
    return run


def _env_index(name: str, value: str) -> int:
    if not value.isdigit() or int(value) > MAX_ENV_TASK:
        raise InvalidInputError(f"{name}={value!r} is not a task index; give ", Option("task"))
    return int(value)


def _run_ranks(plan: ConversionPlan, *, progress: ProgressCallback | None) -> PlanRun:
    """Under torchrun: this rank's tasks (every WORLD_SIZE-th), a barrier, then rank 0 publishes."""
    import datetime

    import torch.distributed as dist

    from ..distributed import plan_run
    from ..distributed.group import group_from_env

    with group_from_env() as distributed:
        rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        run = plan_run.run_tasks(plan, range(rank, len(plan.tasks), world), progress=progress, opener=open_plan_source)
        if distributed:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=3600))
        if rank == 0:
            run.published = plan_run.finalize(plan, opener=open_plan_source).published
    return run


def resume(source: str | os.PathLike[str], output: str | os.PathLike[str], *, command: Command = "convert",
           options: WriteOptions | None = None, key: str | None = None, include: Iterable[str] = (),
           exclude: Iterable[str] = (), strip_prefix: str | None = None, add_prefix: str | None = None,
           rename: Iterable[str] | Mapping[str, str] = (), lora: str | os.PathLike[str] | Iterable[str | os.PathLike[str]] = (),
           lora_scale: float = 1.0, to: PlanTo | None = None, **shorthands: Unpack[WriteKeywords]) -> PlanRun:
    """A split or convert that a kill does not lose: run as its plan, continued from the shards a killed
    run finished (the same arguments find the same plan). Same arguments as :func:`write_plan`.
    Under torchrun every rank plans the same job and runs every ``WORLD_SIZE``-th task; rank 0 publishes.

    shardkit.api.plans.resume("ckpt/", "out/", max_shard_size="5GB")   # killed? call it again
    """
    built = WriteOptions.build(options, shorthands, where="resume()")
    plan = write_plan(source, output, None, command=command, options=built, key=key, include=include,
                      exclude=exclude, strip_prefix=strip_prefix, add_prefix=add_prefix, rename=rename, lora=lora,
                      lora_scale=lora_scale, to=to)
    from ..distributed import plan_run

    world = os.environ.get("WORLD_SIZE", "").strip()
    if world.isdigit() and int(world) > 1:  # under torchrun: each rank its share of the same plan
        return _run_ranks(plan, progress=built.progress)
    run = plan_run.run_tasks(plan, range(len(plan.tasks)), progress=built.progress, opener=open_plan_source)
    run.published = plan_run.finalize(plan, opener=open_plan_source).published
    return run
