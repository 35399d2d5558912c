"""A plan on a Ray cluster (``pip install shardkit[ray]``): each task left a ``ray.remote`` call, finalize on the driver.

The plan travels to the workers as its bytes and is checked there like any plan file; each worker
writes its shard into the work folder beside the output, so the output folder must be on a
filesystem every node sees (one machine, NFS, Lustre), or in an ``s3://`` prefix. A task Ray retries after a lost worker is
redone or skipped like any task; the output is byte-identical to a single process.
"""

from __future__ import annotations

from .plan_file import ConversionPlan, dump_plan, parse_plan
from .plan_run import done_tasks, finalize, run_tasks
from .plan_source import PlanRun, SourceOpener, local_source

__all__ = ["run_on_ray"]

TASK_TIMEOUT_S = 24 * 3600.0  # one shard of a few GB takes minutes; a hung cluster must not hang the driver forever


def _run_one(plan_bytes: bytes, index: int, opener: SourceOpener) -> list[int]:
    """One task, on a Ray worker: the tasks it wrote (none when another worker already had)."""
    return run_tasks(parse_plan(plan_bytes, path="plan sent by the Ray driver"), [index], opener=opener).written


def run_on_ray(plan: ConversionPlan, *, num_cpus: float = 1.0, max_retries: int = 3,
               timeout_s: float = TASK_TIMEOUT_S, opener: SourceOpener = local_source) -> PlanRun:
    """Run every task of ``plan`` that is not done as a Ray task, then publish from the driver.

    Uses the Ray cluster this process is connected to (``ray.init(...)``), or starts a local one.

    Args:
        plan: the plan.
        num_cpus: CPUs Ray reserves for each task (a shard write is one thread of copying or casting).
        max_retries: how often Ray retries a task whose worker died.
        timeout_s: how long the driver waits for all tasks.
        opener: opens the plan's source on each worker and the driver (a module-level function:
            Ray sends it by name), see :mod:`.plan_source`.

    ray.init(address="auto"); run_on_ray(read_plan("plan.json"))
    """
    import ray

    done = done_tasks(plan)
    pending = [i for i in range(len(plan.tasks)) if i not in done]
    remote = ray.remote(num_cpus=num_cpus, max_retries=max_retries)(_run_one)
    data = ray.put(dump_plan(plan))
    futures = [remote.remote(data, i, opener) for i in pending]
    try:
        written = sorted(i for wrote in ray.get(futures, timeout=timeout_s) for i in wrote)
    except BaseException:
        for future in futures:
            ray.cancel(future, force=True)
        raise
    run = PlanRun(plan.plan_id, plan.spec.output, written, [i for i in range(len(plan.tasks)) if i not in pending])
    run.published = finalize(plan, opener=opener).published
    return run
