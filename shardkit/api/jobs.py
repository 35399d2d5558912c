"""Publishing and torchrun groups: ``shardkit.push``, and the group a collective convert runs in.

``split_and_push`` (split, then push with the preflight first) lives with ``split`` in
:mod:`shardkit.api.checkpoints`, so a split that pushes nothing never imports ``hub/``.
The collective convert is ``shardkit.convert(..., collective=True)`` under :func:`torchrun_group`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, TypedDict

from ..distributed.group import group_from_env as torchrun_group
from ..distributed.group import is_rank_zero
from ..errors import InvalidInputError, Option
from ..hub.push import PushOptions, PushResult
from ..hub.push import push as push_local
from .sources import is_remote

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ..units import ProgressCallback

__all__ = ["PushKeywords", "PushOptions", "PushResult", "is_rank_zero", "push", "torchrun_group"]


class PushKeywords(TypedDict, total=False):
    """Every :class:`~shardkit.hub.push.PushOptions` field as a keyword of :func:`push` (the same names and
    types; ``tests/test_hub_push_options.py`` fails when the two drift apart)."""

    private: bool
    revision: str | None
    create_pr: bool
    message: str | None
    path_in_repo: str | None
    repo_type: str
    token: str | None
    include: tuple[str, ...] | list[str] | str
    exclude: tuple[str, ...] | list[str] | str
    dry_run: bool
    verify: bool
    follow_symlinks: bool
    allow_lossy: bool
    progress: ProgressCallback | None


def push(path: str | os.PathLike[str], repo_id: str, *, options: PushOptions | None = None,
         **shorthands: Unpack[PushKeywords]) -> PushResult:
    """:func:`shardkit.hub.push.push`, from a remote location (``s3://BUCKET/PREFIX``, ``hf://ORG/REPO``) too:
    its objects are streamed to the Hub by ranged reads (no local copy), after its structure is verified
    from the header-only mirror (index, headers, sizes).

    ``options`` is a :class:`~shardkit.hub.push.PushOptions`; any of its fields may also be given by
    name (``private=True``), applied over ``options``.

    shardkit.push("s3://models/unet/sharded", "my-org/unet", private=True)
    """
    built = dataclasses.replace(options or PushOptions(), **shorthands)
    if not is_remote(path):
        return push_local(path, repo_id, built)
    if built.follow_symlinks:
        raise InvalidInputError(f"{path}: ", Option("follow_symlinks", True),
                                " applies to a local folder; a store has no symlinks")
    from ..checking.verify import verify as verify_checkpoint
    from ..hub.push import push_objects
    from .stores import mirrored

    with mirrored(os.fspath(path), token=built.token) as (mirror, store):
        report = verify_checkpoint(mirror.root, read_data=False) if built.verify else None
        return push_objects(store, repo_id, built, report=report)
