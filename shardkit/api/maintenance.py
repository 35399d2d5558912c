"""Jobs on a folder that is already written: ``recover`` (finish an interrupted commit) and ``merge``."""

from __future__ import annotations

import os

from ..atomic.journal import Recovery, recover_folder
from ..errors import OutputExistsError
from ..sharding.merge import MergeResult, merge
from ..stores.urls import is_store_url
from .store_writes import recover_prefix

__all__ = ["MergeResult", "Recovery", "merge", "recover"]


def recover(folder: str | os.PathLike[str]) -> Recovery:
    """Finish a write interrupted after its commit point and remove stale temporary files in ``folder``.

    Every shardkit job does this by itself before it reads or writes a folder; this is for
    read-only tools (or mounts) that found a folder mid-commit.

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
    if is_store_url(folder):
        return recover_prefix(folder)
    report = recover_folder(folder)
    if report is None:
        raise OutputExistsError(f"{os.fspath(folder)} is being written by another shardkit process; "
                                "try again when it ends")
    return report
