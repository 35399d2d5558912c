"""``shardkit.load_pipeline``: load a diffusers pipeline folder, placed by hand or by the planner.

It lives in ``fit/`` because ``fit=`` needs the auto-fit planner; the loading itself is
:func:`shardkit.loading.pipeline.load_pipeline_folder`, and every runtime option goes through
:func:`shardkit.runtime.apply.apply_runtime`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

from ..devices import parse_max_memory
from ..errors import InvalidInputError
from ..loading.pipeline import check_gpus, load_pipeline_folder
from ..reading.residency import ReadMode
from ..runtime.apply import RuntimeSetup
from .autofit import FitPlan, apply_plan, fit

if TYPE_CHECKING:
    import torch
    from diffusers import DiffusionPipeline

    from ..devices import MaxMemory
    from ..runtime.apply import LayerwiseCasting


def load_pipeline(
    path: str | os.PathLike[str],
    *,
    device_map: str | None = None,
    max_memory: MaxMemory | None = None,
    dtype: str | torch.dtype | None = None,
    offload: str | None = None,
    offload_options: Mapping[str, object] | None = None,
    layerwise_casting: LayerwiseCasting | None = None,
    fit: Literal["auto"] | FitPlan | None = None,
    variant: str | None = None,
    switches: Mapping[str, object] | list[str] | None = None,
    read: ReadMode = "auto",
) -> DiffusionPipeline:
    """Load the pipeline in ``path`` and apply placement, casting and offload options.

    Args:
        path: a diffusers pipeline folder (sharded by shardkit or saved by diffusers).
        device_map: ``"balanced"`` (whole components spread over the GPUs in ``max_memory``),
            ``"cuda"`` or ``"cpu"``.
        max_memory: ``{0: "16GB", 1: "16GB"}`` (sizes as strings or ints; keys as
            :func:`shardkit.devices.parse_device` accepts them).
        dtype: ``"bf16"``, ``torch.float16``...
        offload, offload_options: see :func:`shardkit.apply_offload`.
        layerwise_casting: ``("float8_e4m3fn", "bfloat16")`` or a dict of
            :func:`shardkit.apply_layerwise_casting` keywords (the pipeline's denoiser by default).
        fit: ``"auto"`` (or a plan from :func:`shardkit.fit`) chooses placement, offload, casting
            and switches for ``max_memory`` itself.
        variant: the weights' variant (``"fp16"``).
        switches: memory/speed switches, e.g. ``{"vae_tiling": True, "attention_backend": "sdpa"}``.
        read: the read backend, as for :func:`shardkit.open` (``"auto"``, ``"mmap"``, ``"pread"``,
            ``"direct"``); see :func:`shardkit.loading.pipeline.load_pipeline_folder`.

    Returns:
        The ``DiffusionPipeline``, with ``shardkit_plan`` set when ``fit`` was given.

    pipe = load_pipeline("flux/", dtype="bf16", offload="group",
                         offload_options={"offload_type": "leaf_level", "use_stream": True},
                         layerwise_casting=("float8_e4m3fn", "bfloat16"))
    """
    if fit is not None:
        if device_map is not None or offload is not None or offload_options or layerwise_casting is not None:
            raise InvalidInputError("fit= chooses device_map/offload/layerwise_casting itself; pass fit or those")
        return load_fitted(os.fspath(path), fit, max_memory=max_memory, dtype=dtype, variant=variant)
    runtime = RuntimeSetup(switches=switches, layerwise_casting=layerwise_casting, offload=offload,
                           offload_options=dict(offload_options or {}))
    return load_pipeline_folder(path, device_map=device_map, max_memory=max_memory, dtype=dtype, variant=variant,
                                runtime=runtime, read=read)


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
    ``scripts/staged_multi_gpu.py`` (a pipeline object keeps every component loaded), so the
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
                                "run scripts/staged_multi_gpu.py or plan with exclude=['staged']")
    if setup["placement"] == "balanced":
        budgets: MaxMemory = {i: b for i, b in enumerate(plan.budget.gpu_bytes)}
        pipe = load_pipeline_folder(path, device_map="balanced", max_memory=budgets, dtype=dtype, variant=variant)
    else:
        pipe = load_pipeline_folder(path, dtype=dtype, variant=variant)
    return apply_plan(pipe, plan, device=plan.device or device)
