"""``merge``: a sharded checkpoint folder → one ``.safetensors`` file, streamed and atomic.

Tensors are written in shard-number order and, inside each shard, in file order; the shards'
metadata is carried over. Since a shardkit split keeps the source's tensor order and metadata,
merging a split of a file that shardkit wrote gives back that file byte for byte. The bytes are
copied kernel-side (``copy_file_range``), so memory stays flat whatever the checkpoint's size;
on copy-on-write filesystems (XFS, btrfs) shards that shardkit wrote are cloned, not copied
(their header padding keeps every tensor at its source's offset inside a block).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from ..atomic.commit import file_transaction, recover
from ..errors import InvalidInputError, Option, OutputExistsError
from ..formats.header import Header, read_header
from ..formats.index import find_checkpoint, load_index, naming_from_filename
from ..sources.ranged import RangedCheckpoint, read_by_range, shown
from ..sources.safetensors import SafetensorsSource, check_index_against_headers
from .flush import ByteCounter
from .options import warn
from .writer import tensor_write, write_safetensors

_SHARD_NUMBER = re.compile(r"-(\d{5})-of-(\d{5})\.safetensors$")


@dataclass
class MergeResult:
    """What a merge wrote."""

    output: str
    source: str
    shards: int
    tensors: int
    total_bytes: int
    cloned_bytes: int = 0  # tensor bytes that share extents with the shards (copy-on-write), not copied
    dry_run: bool = False

    def to_dict(self) -> dict[str, object]:
        return {"output": self.output, "source": self.source, "dry_run": self.dry_run, "shards": self.shards,
                "tensors": self.tensors, "total_bytes": self.total_bytes, "cloned_bytes": self.cloned_bytes,
                "copied_bytes": self.total_bytes - self.cloned_bytes}


def merge(folder: str | os.PathLike[str] | RangedCheckpoint, output_file: str | os.PathLike[str], *, overwrite: bool = False,
          dry_run: bool = False, progress: Callable[[int, int], None] | None = None) -> MergeResult:
    """Merge a sharded safetensors folder (or its index file) into one ``.safetensors`` file.

    Args:
        folder: a sharded checkpoint folder, its ``*.safetensors.index.json``, or a folder with
            one ``.safetensors`` file (a pipeline folder is refused: merge one component); or a
            :class:`~shardkit.sources.ranged.RangedCheckpoint` of one (``s3://``, ``hf://``).
        output_file: the merged file; must end in ``.safetensors`` and not be one of the shards.
        overwrite: replace ``output_file`` if it exists.
        dry_run: check the shards and say what would be merged; write nothing.
        progress: called as ``progress(done_bytes, total_bytes)`` while bytes are copied.

    Returns:
        A :class:`MergeResult`: how many shards, tensors and bytes went into ``output_file``.

    import shardkit
    shardkit.merge("out/", "model.safetensors")
    MergeResult(output='model.safetensors', ..., shards=3, ...)
    """
    ranged = folder if isinstance(folder, RangedCheckpoint) else None
    folder, output_file = os.fspath(folder), os.fspath(output_file)
    if not output_file.endswith(".safetensors"):
        raise InvalidInputError(f"{output_file}: the merged file must end in .safetensors")
    source = _open_sharded(folder)
    if ranged is not None:  # the tensor bytes by range from where they live
        read_by_range(source, ranged)  # the same source, reading through the ranged files
        folder = shown(ranged)
    try:
        _refuse_overlap(source, folder, output_file)
        writes = [tensor_write(e, None) for e in source.entries()]
        total = sum(w.out.nbytes for w in writes)
        if dry_run:
            if os.path.exists(output_file) and not overwrite:
                warn(f"{output_file} exists: the real run needs ", Option("overwrite", True))
            return MergeResult(output_file, source.description, len(source.headers), len(writes), total, dry_run=True)
        with file_transaction(output_file, overwrite=overwrite) as tmp:
            written = write_safetensors(tmp, writes, source, metadata=source.metadata(),
                                        progress=ByteCounter(total, progress))
    finally:
        source.close()
    return MergeResult(output_file, source.description, len(source.headers), len(writes), total,
                       written.cloned_bytes)


def _open_sharded(path: str) -> SafetensorsSource:
    """Every shard of the folder's (or index file's) checkpoint, headers in shard-number order."""
    from ..formats.layout import is_pipeline_folder

    if is_pipeline_folder(path):
        raise InvalidInputError(f"{path}: is a diffusers pipeline folder; merge one component, e.g. {os.path.join(path, 'unet')}")
    if os.path.isdir(path):
        recover(path)
        layout = find_checkpoint(path)
        if layout.kind == "file":
            header = read_header(layout.path)
            return SafetensorsSource([header], description=f"safetensors file {layout.path}", naming=layout.naming)
        index_path = layout.path
    elif os.path.isfile(path) and path.endswith(".json"):
        index_path = path
    else:
        raise InvalidInputError(f"{path}: expected a sharded checkpoint folder or its .safetensors.index.json")
    index = load_index(index_path)
    headers = [_read_shard(index.folder, name, index_path) for name in sorted(index.shard_names(), key=_shard_key)]
    check_index_against_headers(index, headers)
    return SafetensorsSource(headers, description=f"sharded checkpoint {index_path} ({len(headers)} shards)",
                             naming=naming_from_filename(index_path))


def _shard_key(name: str) -> tuple[int, str]:
    match = _SHARD_NUMBER.search(name)
    return (int(match.group(1)) if match else 0, name)


def _read_shard(folder: str, name: str, index_path: str) -> Header:
    from ..formats.index import shard_file

    return read_header(shard_file(folder, name, where=index_path))  # existence + symlink policy


def _refuse_overlap(source: SafetensorsSource, folder: str, output_file: str) -> None:
    """Writing onto one of the files being read would destroy the checkpoint."""
    target = os.path.realpath(output_file)
    for path in source.paths:
        if os.path.realpath(path) == target:
            raise OutputExistsError(f"{output_file} is a shard of {folder}; write the merged file somewhere else")

