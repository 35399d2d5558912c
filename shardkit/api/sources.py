"""Turning what a caller names into what a stage reads: the one place that routes a source by scheme.

A local path (or an open source, or an in-memory state dict) passes straight through without
touching ``hub/``; ``hf://ORG/REPO[@REVISION][/SUBFOLDER]`` is opened by ``hub/`` (the cached
download, the streamed range reads, or the header-only mirror); ``s3://BUCKET/PREFIX`` by
:mod:`shardkit.api.stores` (the header-only mirror, and its tensor bytes by ranged GETs). A new
scheme is one more row in :data:`SCHEMES` and one opener per kind of use.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TypeGuard

from ..errors import InvalidInputError
from ..sources.base import CheckpointSource
from ..stores.urls import is_store_url

__all__ = ["SCHEMES", "configs", "headers", "is_hub", "is_remote", "opened"]

SCHEMES = {"hf://": "the Hugging Face Hub", "s3://": "an S3 bucket"}  # the remote schemes the application layer routes


def is_remote(path: object) -> TypeGuard[str]:
    """True for a string naming a remote checkpoint (any scheme of :data:`SCHEMES`).

    >>> is_remote("hf://org/model"), is_remote("out/")
    (True, False)
    """
    return isinstance(path, str) and path.startswith(tuple(SCHEMES))


def is_hub(path: object) -> TypeGuard[str]:
    """True for ``hf://...``."""
    return isinstance(path, str) and path.startswith("hf://")


@contextlib.contextmanager
def opened(source: CheckpointSource, *, token: str | None = None, cache: bool = True,
           pickles: bool = False) -> Iterator[CheckpointSource]:
    """What the writers read for ``source``: itself, or for ``hf://`` its cached copy or a streamed mirror.

    with opened("hf://org/model", cache=False) as readable:
        split_with(readable, "out/", options=WriteOptions())

    An ``s3://BUCKET/PREFIX`` is read where it lives (its tensor bytes by ranged GETs, no local
    copy), so ``cache`` does not apply to it.
    """
    if is_store_url(source):
        from .stores import store_checkpoint

        with store_checkpoint(source, side_files=True) as ranged:  # a split copies them
            yield ranged
        return
    if not is_hub(source):
        if not cache:
            shown = os.fspath(source) if isinstance(source, (str, os.PathLike)) else f"a {type(source).__name__}"
            raise InvalidInputError(f"cache=False applies to an hf://ORG/REPO source, not to {shown}; drop it")
        yield source
        return
    from ..hub.remote_checkpoint import open_checkpoint

    with open_checkpoint(source, token=token, cache=cache, pickles=pickles) as readable:
        yield readable


@contextlib.contextmanager
def configs(path: str | os.PathLike[str] | None, *, token: str | None = None) -> Iterator[str | None]:
    """A config folder or file: itself, for ``hf://`` its configs, tokenizers and schedulers (never weights),
    for ``s3://BUCKET/PREFIX`` a folder of its configs (from the header-only mirror)."""
    if path is not None and is_store_url(os.fspath(path)):
        from .stores import store_mirror

        with store_mirror(os.fspath(path)) as mirror:
            yield mirror.root
        return
    if path is None or not is_hub(os.fspath(path)):
        yield None if path is None else os.fspath(path)
        return
    from ..hub.remote_checkpoint import config_source

    with config_source(os.fspath(path), token=token) as local:
        yield local


@contextlib.contextmanager
def headers(path: str | os.PathLike[str], *, token: str | None = None) -> Iterator[str]:
    """A checkpoint to plan from without its tensor data: itself, or for ``hf://``/``s3://`` a header-only mirror."""
    if is_store_url(os.fspath(path)):
        from .stores import store_mirror

        with store_mirror(os.fspath(path)) as mirror:
            yield mirror.root
        return
    if not is_hub(os.fspath(path)):
        yield os.fspath(path)
        return
    from ..hub.remote import local_checkpoint

    with local_checkpoint(os.fspath(path), token=token) as local:
        yield local
