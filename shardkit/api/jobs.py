"""Publishing and torchrun groups: ``shardkit.push``, and the group a collective convert runs in.

``split_and_push`` (split, then push with the preflight first) lives with ``split`` in
:mod:`shardkit.api.checkpoints`, so a split that pushes nothing never imports ``hub/``.
The collective convert is ``shardkit.convert(..., collective=True)`` under :func:`torchrun_group`.
"""

from __future__ import annotations

import os
from typing import TypedDict

from ..distributed.group import group_from_env as torchrun_group
from ..distributed.group import is_rank_zero
from ..errors import InvalidInputError
from ..hub.push import PushResult
from ..hub.push import push as push_local
from ..stores.urls import is_store_url
from ..units import ProgressCallback

__all__ = ["PushResult", "is_rank_zero", "push", "torchrun_group"]


class _PushOptions(TypedDict):
    """What a push from a folder and from a bucket both take."""

    private: bool
    revision: str | None
    create_pr: bool
    message: str | None
    path_in_repo: str | None
    repo_type: str
    token: str | None
    include: list[str] | str | None
    exclude: list[str] | str | None
    dry_run: bool
    progress: ProgressCallback | None
    allow_lossy: bool


def push(path: str | os.PathLike[str], repo_id: str, *, private: bool = False, revision: str | None = None,
         create_pr: bool = False, message: str | None = None, path_in_repo: str | None = None,
         repo_type: str = "model", token: str | None = None, include: list[str] | str | None = None,
         exclude: list[str] | str | None = None, dry_run: bool = False, verify: bool = True,
         follow_symlinks: bool = False, progress: ProgressCallback | None = None,
         allow_lossy: bool = False) -> PushResult:
    """:func:`shardkit.hub.push.push`, from an ``s3://BUCKET/PREFIX`` too: its objects are streamed
    to the Hub by ranged GETs (no local copy), after its structure is verified from the header-only
    mirror (index, headers, sizes). Every argument is as for the local function.

    shardkit.push("s3://models/unet/sharded", "my-org/unet", private=True)
    """
    options: _PushOptions = {"private": private, "revision": revision, "create_pr": create_pr, "message": message,
               "path_in_repo": path_in_repo, "repo_type": repo_type, "token": token, "include": include,
               "exclude": exclude, "dry_run": dry_run, "progress": progress, "allow_lossy": allow_lossy}
    if not is_store_url(path):
        return push_local(path, repo_id, verify=verify, follow_symlinks=follow_symlinks, **options)
    if follow_symlinks:
        raise InvalidInputError(f"{path}: follow_symlinks=True applies to a local folder; a bucket has no symlinks")
    from ..checking.verify import verify as verify_checkpoint
    from ..hub.push import push_objects
    from .stores import mirrored

    with mirrored(os.fspath(path)) as (mirror, store):
        report = verify_checkpoint(mirror.root, read_data=False) if verify else None
        return push_objects(store, repo_id, report=report, **options)
