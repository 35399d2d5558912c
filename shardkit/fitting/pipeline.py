"""``load_pipeline(..., fit=...)``: plan a pipeline's setup with the auto-fit planner, load it, apply the plan.

The public ``shardkit.load_pipeline`` is the application layer's (:mod:`shardkit.api.loading`);
this is its planned half. The loading itself is
:func:`shardkit.loading.pipeline.load_pipeline_folder`, and every runtime option goes through
:func:`shardkit.runtime.apply.apply_runtime`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..devices import parse_max_memory
from ..errors import InvalidInputError, Option
from ..loading.pipeline import check_gpus, load_pipeline_folder
from .autofit import FitPlan, apply_plan, fit

if TYPE_CHECKING:
    import torch
    from diffusers import DiffusionPipeline

    from ..devices import MaxMemory


def load_fitted(path: str, fit_spec: object, *, max_memory: MaxMemory | None, dtype: str | torch.dtype | None = None,
                variant: str | None = None) -> DiffusionPipeline:
    """``load_pipeline(path, fit=...)``: plan (``"auto"``) or take a :class:`FitPlan`, load, apply.

    Args:
        path: the pipeline folder.
        fit_spec: ``"auto"`` or a :class:`FitPlan`.
        max_memory: the budget ``"auto"`` plans for.
        dtype, variant: as for :func:`load_pipeline`.

    Returns:
        The loaded pipeline with the plan applied and ``shardkit_plan`` set.

    A budget or plan naming GPUs this machine lacks is refused, as :func:`shardkit.load_model`
    refuses it (a plan made with ``device="cpu"`` runs on the CPU on purpose).
    ``fit="auto"`` plans for ``max_memory`` at the pipeline's default image size; pass a plan from
    :func:`fit` to choose height/width/batch. Staged multi-GPU plans are left to
    ``docs/examples/staged_multi_gpu.py`` (a pipeline object keeps every component loaded), so the
    automatic plan here never picks them.
    """
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(fit_spec, FitPlan):
        plan = fit_spec
        if plan.device is None or str(plan.device).startswith("cuda"):
            # A plan for GPUs never falls back to the CPU silently (plan with device="cpu" to mean it).
            check_gpus(list(range(len(plan.budget.gpu_bytes))), where="the plan")
    elif fit_spec == "auto":
        if not max_memory:
            raise InvalidInputError('fit="auto" needs max_memory, e.g. {0: "8GB", "cpu": "24GB"}')
        check_gpus(list(parse_max_memory(max_memory) or {}), where="max_memory")
        dtype_name = None if dtype is None else str(dtype).removeprefix("torch.")
        plan = fit(path, max_memory=max_memory, dtype=dtype_name, exclude=("staged",), device=device)
    else:
        raise InvalidInputError(f'fit must be "auto" or a plan from shardkit.fit(...), got {fit_spec!r}')
    setup = plan.setup()
    if setup["placement"] == "staged":
        raise InvalidInputError("a staged multi-GPU plan cannot be applied by load_pipeline; "
                                "run docs/examples/staged_multi_gpu.py or plan with ", Option("exclude", ["staged"]))
    if setup["placement"] == "balanced":
        budgets: MaxMemory = {i: b for i, b in enumerate(plan.budget.gpu_bytes)}
        pipe = load_pipeline_folder(path, device_map="balanced", max_memory=budgets, dtype=dtype, variant=variant)
    else:
        pipe = load_pipeline_folder(path, dtype=dtype, variant=variant)
    return apply_plan(pipe, plan, device=plan.device or device)
