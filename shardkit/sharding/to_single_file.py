"""``convert --to single-file``: a diffusers model or pipeline folder → the original single-file layout.

The way back from :mod:`shardkit.sharding.to_diffusers_pipeline`, for the checkpoints ComfyUI,
A1111/Forge and stable-diffusion.cpp load. Which folders go where, and which original tensor each
diffusers tensor becomes, is the export plan of :mod:`shardkit.layouts.single_file_export` (learnt from
diffusers' own single-file conversion run forward). Tensors that are only renamed (nearly all) keep
their place in the diffusers files and are copied kernel-side; a fused tensor is assembled in
memory, one at a time, when the writer reaches it (:class:`~shardkit.sources.original_layout.OriginalLayoutSource`).
The writer is the normal one: ``--dtype`` casts, the output is published atomically, and every shard's
``__metadata__`` records ``converted_from: diffusers`` and ``model_type``.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from ..errors import InvalidInputError, Option
from ..layouts.single_file_export import plan_export, trace_part, unplaced_components
from ..sources.original_layout import OriginalLayoutSource
from ..sources.ranged import RangedCheckpoint
from .job import SplitResult, refuse_output_inside_source, settle_source, split_source
from .options import DEFAULT_MAX_SHARD_BYTES, WriteOptions, warn
from .single_file import is_file_output, split_to_file

__all__ = ["convert_to_single_file"]

ONE_FILE_BYTES = 2**62  # a .safetensors OUTPUT without --max-shard-size holds the whole model


def convert_to_single_file(source: Any, output: str, *, options: WriteOptions, component: str | None = None,
                           config: Any = None, key: str | None = None, keymap_is_identity: bool = True) -> SplitResult:
    """Write the diffusers model or pipeline folder ``source`` as one checkpoint in its original layout.

    Args:
        source: a diffusers model folder (``unet/``, ``vae/``, ``transformer/``) or a pipeline folder.
        output: the ``.safetensors`` file to write (a folder gets shards with an index and a manifest).
        options: the write options; ``variant`` picks the source's weight variant (``fp16``).
        component: for a pipeline folder, the component (default: its unet/transformer), or ``"all"``.
        config, key, keymap_is_identity: refused: they belong to other conversions.

    Returns:
        The :class:`SplitResult` of the write.

    convert_to_single_file("sdxl/", "sdxl.safetensors", options=WriteOptions(), component="all")
    """
    if isinstance(source, RangedCheckpoint):
        raise InvalidInputError(f"{source}: ", Option("to", "single-file"), " reads a diffusers folder through "
                                "the HF cache; drop ", Option("cache", False))
    if config is not None or key is not None or not keymap_is_identity:
        raise InvalidInputError(Option("config"), ", ", Option("key"), " and the key options (",
                                Option("strip_prefix"), ", ", Option("rename"), ") do not apply with ",
                                Option("to", "single-file"), ": the diffusers folder names its configs and tensors")
    if not isinstance(source, (str, os.PathLike)) or not os.path.isdir(source):
        raise InvalidInputError(f"{source}: ", Option("to", "single-file"),
                                " converts a diffusers model or pipeline folder")
    path = os.fspath(source)
    refuse_output_inside_source(path, output)
    model_type, parts = plan_export(path, component=component)
    left_out = unplaced_components(path, model_type) if component == "all" else []
    if left_out:
        warn(f"{path}: {', '.join(left_out)} left out: the {model_type} single-file layout has no place for them")
    for part in parts:
        settle_source(part.folder, output, dry_run=options.dry_run)  # rolled forward only in place
    with OriginalLayoutSource.open(parts, variant=options.variant, trace=trace_part,
                                   metadata={"converted_from": "diffusers", "model_type": model_type},
                                   description=f"{path} as a {model_type} single file") as src:
        if is_file_output(output):
            if options.max_shard_bytes == DEFAULT_MAX_SHARD_BYTES:  # one file was asked for, however large
                options = replace(options, max_shard_bytes=ONE_FILE_BYTES)
            return split_to_file(src, output, options=replace(options, variant=None))
        return split_source(src, output, options=options)
