"""Load a diffusers pipeline folder (sharded by shardkit or saved by diffusers) for inference.

A thin wrapper over ``DiffusionPipeline.from_pretrained``: sizes and device keys are parsed
here, component-level placement is diffusers' own (``device_map="balanced"`` puts whole
components on GPUs, ``pipe.hf_device_map`` shows where, ``pipe.reset_device_map()`` undoes it),
then the shardkit runtime options are applied — fp8 layerwise casting first, then the offload
strategy, the order diffusers documents for combining them.

>>> pipe = load_pipeline("sdxl-sharded/", device_map="balanced",
...                      max_memory={0: "16GB", 1: "16GB"})            # doctest: +SKIP
>>> pipe.hf_device_map                                                # doctest: +SKIP
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from .errors import InvalidInputError, ShardkitError, SourceNotFoundError

DEVICE_MAPS = ("balanced", "cpu", "cuda")


def load_pipeline(
    path: str | os.PathLike[str],
    *,
    device_map: str | None = None,
    max_memory: Mapping[Any, Any] | None = None,
    dtype: Any = None,
    offload: str | None = None,
    offload_options: Mapping[str, Any] | None = None,
    layerwise_casting: Any = None,
    fit: Any = None,
    variant: str | None = None,
    switches: Any = None,
) -> Any:
    """Load the pipeline in ``path`` and apply placement, casting and offload options.

    ``device_map``: ``"balanced"`` (whole components spread over the GPUs in ``max_memory``),
    ``"cuda"`` or ``"cpu"``. ``max_memory``: ``{0: "16GB", 1: "16GB"}`` (sizes as strings or
    ints). ``dtype``: ``"bf16"``, ``torch.float16``... ``offload``/``offload_options``: see
    :func:`shardkit.apply_offload`. ``layerwise_casting``: ``("float8_e4m3fn", "bfloat16")`` or a
    dict of :func:`shardkit.apply_layerwise_casting` keywords (the pipeline's denoiser by default).
    ``switches``: memory/speed switches, e.g. ``{"vae_tiling": True, "attention_backend": "sdpa"}``
    (see :mod:`shardkit.switches`). ``fit="auto"`` (or a plan from :func:`shardkit.fit`) chooses
    placement, offload, casting and switches for ``max_memory`` itself.

    >>> pipe = load_pipeline("flux/", dtype="bf16", offload="group",
    ...                      offload_options={"offload_type": "leaf_level", "use_stream": True},
    ...                      layerwise_casting=("float8_e4m3fn", "bfloat16"))    # doctest: +SKIP
    """
    if fit is not None:
        # fit chooses placement, casting, offload and switches itself (shardkit.autofit).
        if device_map is not None or offload is not None or offload_options or layerwise_casting is not None:
            raise InvalidInputError("fit= chooses device_map/offload/layerwise_casting itself; pass fit or those")
        from .autofit import load_fitted

        return load_fitted(os.fspath(path), fit, max_memory=max_memory, dtype=dtype, variant=variant)
    folder = _check_folder(path)
    _check_device_map(device_map, offload)
    kwargs: dict[str, Any] = {}
    if device_map is not None:
        kwargs["device_map"] = device_map
    if max_memory is not None:
        from .placement import parse_max_memory

        kwargs["max_memory"] = parse_max_memory(max_memory)
    if dtype is not None:
        from .torch_dtypes import resolve_torch_dtype

        kwargs["torch_dtype"] = resolve_torch_dtype(dtype)
    if variant is not None:
        kwargs["variant"] = variant
    pipe = _from_pretrained(folder, kwargs)
    if switches:
        from .switches import apply_switches  # VAE tiling/slicing, attention, channels_last, tf32...

        apply_switches(pipe, switches)
    _apply_runtime_options(pipe, offload, offload_options, layerwise_casting)
    return pipe


def _check_folder(path: str | os.PathLike[str]) -> str:
    folder = os.fspath(path)
    if not os.path.isdir(folder):
        raise SourceNotFoundError(f"pipeline folder {folder} does not exist")
    if not os.path.isfile(os.path.join(folder, "model_index.json")):
        raise SourceNotFoundError(
            f"{folder} has no model_index.json, so it is not a diffusers pipeline folder; "
            "load a single model with shardkit.load_model"
        )
    return folder


def _check_device_map(device_map: Any, offload: str | None) -> None:
    if device_map is None:
        return
    if not isinstance(device_map, str) or device_map not in DEVICE_MAPS:
        raise InvalidInputError(
            f"pipeline device_map must be one of {', '.join(DEVICE_MAPS)} (diffusers places whole components), "
            f"got {device_map!r}; to split one model over devices use shardkit.load_model(device_map='auto')"
        )
    if device_map == "balanced" and offload not in (None, "none"):
        raise InvalidInputError(
            f"device_map='balanced' and offload={offload!r} exclude each other: a device-mapped pipeline must be "
            "reset (pipe.reset_device_map()) before offloading; pass one of them"
        )


def _from_pretrained(folder: str, kwargs: dict[str, Any]) -> Any:
    from diffusers import DiffusionPipeline

    try:
        return DiffusionPipeline.from_pretrained(folder, **kwargs)
    except ShardkitError:
        raise
    except (OSError, ValueError, NotImplementedError, RuntimeError, KeyError, AttributeError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InvalidInputError(f"could not load the pipeline in {folder}: {first}") from e


def _apply_runtime_options(pipe: Any, offload: str | None, offload_options: Mapping[str, Any] | None,
                           layerwise_casting: Any) -> None:
    if layerwise_casting is not None:
        from .casting import apply_layerwise_casting

        if isinstance(layerwise_casting, Mapping):
            report = apply_layerwise_casting(pipe, **layerwise_casting)
        else:
            storage, compute = layerwise_casting
            report = apply_layerwise_casting(pipe, storage, compute)
        object.__setattr__(pipe, "shardkit_casting", report)
    if offload is not None:
        from .offload import apply_offload

        apply_offload(pipe, offload, **dict(offload_options or {}))
    elif offload_options:
        raise InvalidInputError("offload_options given without offload=; name the strategy (model, sequential, group)")
