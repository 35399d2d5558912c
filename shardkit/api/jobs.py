"""The composite write jobs the CLI runs, callable from Python with the same function.

``split_and_push``: split (or reshard) any source, local or ``hf://``, then push the output,
with the push's preflight (repository id, token, symlinks) run before the split starts.
``convert_job``: convert with the key options, ``--to`` layouts and ``hf://`` configs, or under
torchrun (:func:`torchrun_group`) with every rank writing its share of the shards.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..distributed.group import group_from_env as torchrun_group
from ..distributed.group import is_rank_zero
from ..errors import InvalidInputError
from ..hub.push import PushResult, push
from ..sharding.job import SplitResult
from ..sharding.options import ProgressCallback, WriteOptions
from ..sources.base import CheckpointSource
from ..stores.urls import is_store_url
from .store_writes import write_to_store

__all__ = ["PushResult", "SplitAndPush", "WriteOptions", "convert_job", "is_rank_zero", "push", "split_and_push",
           "torchrun_group"]


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
                   after_split: Callable[[SplitResult], None] | None = None) -> SplitAndPush:
    """Split ``source`` into ``output``, then push ``output`` to ``repo_id`` (when given and not a dry run).

    A bad repository id, a missing or rejected token, or a symlink in ``output`` leading outside it
    (which the push would refuse) is found before the split, not after.

    Args:
        source: anything :func:`shardkit.split` takes, ``hf://ORG/REPO`` included.
        output: the output folder.
        repo_id: the Hub repository to push to; None splits only.
        options: the :class:`~shardkit.sharding.options.WriteOptions` of the split.
        key, token, cache: as for :func:`shardkit.split`.
        create_pr: open a pull request instead of committing to main.
        push_progress: ``(done_bytes, total_bytes)`` of the upload.
        after_split: called with the split's result before the push starts.

    shardkit.split_and_push("model.safetensors", "out/", "org/model", options=WriteOptions(max_shard_bytes=2 * 10**9))
    """
    from ..hub.remote_checkpoint import open_checkpoint
    from ..sharding.split import split_with

    options = options or WriteOptions()
    if repo_id and is_store_url(output):
        raise InvalidInputError(f"{output}: a push reads a local folder; split to a local folder to push it")
    if repo_id:
        from ..hub.preflight import check_folder_links, check_push_target, check_repo_id

        check_repo_id(repo_id) if options.dry_run else check_push_target(repo_id, token=token)
        check_folder_links(output)
    with open_checkpoint(source, token=token, cache=cache) as readable:
        if is_store_url(output):  # staged locally, then published into the store (api/store_writes.py)
            result = write_to_store(output, lambda out, tick: split_with(
                readable, out, options=dataclasses.replace(options, overwrite=False, progress=tick), key=key),
                overwrite=options.overwrite, dry_run=options.dry_run, progress=options.progress)
        else:
            result = split_with(readable, output, options=options, key=key)
    if after_split is not None:
        after_split(result)
    if not repo_id or options.dry_run:
        return SplitAndPush(result)
    return SplitAndPush(result, push(output, repo_id, token=token, create_pr=create_pr, progress=push_progress))


def convert_job(source: str | os.PathLike[str], output: str | os.PathLike[str], *, options: WriteOptions,
                key: str | None = None, include: Iterable[str] = (), exclude: Iterable[str] = (),
                strip_prefix: str | None = None, add_prefix: str | None = None,
                rename: Iterable[str] | dict[str, str] = (), to: str | None = None,
                config: str | os.PathLike[str] | None = None, component: str | None = None,
                token: str | None = None, cache: bool = True, collective: bool = False) -> SplitResult:
    """:func:`shardkit.convert` with the options built, or, with ``collective``, by every rank of a torchrun group.

    with torchrun_group() as collective:
        convert_job("ckpt/", "out/", options=WriteOptions(), collective=collective)
    """
    from ..sharding.convert import build_keymap, convert_with

    keymap = build_keymap(include=include, exclude=exclude, strip_prefix=strip_prefix, add_prefix=add_prefix,
                          rename=rename)
    if collective:
        from ..distributed.convert import convert_collective
        from ..hub.remote_spec import is_remote

        if is_remote(source):
            raise InvalidInputError(f"{source}: a collective convert reads a local checkpoint; download it "
                                    "first (hf download), or convert without torchrun")
        return convert_collective(source, output, options=options, key=key, keymap=keymap, to=to)
    from ..hub.remote_checkpoint import config_source, open_checkpoint

    with open_checkpoint(source, token=token, cache=cache, pickles=True) as readable, \
            config_source(None if config is None else os.fspath(config), token=token) as local_config:
        if is_store_url(output):  # staged locally, then published into the store (api/store_writes.py)
            return write_to_store(output, lambda out, tick: convert_with(
                readable, out, options=dataclasses.replace(options, overwrite=False, progress=tick), key=key,
                keymap=keymap, to=to, config=local_config, component=component),
                overwrite=options.overwrite, dry_run=options.dry_run, progress=options.progress)
        return convert_with(readable, output, options=options, key=key, keymap=keymap, to=to,
                            config=local_config, component=component)
