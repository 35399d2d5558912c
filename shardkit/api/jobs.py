"""The composite write jobs the CLI runs, callable from Python with the same function.

``split_and_push``: split (or reshard) any source, local or ``hf://``, then push the output,
with the push's preflight (repository id, token, symlinks) run before the split starts.
The collective convert is ``shardkit.convert(..., collective=True)`` under :func:`torchrun_group`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..distributed.group import group_from_env as torchrun_group
from ..distributed.group import is_rank_zero
from ..hub.push import PushResult, push
from ..sharding.job import SplitResult
from ..sharding.options import ProgressCallback, WriteOptions
from ..sources.base import CheckpointSource

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ..sharding.options import WriteKeywords

__all__ = ["PushResult", "SplitAndPush", "WriteOptions", "is_rank_zero", "push", "split_and_push", "torchrun_group"]


@dataclass(frozen=True)
class SplitAndPush:
    """What :func:`split_and_push` did: the split, and the push (None without a repository or on a dry run)."""

    split: SplitResult
    push: PushResult | None = None

    def to_dict(self) -> dict[str, Any]:
        data = self.split.to_dict()
        return {**data, "push": self.push.to_dict()} if self.push else data


def split_and_push(source: CheckpointSource, output: str | os.PathLike[str], repo_id: str | None = None, *,
                   options: WriteOptions | None = None, key: str | None = None, token: str | None = None,
                   cache: bool = True, create_pr: bool = False, push_progress: ProgressCallback | None = None,
                   after_split: Callable[[SplitResult], None] | None = None,
                   **shorthands: Unpack[WriteKeywords]) -> SplitAndPush:
    """Split ``source`` into ``output``, then push ``output`` to ``repo_id`` (when given and not a dry run).

    A bad repository id, a missing or rejected token, or a symlink in ``output`` leading outside it
    (which the push would refuse) is found before the split, not after.

    Args:
        source: anything :func:`shardkit.split` takes, ``hf://ORG/REPO`` included.
        output: the output folder.
        repo_id: the Hub repository to push to; None splits only.
        options, key, token, cache, **shorthands: as for :func:`shardkit.split`.
        create_pr: open a pull request instead of committing to main.
        push_progress: ``(done_bytes, total_bytes)`` of the upload.
        after_split: called with the split's result before the push starts.

    shardkit.split_and_push("model.safetensors", "out/", "org/model", options=WriteOptions(max_shard_bytes=2 * 10**9))
    """
    from ..sharding.split import split_with
    from .sources import opened

    options = WriteOptions.build(options, shorthands, where="split_and_push()")
    if repo_id:
        from ..hub.preflight import check_folder_links, check_push_target, check_repo_id

        check_repo_id(repo_id) if options.dry_run else check_push_target(repo_id, token=token)
        check_folder_links(output)
    with opened(source, token=token, cache=cache) as readable:
        result = split_with(readable, output, options=options, key=key)
    if after_split is not None:
        after_split(result)
    if not repo_id or options.dry_run:
        return SplitAndPush(result)
    return SplitAndPush(result, push(output, repo_id, token=token, create_pr=create_pr, progress=push_progress))
