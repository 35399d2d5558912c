"""``torchrun -m shardkit convert``: every rank writes its share of the output shards from the source.

Each rank opens the same source (a DCP folder, safetensors, a pickle...) and plans it; the plans
are compared and the shards divided by bytes exactly as in a collective save
(:func:`~shardkit.distributed.collective.write_collective`); rank 0 publishes. The output is
byte-identical to a single-process ``convert``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ..errors import InvalidInputError, Option
from ..formats.layout import is_pipeline_folder
from ..sharding.job import SplitResult, open_settled, refuse_output_inside_source, side_files
from ..sharding.options import WriteOptions
from ..sharding.single_file import is_file_output
from ..sources.keymap import KeyMap, KeyMapSource
from .collective import write_collective

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["convert_collective"]


def convert_collective(source: Any, output: str | os.PathLike[str], *, options: WriteOptions,
                       key: str | None = None, keymap: KeyMap | None = None,
                       process_group: ProcessGroup | None = None, to: str | None = None) -> SplitResult:
    """Convert ``source`` into ``output`` with every rank of ``process_group`` writing its shards.

    Args:
        source: any checkpoint ``convert`` reads, except a pipeline folder; readable by every rank
            (an ``s3://`` prefix opened by each rank: a :class:`~shardkit.sources.ranged.RangedCheckpoint`).
        output: the output folder, on a filesystem shared by every rank, or ``s3://BUCKET/PREFIX``
            (each rank uploads its own shards; :mod:`shardkit.distributed.store_write`).
        options: the write options (equal on every rank).
        key, keymap: as in :func:`shardkit.sharding.convert.convert_with`.
        process_group: the group (None: the default one).
        to: must be None: ``--to diffusers`` runs in one process.

    Returns:
        The :class:`~shardkit.sharding.job.SplitResult`, the same on every rank.

    convert_collective("dcp/", "out/", options=WriteOptions(max_shard_bytes=5 * 10**9))
    """
    output = os.fspath(output)
    if to is not None:
        raise InvalidInputError(Option("to", to), " converts in one process; run it without torchrun")
    if isinstance(source, (str, os.PathLike)) and is_pipeline_folder(source):
        raise InvalidInputError(f"{source}: a pipeline folder is converted by one process; run it without torchrun")
    if is_file_output(output):
        raise InvalidInputError(f"{output}: a single-file output is written by one process; give a folder "
                                "or run without torchrun")
    refuse_output_inside_source(source, output)
    keymap = keymap or KeyMap()
    with open_settled(source, key=key, dry_run=options.dry_run, output=output) as inner:
        mapped = inner if keymap.is_identity() else KeyMapSource(inner, keymap)
        return write_collective(mapped, output, options=options, process_group=process_group,
                                side_files=side_files(source, output))
