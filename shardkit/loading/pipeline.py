"""Load a diffusers pipeline folder (sharded by shardkit or saved by diffusers) for inference.

A thin wrapper over ``DiffusionPipeline.from_pretrained``: sizes and device keys are parsed
here, component-level placement is diffusers' own (``device_map="balanced"`` puts whole
components on GPUs, ``pipe.hf_device_map`` shows where, ``pipe.reset_device_map()`` undoes it),
then the shardkit runtime options are applied — fp8 layerwise casting first, then the offload
strategy, the order diffusers documents for combining them.

pipe = load_pipeline_folder("sdxl-sharded/", device_map="balanced",
                            max_memory={0: "16GB", 1: "16GB"})
pipe.hf_device_map
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ..devices import parse_max_memory
from ..errors import InvalidInputError, Option, Part, ShardkitError, SourceNotFoundError, first_line
from ..reading.residency import ReadMode
from ..runtime.apply import RuntimeSetup, apply_runtime
from ..sources.ranged import RangedCheckpoint, beneath, shown

if TYPE_CHECKING:
    import torch
    from diffusers import DiffusionPipeline

    from ..devices import Device, MaxMemory

DEVICE_MAPS = ("balanced", "cpu", "cuda")


def load_pipeline_folder(
    path: str | os.PathLike[str] | RangedCheckpoint,
    *,
    device_map: str | None = None,
    max_memory: MaxMemory | None = None,
    dtype: str | torch.dtype | None = None,
    variant: str | None = None,
    runtime: RuntimeSetup | None = None,
    read: ReadMode = "auto",
) -> DiffusionPipeline:
    """Load the pipeline in ``path`` with diffusers, then apply ``runtime`` (switches, casting, offload).

    The planner-free half of :func:`shardkit.load_pipeline` (which lives in ``shardkit.fitting`` because
    ``fit=`` needs the planner).

    Args:
        path: a diffusers pipeline folder (``model_index.json`` at its root); or a
            :class:`~shardkit.sources.ranged.RangedCheckpoint` over one (an ``s3://`` pipeline's
            mirror): every weight-bearing component is then loaded by :func:`shardkit.load_model`
            from its subfolder by ranged reads, and diffusers reads only the configs, tokenizers
            and schedulers (``device_map`` ``"cpu"`` or ``"cuda"``; no ``variant``).
        device_map: ``"balanced"`` (whole components spread over the GPUs in ``max_memory``),
            ``"cuda"`` or ``"cpu"``.
        max_memory: ``{0: "16GB", 1: "16GB"}``; any key :func:`shardkit.devices.parse_device` accepts.
        dtype: ``"bf16"``, ``torch.float16``...
        variant: the weights' variant (``"fp16"`` for ``*.fp16.safetensors``).
        runtime: what to apply after loading.
        read: the read backend (see :func:`shardkit.open`). Components whose weights ``auto``
            (or the backend asked for) would not memory-map are loaded by
            :func:`shardkit.load_model` with that backend and handed to diffusers; the rest
            load through diffusers as before. ``pipe.shardkit_load_report`` says what each got.

    Returns:
        The ``DiffusionPipeline``.

    pipe = load_pipeline_folder("sdxl/", device_map="balanced", max_memory={0: "16GB"})
    """
    ranged = path if isinstance(path, RangedCheckpoint) else None
    folder = _check_folder(path)
    runtime = runtime or RuntimeSetup()
    _check_device_map(device_map, runtime.offload)
    if ranged is not None and (device_map == "balanced" or variant is not None):
        option = Option("device_map", "balanced") if device_map == "balanced" else Option("variant", variant)
        raise InvalidInputError(f"{shown(ranged)}: ", option, " does not apply to a pipeline read from a bucket (each "
                                "component is loaded by ranged reads); use ", Option("device_map", "cpu",
                                                                                     choices=("cuda",)),
                                ", or name the "
                                "variant's own prefix")
    kwargs: dict[str, Any] = {}
    if device_map is not None:
        kwargs["device_map"] = device_map
    if device_map == "cuda":
        check_gpus([0], where=Option("device_map", "cuda"))
    if max_memory is not None:
        kwargs["max_memory"] = parse_max_memory(max_memory)
        check_gpus(list(kwargs["max_memory"]), where="max_memory")
    if dtype is not None:
        from ..formats.dtypes import resolve_torch_dtype

        kwargs["torch_dtype"] = resolve_torch_dtype(dtype)
    if variant is not None:
        kwargs["variant"] = variant
    if ranged is not None:
        report = _load_ranged_components(ranged, kwargs, device_map=device_map)
    else:
        report = _preload_components(folder, kwargs, read=read, device_map=device_map, variant=variant)
    pipe = _from_pretrained(folder, kwargs)
    from .load import attach_report

    attach_report(pipe, report)
    return apply_runtime(pipe, runtime)


def _preload_components(folder: str, kwargs: dict[str, Any], *, read: ReadMode, device_map: str | None,
                        variant: str | None) -> dict[str, object]:
    """Load with shardkit the components whose files want a bulk reader; diffusers maps the rest.

    Only where placement is whole-model (no device map, ``"cpu"``, ``"cuda"``) and no variant is
    asked for: diffusers' own ``balanced`` placement and variant lookup stay diffusers'.
    """
    from ..reading.residency import check_backend
    from .load import load_model, load_report
    from .opening import open_checkpoint
    from .scaled import has_scales

    check_backend(read)
    report: dict[str, object] = {}
    if read == "mmap" or device_map == "balanced" or variant is not None:
        return report
    for component, spec in _weight_components(folder):
        sub = os.path.join(folder, component)
        try:
            with open_checkpoint(sub, read=read) as ckpt:
                ckpt.reader_of(next(iter(ckpt)))  # opens the first shard: auto decides there
                files = ckpt.read_report()
        except (ShardkitError, StopIteration):
            continue  # no safetensors weights: diffusers loads it
        if all(f["backend"] == "mmap" for f in files) and not has_scales(sub):  # fp8 scales: diffusers drops them
            report[component] = {"files": files, "loaded_by": "diffusers"}
            continue
        model = load_model(spec, sub, dtype=kwargs.get("torch_dtype"), read=read,
                           device_map={"": 0} if device_map == "cuda" else "cpu")
        kwargs[component] = model
        report[component] = {**load_report(model), "loaded_by": "shardkit"}
    return report


def _weight_components(folder: str) -> list[tuple[str, str]]:
    """``(component, "library:Class")`` of each diffusers/transformers component with a ``config.json``.

    ``model_index.json`` is read once through the folder boundary (:func:`~shardkit.formats.layout.find_components`:
    a checked descriptor, a bounded read, component names that stay inside the folder).
    """
    from ..formats.layout import find_components

    return [(c.name, f"{c.library}:{c.class_name}") for c in find_components(folder)
            if c.library in ("diffusers", "transformers") and os.path.isfile(os.path.join(c.path, "config.json"))]


def _load_ranged_components(ranged: RangedCheckpoint, kwargs: dict[str, Any], *,
                            device_map: str | None) -> dict[str, object]:
    """Every component with safetensors weights, loaded by :func:`shardkit.load_model` by ranged reads
    (the mirror's stand-ins are holes: diffusers must never read one)."""
    from .load import load_model, load_report

    report: dict[str, object] = {}
    for component, spec in _weight_components(ranged.path):
        sub = os.path.join(ranged.path, component)
        if not any(name.endswith(".safetensors") for name in os.listdir(sub)):
            continue  # no weights here (diffusers reports what it misses)
        model = load_model(spec, beneath(ranged, sub), dtype=kwargs.get("torch_dtype"),
                           device_map={"": 0} if device_map == "cuda" else "cpu")
        kwargs[component] = model
        report[component] = {**load_report(model), "loaded_by": "shardkit"}
    return report


PIPELINE_DEVICE_FIX: tuple[Part, ...] = (
    "to run on the CPU give no GPU (", Option("device_map", "cpu"), ", or fit='auto' with ",
    Option("max_memory", {"cpu": "24GB"}), "); to plan for a GPU this machine lacks without loading, use "
    "shardkit.fit(path, max_memory=...)"
)


def check_gpus(devices: list[Device], *, where: Part) -> None:
    """Refuse GPUs this machine lacks, as ``load_model`` does, with the pipeline's fixes.

    Args:
        devices: parsed device keys (GPU indices, ``"cpu"``...).
        where: what named them, for the message (``"max_memory"``).

    Raises:
        InvalidInputError: a GPU index is not on this machine.

    >>> check_gpus(["cpu"], where="max_memory")
    """
    from .device_map import check_devices_exist

    check_devices_exist(devices, where=where, fix=PIPELINE_DEVICE_FIX)


def _check_folder(path: str | os.PathLike[str]) -> str:
    folder = os.fspath(path)  # a RangedCheckpoint: its mirror's root
    if not os.path.isdir(folder):
        raise SourceNotFoundError(f"pipeline folder {folder} does not exist")
    if not os.path.lexists(os.path.join(folder, "model_index.json")):
        raise SourceNotFoundError(
            f"{folder} has no model_index.json, so it is not a diffusers pipeline folder; "
            "load a single model with shardkit.load_model"
        )
    from ..formats.layout import find_components

    find_components(folder)  # the folder boundary before diffusers reads anything: a linked-out index, a FIFO
    return folder


def _check_device_map(device_map: object, offload: str | None) -> None:
    if device_map is None:
        return
    if not isinstance(device_map, str) or device_map not in DEVICE_MAPS:
        raise InvalidInputError(
            f"pipeline device_map must be one of {', '.join(DEVICE_MAPS)} (diffusers places whole components), "
            f"got {device_map!r}; to split one model over devices use shardkit.load_model(device_map='auto')"
        )
    if device_map == "balanced" and offload not in (None, "none"):
        raise InvalidInputError(
            Option("device_map", "balanced"),
                                f" and offload={offload!r} exclude each other: a device-mapped pipeline must be "
            "reset (pipe.reset_device_map()) before offloading; pass one of them"
        )


def _from_pretrained(folder: str, kwargs: dict[str, Any]) -> DiffusionPipeline:
    from diffusers import DiffusionPipeline

    try:
        pipe: DiffusionPipeline = DiffusionPipeline.from_pretrained(folder, **kwargs)  # type: ignore[no-untyped-call]
        return pipe
    except ShardkitError:
        raise
    except (OSError, ValueError, NotImplementedError, RuntimeError, KeyError, AttributeError, TypeError) as e:
        first = first_line(e)
        raise InvalidInputError(f"could not load the pipeline in {folder}: {first}") from e
