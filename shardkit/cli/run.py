"""``shardkit run``, and the ``--write-plan``/``--resume`` of ``split`` and ``convert``."""

from __future__ import annotations

import ctypes
import dataclasses
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, TypeVar

import click

from ..api.options import WriteOptions
from ..api.plans import Command, Engine, PlanTo
from .common import byte_progress, echo_json

if TYPE_CHECKING:
    from ..api.plans import PlanRun

EPILOG = """\b
Examples:
  shardkit convert ckpt/ out/ --dtype bf16 --max-shard-size 5GB --write-plan plan.json
  shardkit run plan.json                       # every task left, then publish (one process)
  shardkit run plan.json --task 3              # one task (any worker, any order, rerun-safe)
  shardkit run plan.json --finalize            # publish, once every task is done
  SLURM_ARRAY_TASK_ID=3 shardkit run plan.json # a Slurm array task: sbatch --array=0-N
  torchrun --nproc-per-node 2 -m shardkit run plan.json   # each rank every 2nd task; rank 0 publishes
  shardkit run plan.json --engine ray          # Ray tasks (pip install shardkit[ray]); publish here
  shardkit convert ckpt/ out/ --dtype bf16 --resume       # killed? the same line continues it
  shardkit convert s3://b/ckpt s3://b/out --dtype bf16 --write-plan plan.json   # each task its own upload
  shardkit convert base/ merged/ --lora adapter/ --dtype bf16 --write-plan plan.json   # a LoRA merge
  shardkit convert llama-hf/ llama.gguf --to gguf --quantize q8_0 --max-shard-size 2GB --write-plan plan.json

\b
A plan (--write-plan) lists one task per output shard (the source byte ranges it reads, its casts,
its name and exact size) and a finalize (index, manifest, configs); it carries the source files'
sizes and mtimes (an s3:// object's size and ETag), so a task refuses a source that changed. A task writes its shard into
.OUTPUT.shardkit-plan-ID beside OUTPUT and records it done: a done task is skipped, a killed
one redone. Finalize checks every shard (size, header crc32) and publishes, index last; the output
is byte-identical to a single-process convert. `shardkit recover OUTPUT` (an existing folder)
removes an abandoned plan's work folder. Into s3://BUCKET/PREFIX each task uploads its shard as its
own multipart upload and records it done under PREFIX/.shardkit-plan-ID/; finalize puts the index
last; `shardkit recover s3://BUCKET/PREFIX` removes an abandoned plan. See docs/plans.md.
"""

F = TypeVar("F", bound=Callable[..., object])

M_MMAP_THRESHOLD = -3            # glibc's mallopt parameter
WORKER_MMAP_THRESHOLD_BYTES = 1 << 20


def map_large_blocks() -> None:
    """In a plan worker (this command's own process): allocations of 1 MiB and more are mapped and given
    back when freed, as ``MALLOC_MMAP_THRESHOLD_=1048576`` does. glibc otherwise raises the threshold each time
    a large block is freed and keeps later ones in heaps it does not return: a local fp8 task peaked at 460 MB
    without this and 325 MB with it, an S3 → S3 cast task at 646–668 against 530–546 MB (docs/plans.md). A
    threshold the user set is kept; where the C library is not glibc, nothing changes."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mallopt(M_MMAP_THRESHOLD, WORKER_MMAP_THRESHOLD_BYTES)


def plan_options(f: F) -> F:
    """``--write-plan`` and ``--resume``, for ``split`` and ``convert``."""
    f = click.option("--resume", is_flag=True,
                     help="Run as a plan a kill does not lose: the same command again continues from the finished "
                          "shards (output byte-identical, at most one shard redone).")(f)
    return click.option("--write-plan", "plan_file", type=click.Path(dir_okay=False, path_type=str),
                        metavar="PLAN.json",
                        help="Write the job as a plan (one task per shard, then finalize) instead of running it; "
                             "run it with `shardkit run PLAN.json`. With --dry-run: print it only.")(f)


def run_as_plan(command: Command, source: str, output: str, *, plan_file: str | None, resume: bool, as_json: bool,
                quiet: bool, options: WriteOptions, key: str | None, include: Iterable[str] = (),
                exclude: Iterable[str] = (), strip_prefix: str | None = None, add_prefix: str | None = None,
                rename: Iterable[str] = (), lora: Iterable[str] = (), lora_scale: float = 1.0,
                to: PlanTo | None = None) -> None:
    """``split``/``convert`` with ``--write-plan`` or ``--resume``."""
    from ..api.plans import plan_summary, write_plan
    from ..api.plans import resume as resume_api

    if plan_file is not None and resume:
        raise click.UsageError("--write-plan writes the plan, --resume runs it: give one")
    if resume:
        map_large_blocks()
        with byte_progress(command, enabled=not (quiet or as_json)) as progress:
            run = resume_api(source, output, command=command, key=key, include=include, exclude=exclude,
                             strip_prefix=strip_prefix, add_prefix=add_prefix, rename=rename, lora=lora,
                             lora_scale=lora_scale, to=to,
                             options=dataclasses.replace(options, dry_run=False, progress=progress))
        from ..api.jobs import is_rank_zero

        _report(run, as_json=as_json and is_rank_zero(), quiet=quiet or not is_rank_zero())  # torchrun: rank 0
        return
    plan = write_plan(source, output, plan_file, command=command, options=options, key=key, include=include,
                      exclude=exclude, strip_prefix=strip_prefix, add_prefix=add_prefix, rename=rename, lora=lora,
                      lora_scale=lora_scale, to=to)
    if as_json:
        echo_json({"plan": plan_file, "plan_id": plan.plan_id, "tasks": len(plan.tasks), "written": not options.dry_run})
    elif not quiet:
        for line in plan_summary(plan):
            click.echo(line)
        if plan_file and not options.dry_run:
            click.echo(f"  run: shardkit run {plan_file}   (or --task N per worker, then --finalize)")


def _report(run: PlanRun, *, as_json: bool, quiet: bool) -> None:
    if as_json:
        echo_json({"plan_id": run.plan_id, "output": run.output, "written": run.written, "skipped": run.skipped,
                   "published": run.published})
    elif not quiet:
        done = f"wrote {len(run.written)} shard task(s)" + (f", {len(run.skipped)} already done" if run.skipped else "")
        click.echo(done + (f"; published {run.output}" if run.published else ""))


@click.command(epilog=EPILOG, short_help="Run a plan's tasks (one, this worker's share, or all) and publish.")
@click.argument("plan", type=click.Path(exists=True, dir_okay=False, path_type=str))
@click.option("--task", "task", type=click.IntRange(min=0), multiple=True, metavar="N",
              help="Run task N only (repeatable). Default: SLURM_ARRAY_TASK_ID, torchrun's RANK/WORLD_SIZE "
                   "share, or every task left, then publish.")
@click.option("--finalize", is_flag=True, help="Publish only: check every shard, write index and manifest.")
@click.option("--engine", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="ray: every task left as a Ray task (on RAY_ADDRESS's cluster, or a local one), publish here.")
@click.option("--dry-run", is_flag=True, help="Print the plan's summary; run nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print what ran as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="Print nothing; the exit code tells.")
def run(plan: str, task: tuple[int, ...], finalize: bool, engine: Engine, dry_run: bool, as_json: bool,
        quiet: bool) -> None:
    """Run the tasks of PLAN (written by `convert`/`split --write-plan`), then publish its output.

    Any number of workers may run tasks at once, in any order, any number of times: a done task is
    skipped, a killed one redone; the output is byte-identical whichever engine ran it.
    """
    from ..api.jobs import is_rank_zero
    from ..api.plans import plan_summary, run_plan

    if dry_run:
        for line in plan_summary(plan):
            click.echo(line)
        return
    map_large_blocks()
    with byte_progress("run", enabled=not (quiet or as_json)) as progress:
        done = run_plan(plan, task=list(task) or None, finalize=finalize, engine=engine, progress=progress)
    _report(done, as_json=as_json and is_rank_zero(), quiet=quiet or not is_rank_zero())


COMMANDS = [run]
