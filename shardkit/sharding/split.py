"""``split`` (and the single-process writer of ``save_sharded``): any checkpoint (or in-memory model) →
size-bounded safetensors shards.

The public ``shardkit.split`` (:mod:`shardkit.api.checkpoints`) builds one
:class:`~shardkit.sharding.options.WriteOptions` and calls :func:`split_with`, as the CLI and
``convert`` do.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..formats.layout import is_pipeline_folder
from ..sources.base import CheckpointSource
from .job import (
    SplitResult,
    open_settled,
    refuse_output_inside_source,
    side_files,
    split_source,
)
from .native import NativeModel
from .options import WriteOptions
from .pipeline import split_pipeline
from .single_file import is_file_output, refuse_file_output, split_to_file

__all__ = ["SplitResult", "save_state", "split_with"]


def split_with(source: CheckpointSource, output: str | os.PathLike[str], *, options: WriteOptions,
               key: str | None = None) -> SplitResult:
    """Stream a checkpoint into size-bounded safetensors shards with an index: ``shardkit.split``'s writer.

    ``source`` is a path (safetensors file, index or sharded folder, ``.bin``/``.pt``/``.ckpt``
    pickle, diffusers pipeline folder), an open Source, or a
    :class:`~shardkit.sharding.job.WrappedPath`; ``key`` picks a pickle's state dict.

    split_with("ckpt/", "out/", options=WriteOptions(max_shard_bytes=2 * 10**9, dry_run=True))
    """
    output = os.fspath(output)
    refuse_output_inside_source(source, output)
    if isinstance(source, (str, os.PathLike)) and is_pipeline_folder(source):
        refuse_file_output(source, output)
        return split_pipeline(source, output, options=options, key=key)
    with open_settled(source, key=key, dry_run=options.dry_run, output=output) as src:
        if is_file_output(output):
            return split_to_file(src, output, options=options)
        return split_source(src, output, options=options, side_files=side_files(source, output))


def save_state(state: Mapping[str, Any], output: str | os.PathLike[str], *, options: WriteOptions,
               native: NativeModel | None = None, description: str = "in-memory state dict") -> SplitResult:
    """Write an in-memory state dict in one process: the writer behind :func:`shardkit.save_sharded`.

    Tensors are moved to the host one at a time; tied tensors are written once and their other
    names recorded as aliases in the shard metadata. ``native`` (from
    :func:`~shardkit.sharding.native.native_model`, already prepared by the caller) gives a
    library model's file names, tie preferences and config files.

    save_state(model.state_dict(), "out/", options=WriteOptions(max_shard_bytes=2 * 10**9))
    """
    from ..sources.memory import MemorySource

    if native is None:
        source = MemorySource(state, description=description)
    else:
        source = MemorySource(state, description=description, naming=native.naming, keep=native.keep)
    with source:
        return split_source(source, os.fspath(output), options=options,
                            side_files=native.side_files if native else ())
