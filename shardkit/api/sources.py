"""Turning what a caller names into what a stage reads: the one place a location is resolved.

A location is a local path (or an open source, or an in-memory state dict), which passes straight
through, or a ``scheme://`` string whose row of :data:`LOCATIONS` says how it is read. Every remote
location is a store (:func:`shardkit.stores.open_store`: ``s3://BUCKET/PREFIX``, ``hf://ORG/REPO[@REV][/SUBFOLDER]``)
read the same way (:mod:`shardkit.api.stores`: a header-only mirror, and the tensor bytes by range);
a row adds only what that kind of store offers besides: a local cache (the Hugging Face cache), a
config-only download, digests listed for every file. A new store is one row here and one opener
in ``stores/``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TypeGuard

from ..errors import InvalidInputError, Option
from ..sources.base import CheckpointSource
from ..stores.urls import check_scheme, url_scheme

__all__ = ["LOCATIONS", "Location", "check_collective", "configs", "headers", "is_remote", "lists_digests", "opened"]


def _hf_cached(path: str, *, token: str | None, pickles: bool) -> AbstractContextManager[str]:
    from ..stores.hf_cache import cached_folder

    return cached_folder(path, token=token, pickles=pickles)


def _hf_configs(path: str, *, token: str | None) -> AbstractContextManager[str]:
    from ..stores.hf_cache import cached_configs

    return cached_configs(path, token=token)


def _hf_names_a_file(path: str) -> bool:
    from ..stores.hf_cache import names_a_file

    return names_a_file(path)


@dataclass(frozen=True)
class Location:
    """What one kind of remote location offers besides the store every one of them is.

    ``cached``: a local copy through a cache, used by default for ``split``/``convert`` (``cache=True``);
    None: read where it lives. ``configs``: the configs of a folder, downloaded (None: from the
    header-only mirror). ``names_a_file``: the location names one checkpoint file, not a folder
    (read through ``cached`` only). ``digests``: the store lists a digest of every file, so a local
    folder is compared with it file by file before any tensor byte is read. ``collective``: the ranks of
    a torchrun group may each read their shards' byte ranges from it (a cached location is not shared).
    """

    what: str
    cached: Callable[..., AbstractContextManager[str]] | None = None
    configs: Callable[..., AbstractContextManager[str]] | None = None
    names_a_file: Callable[[str], bool] | None = None
    digests: bool = False
    collective: bool = True


LOCATIONS: dict[str, Location] = {
    "hf": Location("a Hugging Face Hub repository", cached=_hf_cached, configs=_hf_configs,
                   names_a_file=_hf_names_a_file, digests=True, collective=False),
    "s3": Location("an S3 bucket"),
}


def location(path: object) -> Location | None:
    """The row of a remote location, or None for a local path or an open source; an unknown scheme is refused."""
    text = os.fspath(path) if isinstance(path, os.PathLike) else path
    scheme = url_scheme(text)
    if scheme is None:
        return None
    check_scheme(text)
    return LOCATIONS[scheme]


def is_remote(path: object) -> TypeGuard[str]:
    """True for a string naming a remote checkpoint (a row of :data:`LOCATIONS`).

    >>> is_remote("hf://org/model"), is_remote("s3://models/m"), is_remote("out/")
    (True, True, False)
    """
    return isinstance(path, str) and url_scheme(path) in LOCATIONS


def lists_digests(path: object) -> TypeGuard[str]:
    """True for a remote location whose store lists a digest of every file (a Hub repository)."""
    row = location(path) if isinstance(path, str) else None
    return row is not None and row.digests


def check_collective(source: object) -> None:
    """Refuse a location the ranks of a collective convert cannot each read by range (before any work)."""
    row = location(source) if isinstance(source, (str, os.PathLike)) else None
    if row is not None and not row.collective:
        shared = " or ".join(f"{scheme}://" for scheme, r in LOCATIONS.items() if r.collective)
        raise InvalidInputError(f"{source}: a collective convert reads a local or {shared} checkpoint; download it "
                                "first, or convert without torchrun")


@contextlib.contextmanager
def opened(source: CheckpointSource, *, token: str | None = None, cache: bool = True,
           pickles: bool = False) -> Iterator[CheckpointSource]:
    """What the writers read for ``source``: itself, a cached copy, or the store's folder read by range.

    with opened("hf://org/model", cache=False) as readable:
        split_with(readable, "out/", options=WriteOptions())

    A ``.gguf`` file in a store (and a split's every part) is read by range: its headers fetched into a
    temporary folder, each tensor's bytes by ranged reads (:func:`shardkit.sources.gguf.remote_gguf`); one
    in a store that lists digests (``hf://``) is fetched whole and checked against its sha256 unless
    ``cache=False`` (:mod:`shardkit.stores.gguf_fetch`). A location whose row has a cache (``hf://``) is read through
    it unless ``cache=False``; then,
    and for every other store (``s3://``), it is read where it lives (tensor bytes by ranged reads,
    no local copy; objects with a listed digest front to back, checked). ``pickles``: a cached
    folder holding pickle weights only is downloaded (never read by range).

    Also the way to read any location as a folder (a LoRA adapter, a config folder): the result is
    a local path, or a :class:`~shardkit.sources.ranged.RangedCheckpoint` whose ``root`` holds every
    file but the weights (``side_files``) and whose ``open_file`` reads a weight file by range.
    """
    path = os.fspath(source) if isinstance(source, (str, os.PathLike)) else None
    row = location(path) if path is not None else None
    if path is None or row is None:
        if not cache:
            shown = path if path is not None else f"a {type(source).__name__}"
            raise InvalidInputError(Option("cache", False),
                                    f" applies to an hf://ORG/REPO source, not to {shown}; drop it")
        yield source
        return
    if path.endswith(".gguf"):  # by range; whole (a split's every part) where a listed digest is checked
        from ..sources.gguf import remote_gguf
        from ..stores.gguf_fetch import fetched_gguf

        with fetched_gguf(path, token=token) if row.digests and cache else remote_gguf(path, token=token) as local:
            yield local
        return
    if row.cached is not None and (cache or (row.names_a_file is not None and row.names_a_file(path))):
        if not cache:
            raise InvalidInputError(f"{path}: ", Option("cache", False),
                                    " streams a repository folder; for one file, drop ", Option("cache", False), " "
                                    f"(or stream its folder: {path.rpartition('/')[0]})")
        with row.cached(path, token=token, pickles=pickles) as local:
            yield local
        return
    from .stores import store_checkpoint

    with store_checkpoint(path, side_files=True, token=token, checked=True) as ranged:  # a split copies them
        yield ranged


@contextlib.contextmanager
def configs(path: str | os.PathLike[str] | None, *, token: str | None = None) -> Iterator[str | None]:
    """A config folder or file: itself; for a remote location its configs, tokenizers and schedulers
    (never weights), downloaded where its row can, else a folder of them from the header-only mirror."""
    row = location(path) if path is not None else None
    if path is None or row is None:
        yield None if path is None else os.fspath(path)
        return
    if row.configs is not None:
        with row.configs(os.fspath(path), token=token) as local:
            yield local
        return
    from .stores import store_mirror

    with store_mirror(os.fspath(path), token=token) as mirror:
        yield mirror.root


@contextlib.contextmanager
def headers(path: str | os.PathLike[str], *, token: str | None = None) -> Iterator[str]:
    """A checkpoint to plan from without its tensor data: itself, or for a remote location a header-only mirror."""
    if location(path) is None:
        yield os.fspath(path)
        return
    from .stores import store_mirror

    with store_mirror(os.fspath(path), token=token) as mirror:
        yield mirror.root
