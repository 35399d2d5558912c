"""The public loading functions: ``shardkit.open``, ``load_model``, ``load_pipeline``, ``plan_device_map``,
``estimate_memory``..., each reached through the application layer.

``plan_device_map`` and ``estimate_memory`` take a remote checkpoint (``hf://ORG/REPO[@REVISION][/SUBFOLDER]``,
``s3://BUCKET/PREFIX``) as ``shardkit.fit`` and ``plan_model`` do: read from a header-only
mirror (headers, indexes and configs; no tensor data), removed after. ``shardkit.open``,
``load_model`` and ``load_pipeline`` read a remote checkpoint where it lives: its headers from the
mirror, its tensor bytes by parallel ranged reads straight into the tensors
(:func:`shardkit.api.stores.store_checkpoint`); a local path goes straight to the loading stage.
``load_pipeline`` is the composite of
loading and the auto-fit planner, so it lives here rather than in either stage.
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from ..distributed.rank_load import load_into
from ..fitting.estimate import DEFAULT_TOKENS
from ..loading.load import load_model as load_local
from ..loading.opening import open_checkpoint as open_local
from ..loading.tensor_parallel import SliceRule, TensorParallelPlan
from ..loading.tensor_parallel import rules_for as tensor_parallel_rules
from ..reading.prefetch import READ_AHEAD_BYTES
from ..reading.residency import ReadMode
from ..runtime.casting import apply_layerwise_casting
from ..runtime.offload import apply_offload
from ..sources import open_source
from .sources import is_remote

if TYPE_CHECKING:
    import torch
    from diffusers import DiffusionPipeline

    from ..devices import DeviceMap, DeviceMapStrategy, MaxMemory
    from ..fitting.autofit import FitPlan
    from ..fitting.estimate import MemoryEstimate
    from ..loading.device_map import DevicePlan
    from ..loading.lazy import LazyCheckpoint
    from ..loading.skeleton import ConfigSpec, ModelSpec
    from ..runtime.apply import LayerwiseCasting
    from ..sources.ranged import RangedCheckpoint

__all__ = ["SliceRule", "TensorParallelPlan", "apply_layerwise_casting", "apply_offload", "estimate_memory", "load_into",
           "load_model", "load_pipeline", "open", "open_source", "plan_device_map", "tensor_parallel_rules"]


def open(path: str | os.PathLike[str] | RangedCheckpoint, *, variant: str | None = None,  # noqa: A001
         read: ReadMode = "auto", read_ahead_bytes: int = READ_AHEAD_BYTES, token: str | None = None) -> LazyCheckpoint:
    """:func:`shardkit.loading.opening.open_checkpoint`, for a remote checkpoint (``s3://BUCKET/PREFIX``, ``hf://ORG/REPO``) too.

    A remote checkpoint's headers, index and configs are fetched into a header-only mirror
    (every header validated here), and each tensor's bytes are read by parallel ranged GETs
    straight into its memory when it is touched (``read`` does not apply); ``close()`` removes the
    mirror and closes the connections. ``token`` is a Hub token for ``hf://`` (default ``HF_TOKEN``
    or the stored login). Every other argument is as for the local function.

    with shardkit.open("s3://models/sd15/unet") as ckpt:
        state = ckpt.to_state_dict()
    """
    if not is_remote(path):
        return open_local(path, variant=variant, read=read, read_ahead_bytes=read_ahead_bytes)
    _refuse_gguf(path)
    from .stores import store_checkpoint

    with contextlib.ExitStack() as stack:
        ranged = stack.enter_context(store_checkpoint(path, token=token))
        checkpoint = open_local(ranged, variant=variant, read=read, read_ahead_bytes=read_ahead_bytes)
        try:
            _ = checkpoint.metadata  # every shard opened now: errors name the URL, not the mirror
        except BaseException:
            checkpoint.close()
            raise
        # on close(), or when a checkpoint never closed is collected: the mirror never outlives it
        checkpoint.close_after(weakref.finalize(checkpoint, stack.pop_all().close))
    return checkpoint


def load_model(model: ModelSpec, checkpoint: str | os.PathLike[str] | LazyCheckpoint | RangedCheckpoint, *,
               config: ConfigSpec | None = None, device_map: DeviceMap | None = None,
               max_memory: MaxMemory | None = None, offload_folder: str | os.PathLike[str] | None = None,
               dtype: str | torch.dtype | None = None, no_split_module_classes: list[str] | None = None,
               strict: bool = True, offload: str | None = None, offload_options: dict[str, object] | None = None,
               layerwise_casting: LayerwiseCasting | None = None, read: ReadMode = "auto",
               token: str | None = None) -> torch.nn.Module:
    """:func:`shardkit.loading.load.load_model`, from a remote checkpoint (``s3://BUCKET/PREFIX``, ``hf://ORG/REPO``) too.

    A remote checkpoint is read as :func:`open` reads it (tensor bytes by parallel ranged GETs,
    each fetched once, no local copy); its ``config.json`` is the default ``config``; tensors the
    device map sends to disk are written to ``offload_folder``. Every argument is as for the local function.

    unet = shardkit.load_model("diffusers:UNet2DConditionModel", "s3://models/sd15/unet", dtype="fp16")
    """
    load = functools.partial(load_local, config=config, device_map=device_map, max_memory=max_memory,
                             offload_folder=offload_folder, dtype=dtype,
                             no_split_module_classes=no_split_module_classes, strict=strict, offload=offload,
                             offload_options=offload_options, layerwise_casting=layerwise_casting, read=read)
    if not is_remote(checkpoint):
        return load(model, checkpoint)
    _refuse_gguf(checkpoint)
    from .stores import store_checkpoint

    with store_checkpoint(checkpoint, token=token) as ranged:
        return load(model, ranged)


def _refuse_gguf(path: str) -> None:
    """A GGUF in a store is refused as a local one is (these read safetensors), naming it, before any request."""
    if path.endswith(".gguf"):
        from ..errors import InvalidInputError

        raise InvalidInputError(f"{path}: not a safetensors checkpoint (a GGUF file); convert it first, e.g. "
                                f"shardkit.convert({path!r}, 'OUT/', dtype='bf16'), which reads it by range")


def plan_device_map(model: ModelSpec, *, config: ConfigSpec | None = None,
                    checkpoint: str | os.PathLike[str] | LazyCheckpoint | None = None, max_memory: MaxMemory,
                    dtype: str | torch.dtype | None = None, device_map: DeviceMapStrategy | str = "auto",
                    no_split_module_classes: list[str] | None = None, strict: bool = True,
                    token: str | None = None) -> DevicePlan:
    """:func:`shardkit.loading.device_map.plan_device_map`, for an ``hf://`` checkpoint too (headers only).

    ``token`` is the Hub token for an ``hf://`` checkpoint; every other argument is as for the local function.

    shardkit.plan_device_map("diffusers:UNet2DConditionModel", checkpoint="hf://org/sd15/unet",
                             max_memory={0: "4GB", "cpu": "16GB"})
    """
    from ..loading.device_map import plan_device_map as plan_local
    from .sources import headers

    if not is_remote(checkpoint):
        return plan_local(model, config=config, checkpoint=checkpoint, max_memory=max_memory, dtype=dtype,
                          device_map=device_map, no_split_module_classes=no_split_module_classes, strict=strict)
    with headers(checkpoint, token=token) as local:
        if config is None and os.path.isfile(os.path.join(local, "config.json")):
            config = os.path.join(local, "config.json")
        return plan_local(model, config=config, checkpoint=local, max_memory=max_memory, dtype=dtype,
                          device_map=device_map, no_split_module_classes=no_split_module_classes, strict=strict)


def estimate_memory(skeleton: torch.nn.Module | Mapping[str, torch.nn.Module] | DiffusionPipeline, *,
                    gpu_bytes: int | str | None = None, dtype: str | torch.dtype | None = None,
                    checkpoint: str | os.PathLike[str] | None = None, activation_bytes: int | None = None,
                    tokens: int = DEFAULT_TOKENS, compute_dtype: str | torch.dtype | None = None,
                    cast_components: Sequence[str] | None = None, token: str | None = None) -> MemoryEstimate:
    """:func:`shardkit.fitting.estimate.estimate_memory`, with an ``hf://`` checkpoint too (headers only).

    shardkit.estimate_memory(unet_skeleton, gpu_bytes="8GB", checkpoint="hf://org/sd15/unet")
    """
    from ..fitting.estimate import estimate_memory as estimate_local
    from .sources import headers

    with headers(checkpoint, token=token) if checkpoint is not None else contextlib.nullcontext() as local:
        return estimate_local(skeleton, gpu_bytes=gpu_bytes, dtype=dtype, checkpoint=local,
                              activation_bytes=activation_bytes, tokens=tokens, compute_dtype=compute_dtype,
                              cast_components=cast_components)


def load_pipeline(
    path: str | os.PathLike[str],
    *,
    device_map: str | None = None,
    max_memory: MaxMemory | None = None,
    dtype: str | torch.dtype | None = None,
    offload: str | None = None,
    offload_options: Mapping[str, Any] | None = None,
    layerwise_casting: LayerwiseCasting | None = None,
    fit: Literal["auto"] | FitPlan | None = None,
    variant: str | None = None,
    switches: Mapping[str, Any] | list[str] | None = None,
    read: ReadMode = "auto",
) -> DiffusionPipeline:
    """Load the pipeline in ``path`` and apply placement, casting and offload options.

    Args:
        path: a diffusers pipeline folder (sharded by shardkit or saved by diffusers), or
            ``s3://BUCKET/PREFIX`` holding one: each component is loaded from its subfolder by
            parallel ranged GETs (no local copy); configs, tokenizers and schedulers are fetched whole.
        device_map: ``"balanced"`` (whole components spread over the GPUs in ``max_memory``),
            ``"cuda"`` or ``"cpu"``.
        max_memory: ``{0: "16GB", 1: "16GB"}`` (sizes as strings or ints; keys as
            :func:`shardkit.devices.parse_device` accepts them).
        dtype: ``"bf16"``, ``torch.float16``...
        offload, offload_options: see :func:`shardkit.apply_offload`.
        layerwise_casting: ``("float8_e4m3fn", "bfloat16")`` or a dict of
            :func:`shardkit.apply_layerwise_casting` keywords (the pipeline's denoiser by default).
        fit: ``"auto"`` (or a plan from :func:`shardkit.fit`) chooses placement, offload, casting
            and switches for ``max_memory`` itself (:func:`shardkit.fitting.pipeline.load_fitted`).
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
    from ..errors import InvalidInputError

    if is_remote(path):
        if fit is not None:
            raise InvalidInputError(f"{path}: fit= does not apply to a pipeline in a bucket yet; plan it with "
                                    "shardkit.fit(path, max_memory=...) and pass device_map/offload")
        from .stores import store_checkpoint

        with store_checkpoint(path, side_files=True) as ranged:  # configs, tokenizers, schedulers whole
            return load_pipeline(ranged, device_map=device_map, max_memory=max_memory, dtype=dtype,
                                 offload=offload, offload_options=offload_options, layerwise_casting=layerwise_casting,
                                 variant=variant, switches=switches, read=read)
    if fit is not None:
        from ..fitting.pipeline import load_fitted

        if device_map is not None or offload is not None or offload_options or layerwise_casting is not None:
            raise InvalidInputError("fit= chooses device_map/offload/layerwise_casting itself; pass fit or those")
        fitted: DiffusionPipeline = load_fitted(os.fspath(path), fit, max_memory=max_memory, dtype=dtype, variant=variant)
        return fitted
    from ..loading.pipeline import load_pipeline_folder
    from ..runtime.apply import RuntimeSetup

    runtime = RuntimeSetup(switches=switches, layerwise_casting=layerwise_casting, offload=offload,
                           offload_options=dict(offload_options or {}))
    pipe: DiffusionPipeline = load_pipeline_folder(path, device_map=device_map, max_memory=max_memory, dtype=dtype,
                                                   variant=variant, runtime=runtime, read=read)
    return pipe
