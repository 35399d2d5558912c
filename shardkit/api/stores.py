"""A checkpoint in a store (``s3://BUCKET/PREFIX``, ``hf://ORG/REPO``) for the local stages: its header-only
mirror, and its tensor bytes by range.

A header-only mirror (:func:`shardkit.stores.mirror.build_header_mirror`) in a temporary folder
gives the local ``info``/``verify``/``plan``/``fit`` everything they check: every header, the
index, the manifest, the configs and each object's true size. Tensor bytes are never fetched for
those: a sharded checkpoint costs one 64 KiB ranged GET per shard plus its small JSON files.
:func:`store_checkpoint` adds the bytes: a :class:`~shardkit.sources.ranged.RangedCheckpoint`
over the mirror whose safetensors files read through the one range-file opener, what
``split``/``convert``, ``shardkit.open`` and ``load_model`` read: parallel ranged reads straight
into the caller's memory (:class:`~shardkit.stores.RemoteObject`), or with ``checked=True``, for
objects whose store lists a digest (the Hub), each read front to back and checked against it
(:class:`~shardkit.stores.streamed.StreamedObjects`). Which store a location opens is
:func:`shardkit.stores.open_store`'s table; errors name the location, not the temporary folder.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator

from ..checking.info import CheckpointInfo
from ..errors import InvalidInputError, SourceNotFoundError
from ..formats.layout import MODEL_INDEX
from ..formats.names import is_config_file
from ..formats.ranges import RangeFile
from ..formats.suffixes import CHECKPOINT_SUFFIXES, MANIFEST_FILE
from ..sources.ranged import RangedCheckpoint
from ..stores import ObjectStore, RemoteObject, list_folder, open_store
from ..stores.mirror import HeaderMirror, build_header_mirror, check_not_pickle_only, renamed_errors

__all__ = ["mirrored", "store_checkpoint", "store_info", "store_mirror"]

logger = logging.getLogger("shardkit")

WEIGHTS = (*CHECKPOINT_SUFFIXES, ".gguf", ".msgpack", ".h5", ".onnx", ".ot")  # never fetched whole as side files
SIDE_FILE_BYTES = 2 << 30  # one side file (a tokenizer, a README, an image) fetched whole at most
SIDE_FILES_BYTES = 8 << 30  # all of them together


def _is_small_side_file(name: str) -> bool:
    """Configs, indexes and the integrity manifest: what the checks read besides the headers."""
    return is_config_file(name) or name.rpartition("/")[2] == MANIFEST_FILE


@contextlib.contextmanager
def mirrored(path: str, *, side_files: bool = False, token: str | None = None,
             ) -> Iterator[tuple[HeaderMirror, ObjectStore]]:
    """The header-only mirror of ``path`` and its open store; errors inside name the location; both gone on exit.

    ``side_files``: also every other object that is not a weight (tokenizers, schedulers, READMEs),
    whole: what a split or convert copies, and what a pipeline's loaders and a full verify read besides
    the weights. One over ``SIDE_FILE_BYTES`` is refused in one line naming it, never left out. A
    folder (or pipeline component) whose weights are pickles only is refused, naming the command
    that downloads one: a pickle is never fetched implicitly.
    """
    with open_store(path, token=token, check_bucket=False) as store:  # list_folder is the first request
        shown = str(store.url)
        tmp = tempfile.mkdtemp(prefix=f"shardkit-{store.url.scheme}-")
        root = os.path.join(tmp, store.url.bucket.replace("/", "--"))
        try:
            os.mkdir(root)
            with renamed_errors(root, shown):
                objects = list_folder(store)
                check_not_pickle_only(store, objects, download=store.download_command)
                if side_files:  # each fetched in 256 MiB pieces at most: memory stays bounded, /tmp holds them
                    mirror = build_header_mirror(store, root, objects, whole=lambda name: not name.endswith(WEIGHTS),
                                                 max_whole_bytes=SIDE_FILE_BYTES, max_whole_total_bytes=SIDE_FILES_BYTES)
                else:
                    mirror = build_header_mirror(store, root, objects, whole=_is_small_side_file)
                logger.debug("%s: header-only mirror, %d bytes fetched", shown, mirror.fetched_bytes)
                yield mirror, store
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def store_mirror(path: str, *, token: str | None = None) -> Iterator[HeaderMirror]:
    """The header-only mirror of a store's folder in a temporary folder, removed on exit."""
    with mirrored(path, token=token) as (mirror, _):
        yield mirror


@contextlib.contextmanager
def store_checkpoint(path: str, *, side_files: bool = False, token: str | None = None,
                     checked: bool = False) -> Iterator[RangedCheckpoint]:
    """A store's folder as a checkpoint the local stages read: the header-only mirror, each safetensors
    file's tensor bytes fetched by ranged reads from its object (no temporary copy).

    ``checked``: an object whose store lists a digest is read front to back and checked against it
    before the caller's write can commit (``split``/``convert`` with ``cache=False``); the others
    are read by parallel ranged requests where the readers ask.

    with store_checkpoint("s3://models/sd15/unet") as source:
        shardkit.split(source, "out/", max_shard_size="2GB")
    """
    from ..stores.streamed import StreamedObjects

    with mirrored(path, side_files=side_files, token=token) as (mirror, store):
        shown = str(store.url)
        _check_has_safetensors(mirror, shown)
        _drop_loose_weights(mirror, shown)
        digested = checked and any(o.digest for name, o in mirror.objects.items() if name in mirror.prefix_bytes)
        with StreamedObjects(store, mirror, stop=store.close) if digested else contextlib.nullcontext() as streams:

            def open_file(local: str) -> RangeFile:
                name = os.path.relpath(local, mirror.root).replace(os.sep, "/")
                found = mirror.objects.get(name)
                if found is None or name not in mirror.prefix_bytes:
                    raise SourceNotFoundError(f"{shown}: {name} is not a safetensors object of this folder")
                if streams is not None and found.digest is not None:
                    return streams.open_file(local)
                return RemoteObject(store, found)

            # streamed objects are read one request at a time, in order (their reader prefetches)
            yield RangedCheckpoint(mirror.root, open_file, name=shown, read_ahead=streams is None)


def _check_has_safetensors(mirror: HeaderMirror, shown: str) -> None:
    """A folder holding other weights only (GGUF, Flax) is refused by name: only safetensors are read by range."""
    if mirror.prefix_bytes:
        return
    others = sorted(n for n in mirror.objects if n.endswith(WEIGHTS))
    if others:
        raise InvalidInputError(f"{shown}: holds {', '.join(others[:3])}{' ...' if len(others) > 3 else ''}, not "
                                "safetensors weights; only safetensors are read remotely (download the "
                                "folder, then convert the local copy)")


def _drop_loose_weights(mirror: HeaderMirror, shown: str) -> None:
    """Remove the mirror's stand-ins (a header, then a hole) for safetensors objects outside a
    pipeline's components: a pipeline split copies such files as they are, and a stand-in must
    never be copied as if it were the object. Left out with a warning."""
    if MODEL_INDEX not in mirror.objects:
        return
    from ..formats.layout import find_components
    from ..sharding.options import warn

    inside = {os.path.realpath(c.path) for c in find_components(mirror.root)}
    loose = sorted(name for name in mirror.prefix_bytes
                   if os.path.realpath(os.path.dirname(os.path.join(mirror.root, name))) not in inside)
    for name in loose:
        os.remove(os.path.join(mirror.root, *name.split("/")))
        del mirror.prefix_bytes[name]
    if loose:
        warn(f"{shown}: left out {', '.join(loose)} (weights outside the pipeline's components are not read "
             "remotely; copy them separately)")


def store_info(path: str, *, token: str | None = None) -> CheckpointInfo:
    """:func:`shardkit.info` of a store's folder from its headers; ``shared_bytes`` are None."""
    from ..checking.info import info

    with mirrored(path, token=token) as (mirror, store):
        summary = info(mirror.root)
        summary.path = str(store.url)
        for part in [summary, *summary.components.values()]:
            part.shared_bytes = None
            for shard in part.shards:
                shard.shared_bytes = None
        return summary
