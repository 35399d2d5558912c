"""An ``s3://BUCKET/PREFIX`` checkpoint for the local stages: its header-only mirror, and its tensor bytes by range.

A header-only mirror (:func:`shardkit.stores.mirror.build_header_mirror`) in a temporary folder
gives the local ``info``/``verify``/``plan``/``fit`` everything they check: every header, the
index, the manifest, the configs and each object's true size. Tensor bytes are never fetched for
those: a sharded checkpoint costs one 64 KiB ranged GET per shard plus its small JSON files.
:func:`store_checkpoint` adds the bytes: a :class:`~shardkit.sources.ranged.RangedCheckpoint`
over the mirror whose safetensors files read through :class:`~shardkit.stores.RemoteObject`
(parallel ranged GETs straight into the caller's memory), what ``split``/``convert`` and
``shardkit.open`` read. Errors name the URL, not the temporary folder.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator

from ..checking.info import CheckpointInfo
from ..checking.verify import VerifyReport
from ..errors import InvalidInputError, SourceNotFoundError
from ..formats.layout import MODEL_INDEX
from ..formats.names import is_config_file
from ..formats.ranges import RangeFile
from ..formats.suffixes import CHECKPOINT_SUFFIXES, MANIFEST_FILE
from ..sources.base import CheckpointSource
from ..sources.ranged import RangedCheckpoint
from ..stores import ObjectStore, RemoteObject, is_store_url, list_folder, open_store, parse_store_url
from ..stores.mirror import HeaderMirror, build_header_mirror
from ..units import ProgressCallback

__all__ = ["mirrored", "store_checkpoint", "store_info", "store_mirror", "store_verify"]

logger = logging.getLogger("shardkit")

WEIGHTS = (*CHECKPOINT_SUFFIXES, ".gguf", ".msgpack", ".h5", ".onnx")  # never fetched whole as side files
SIDE_FILE_BYTES = 2 << 30  # one side file (a tokenizer, a README, an image) fetched whole at most
SIDE_FILES_BYTES = 8 << 30  # all of them together


def _is_small_side_file(name: str) -> bool:
    """Configs, indexes and the integrity manifest: what the checks read besides the headers."""
    return is_config_file(name) or name.rpartition("/")[2] == MANIFEST_FILE


@contextlib.contextmanager
def mirrored(path: str, *, side_files: bool = False) -> Iterator[tuple[HeaderMirror, ObjectStore]]:
    """The header-only mirror of ``path`` and its open store; errors inside name the URL; both gone on exit.

    ``side_files``: also every other object that is not a weight (tokenizers, schedulers, READMEs),
    whole: what a split or convert copies, and what a pipeline's loaders and a full verify read besides
    the weights. One over ``SIDE_FILE_BYTES`` is refused in one line naming it, never left out.
    """
    from ..hub.remote import renamed_errors

    url = parse_store_url(path)
    tmp = tempfile.mkdtemp(prefix="shardkit-s3-")
    root = os.path.join(tmp, url.bucket)
    try:
        os.mkdir(root)
        with open_store(url, check_bucket=False) as store:  # list_folder is the first request
            objects = list_folder(store)
            if side_files:  # each fetched in 256 MiB pieces at most: memory stays bounded, /tmp holds them
                mirror = build_header_mirror(store, root, objects, whole=lambda name: not name.endswith(WEIGHTS),
                                             max_whole_bytes=SIDE_FILE_BYTES, max_whole_total_bytes=SIDE_FILES_BYTES)
            else:
                mirror = build_header_mirror(store, root, objects, whole=_is_small_side_file)
            logger.debug("%s: header-only mirror, %d bytes fetched", url, mirror.fetched_bytes)
            with renamed_errors(root, str(url)):
                yield mirror, store
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def store_mirror(path: str) -> Iterator[HeaderMirror]:
    """The header-only mirror of ``s3://BUCKET/PREFIX`` in a temporary folder, removed on exit."""
    with mirrored(path) as (mirror, _):
        yield mirror


@contextlib.contextmanager
def store_checkpoint(path: str, *, side_files: bool = False) -> Iterator[RangedCheckpoint]:
    """``s3://BUCKET/PREFIX`` as a checkpoint the local stages read: the header-only mirror, each
    safetensors file's tensor bytes fetched by ranged GETs from its object (no temporary copy).

    with store_checkpoint("s3://models/sd15/unet") as source:
        shardkit.split(source, "out/", max_shard_size="2GB")
    """
    with mirrored(path, side_files=side_files) as (mirror, store):
        _check_has_safetensors(mirror, str(store.url))
        _drop_loose_weights(mirror, str(store.url))

        def open_file(local: str) -> RangeFile:
            name = os.path.relpath(local, mirror.root).replace(os.sep, "/")
            found = mirror.objects.get(name)
            if found is None or name not in mirror.prefix_bytes:
                raise SourceNotFoundError(f"{store.url}: {name} is not a safetensors object of this prefix")
            return RemoteObject(store, found)

        yield RangedCheckpoint(mirror.root, open_file, name=str(store.url))


def _check_has_safetensors(mirror: HeaderMirror, shown: str) -> None:
    """A prefix holding other weights only (pickles, GGUF) is refused by name: only safetensors are read by range."""
    if mirror.prefix_bytes:
        return
    others = sorted(n for n in mirror.objects if n.endswith(CHECKPOINT_SUFFIXES))
    if others:
        raise InvalidInputError(f"{shown}: holds {', '.join(others[:3])}{' ...' if len(others) > 3 else ''}, not "
                                "safetensors weights; only safetensors are read from a bucket (download the "
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
        warn(f"{shown}: left out {', '.join(loose)} (weights outside the pipeline's components are not read from "
             "a bucket; copy them separately)")


def store_info(path: str) -> CheckpointInfo:
    """:func:`shardkit.info` of ``s3://BUCKET/PREFIX`` from its headers; ``shared_bytes`` are None."""
    from ..checking.info import info

    with store_mirror(path) as mirror:
        summary = info(mirror.root)
        summary.path = str(parse_store_url(path))
        for part in [summary, *summary.components.values()]:
            part.shared_bytes = None
            for shard in part.shards:
                shard.shared_bytes = None
        return summary


def store_verify(path: str | os.PathLike[str], *, against: CheckpointSource | None = None,
                 progress: ProgressCallback | None = None) -> VerifyReport:
    """:func:`shardkit.verify` where ``path`` or ``against`` is ``s3://BUCKET/PREFIX``.

    ``s3://`` alone: its structure without tensor data (index against headers and object sizes).
    With ``against`` on either side: the local checks run on the header-only mirror and every
    safetensors object is read by ranged GETs (each byte once) and compared tensor by tensor, and
    with the manifest where there is one, as for a local folder. An ``hf://`` reference is streamed.
    """
    from ..checking.verify import verify

    if against is None:
        with store_mirror(os.fspath(path)) as mirror:
            report = verify(mirror.root, read_data=False)
            report.path = str(parse_store_url(os.fspath(path)))
            return report
    with store_checkpoint(os.fspath(path), side_files=True) if is_store_url(path) else \
            contextlib.nullcontext(path) as checked:
        report = verify(checked, against=against, progress=progress)
        report.path = os.fspath(path)
        return report
