"""Jobs on a folder that is already written: ``recover`` (finish an interrupted commit) and ``merge``."""

from __future__ import annotations

import os

from ..atomic.journal import Recovery, recover_folder
from ..errors import InvalidInputError, OutputExistsError
from ..sharding.merge import MergeResult
from ..sharding.merge import merge as merge_file
from ..sharding.options import ProgressCallback
from ..stores.urls import check_scheme, is_store_url
from .sources import is_remote, opened
from .store_writes import recover_prefix, write_to_store

__all__ = ["MergeResult", "Recovery", "merge", "recover"]


def recover(folder: str | os.PathLike[str]) -> Recovery:
    """Finish a write interrupted after its commit point and remove stale temporary files in ``folder``.

    Every shardkit job does this by itself before it reads or writes a folder; this is for
    read-only tools (or mounts) that found a folder mid-commit. It also removes the work folder of an
    abandoned plan into ``folder`` (``.NAME.shardkit-plan-ID`` beside it) that no task is running.

    For ``s3://BUCKET/PREFIX``: the multipart uploads of writes killed mid-way are aborted and
    the shards they left unpublished are deleted (see :func:`shardkit.stores.transaction.recover_store`).

    Args:
        folder: a checkpoint folder (or the path a failed write was creating), or ``s3://BUCKET/PREFIX``.

    Returns:
        A :class:`~shardkit.atomic.journal.Recovery` listing the files rolled forward and the
        temporaries removed.

    Raises:
        OutputExistsError: another shardkit process is writing the folder.

    shardkit.recover("out/").removed_bytes
    """
    if is_remote(folder):
        return recover_prefix(folder)
    report = recover_folder(folder, plans=True)  # an abandoned plan's work folder too
    if report is None:
        raise OutputExistsError(f"{os.fspath(folder)} is being written by another shardkit process; "
                                "try again when it ends")
    return report


def merge(folder: str | os.PathLike[str], output_file: str | os.PathLike[str], *, overwrite: bool = False,
          dry_run: bool = False, progress: ProgressCallback | None = None, token: str | None = None) -> MergeResult:
    """Merge a sharded checkpoint into one ``.safetensors`` file: :func:`shardkit.sharding.merge.merge`,
    with ``s3://BUCKET/PREFIX`` as the source and ``s3://BUCKET/PREFIX/NAME.safetensors``
    as the output too.

    shardkit.merge("s3://models/llama/sharded", "model.safetensors")  # tensor bytes by ranged GETs
    """
    check_scheme(folder)
    check_scheme(output_file, role="output")
    with opened(folder, token=token) as readable:
        if not isinstance(readable, (str, os.PathLike)):  # a folder or file path, or a RangedCheckpoint of one
            raise InvalidInputError(f"{folder}: expected a sharded checkpoint folder or its .safetensors.index.json")
        if is_store_url(output_file):  # staged, then uploaded: one object, published whole
            return write_to_store(os.fspath(output_file), lambda out, tick: merge_file(
                readable, out, overwrite=False, dry_run=dry_run, progress=tick),
                overwrite=overwrite, dry_run=dry_run, progress=progress)
        return merge_file(readable, output_file, overwrite=overwrite, dry_run=dry_run, progress=progress)
