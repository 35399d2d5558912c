"""A header-only local mirror of a remote folder: what ``info``, ``verify`` and ``plan`` read.

Each ``.safetensors`` object becomes a sparse local file of its true size: its real header (one
ranged GET of ``FIRST_RANGE_BYTES``, a second only for a larger header), then a hole. The objects
``whole`` picks (configs, indexes, the manifest) are fetched whole, up to ``MAX_WHOLE_BYTES``
each. Nothing else is fetched, so the local readers validate a multi-GB checkpoint from a few
hundred KB. Names come from the listing, which is untrusted. Each name is checked to be a plain
relative path before it becomes a local path, and files are created without following links and
never over an existing file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import struct
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ..errors import HeaderError, InvalidInputError, Part, ShardkitError, StoreError, join_parts
from ..formats.header import MAX_HEADER_BYTES, parse_header
from ..formats.links import write_fd
from ..formats.names import MODEL_INDEX
from ..formats.suffixes import PICKLE_SUFFIXES
from ..units import format_size
from .base import MAX_OBJECT_BYTES, ObjectInfo, ObjectStore, RangeRequest, read_ranges
from .urls import has_control_characters

__all__ = ["FIRST_RANGE_BYTES", "MAX_WHOLE_BYTES", "HeaderMirror", "build_header_mirror", "check_not_pickle_only",
           "local_copy_error", "renamed_errors"]

FIRST_RANGE_BYTES = 64 << 10  # most headers fit; a larger one costs exactly one more request
MAX_WHOLE_BYTES = 10_000_000  # a config, index or manifest; a bigger one is not one of them
MAX_WHOLE_TOTAL_BYTES = 100_000_000
MAX_MIRRORED_OBJECTS = 20_000
BATCH_BYTES = 256 << 20  # memory held at once while building the mirror (one header alone may be larger)


def _missing_of(missing: dict[str, int], item: ObjectInfo) -> int:
    return missing[item.name]


def _batches(items: list[ObjectInfo], size_of: Callable[[ObjectInfo], int]) -> Iterator[list[ObjectInfo]]:
    """``items`` in order, in groups whose sizes add up to at most ``BATCH_BYTES`` (or one item)."""
    batch: list[ObjectInfo] = []
    total = 0
    for item in items:
        if batch and total + size_of(item) > BATCH_BYTES:
            yield batch
            batch, total = [], 0
        batch.append(item)
        total += size_of(item)
    if batch:
        yield batch


@dataclass
class HeaderMirror:
    """The mirror at ``root``: every object listed, and how many bytes were fetched to build it."""

    root: str
    objects: dict[str, ObjectInfo] = field(default_factory=dict)
    fetched_bytes: int = 0
    prefix_bytes: dict[str, int] = field(default_factory=dict)  # real bytes at the start of each sparse file


def build_header_mirror(store: ObjectStore, root: str, objects: list[ObjectInfo], *,
                        whole: Callable[[str], bool], max_whole_bytes: int = MAX_WHOLE_BYTES,
                        max_whole_total_bytes: int = MAX_WHOLE_TOTAL_BYTES) -> HeaderMirror:
    """Write the header-only mirror of ``objects`` (from ``store.list_objects()``) into the empty folder ``root``.

    ``whole`` picks the objects fetched whole, each up to ``max_whole_bytes`` and together up to
    ``max_whole_total_bytes`` (larger limits for a mirror that carries every side file: a large
    object is then fetched ``BATCH_BYTES`` at a time, never held whole in memory).
    """
    if len(objects) > MAX_MIRRORED_OBJECTS:
        raise StoreError(f"{store.url}: {len(objects)} objects; a checkpoint folder has at most {MAX_MIRRORED_OBJECTS}")
    mirror = HeaderMirror(root, {o.name: o for o in objects})
    for o in objects:
        _local_path(store, root, o.name)  # every name and size checked before anything is fetched
        if not 0 <= o.size_bytes <= MAX_OBJECT_BYTES:
            raise StoreError(f"{store.url}/{o.name}: the listing gives it size {o.size_bytes}, outside 0 to "
                             f"{MAX_OBJECT_BYTES} bytes (S3's limit for one object); refused before mirroring anything")
    weights = [o for o in objects if o.name.endswith(".safetensors")]
    fetched = [o for o in objects if not o.name.endswith(".safetensors") and whole(o.name)]
    too_big = [o.name for o in fetched if o.size_bytes > max_whole_bytes]
    if too_big:
        raise InvalidInputError(f"{store.url.child(too_big[0])}: over {max_whole_bytes} bytes, too large to fetch "
                                "whole as a config, index or side file; move it out of the checkpoint's prefix")
    for o in weights:
        if o.size_bytes < 8:
            raise HeaderError(f"{store.url.child(o.name)}: {o.size_bytes} bytes, too short to be safetensors")
    if sum(o.size_bytes for o in fetched) > max_whole_total_bytes:
        raise InvalidInputError(f"{store.url}: configs, indexes and side files over {max_whole_total_bytes} bytes "
                                "in all; name a folder that holds one checkpoint")
    _fetch_whole(store, mirror, fetched)
    _fetch_headers(store, mirror, weights)
    return mirror


def _fetch_whole(store: ObjectStore, mirror: HeaderMirror, fetched: list[ObjectInfo]) -> None:
    for o in (o for o in fetched if o.size_bytes > BATCH_BYTES):
        _fetch_large(store, mirror, o)
    for batch in _batches([o for o in fetched if o.size_bytes <= BATCH_BYTES], lambda o: o.size_bytes):
        bodies = {o.name: bytearray(o.size_bytes) for o in batch}
        read_ranges(store, [RangeRequest(n, 0, memoryview(b)) for n, b in bodies.items()])
        for o in batch:
            _write_new(_local_path(store, mirror.root, o.name), bytes(bodies[o.name]), size_bytes=o.size_bytes)
            mirror.fetched_bytes += o.size_bytes


def _fetch_large(store: ObjectStore, mirror: HeaderMirror, o: ObjectInfo) -> None:
    """One object over ``BATCH_BYTES``, fetched and written ``BATCH_BYTES`` at a time (bounded memory)."""
    path = _local_path(store, mirror.root, o.name)
    body = bytearray(BATCH_BYTES)
    for begin in range(0, o.size_bytes, BATCH_BYTES):
        piece = memoryview(body)[:min(BATCH_BYTES, o.size_bytes - begin)]
        read_ranges(store, [RangeRequest(o.name, begin, piece)])
        _write_new(path, bytes(piece), size_bytes=begin + len(piece), append=begin > 0)
        mirror.fetched_bytes += len(piece)


def _fetch_headers(store: ObjectStore, mirror: HeaderMirror, weights: list[ObjectInfo]) -> None:
    for batch in _batches(weights, lambda o: min(FIRST_RANGE_BYTES, o.size_bytes)):
        firsts = {o.name: bytearray(min(FIRST_RANGE_BYTES, o.size_bytes)) for o in batch}
        read_ranges(store, [RangeRequest(n, 0, memoryview(b)) for n, b in firsts.items()])
        missing = {o.name: _header_end(store, o, firsts[o.name]) - len(firsts[o.name]) for o in batch}
        for rest_batch in _batches(batch, functools.partial(_missing_of, missing)):
            rests = {o.name: bytearray(missing[o.name]) for o in rest_batch}
            read_ranges(store, [RangeRequest(n, len(firsts[n]), memoryview(b)) for n, b in rests.items() if b])
            heads = {o.name: bytes(firsts[o.name] + rests[o.name]) for o in rest_batch}
            sizes = {o.name: _mirrored_size(store, o, heads[o.name]) for o in rest_batch}  # all checked first
            for o in rest_batch:
                head = heads[o.name]
                _write_new(_local_path(store, mirror.root, o.name), head, size_bytes=sizes[o.name])
                mirror.prefix_bytes[o.name] = len(head)
                mirror.fetched_bytes += len(head)


def _header_end(store: ObjectStore, info: ObjectInfo, first: bytearray) -> int:
    """Where the header ends (``8 + N``), checked against the object's listed size."""
    (header_bytes,) = struct.unpack("<Q", first[:8])
    if header_bytes > MAX_HEADER_BYTES or header_bytes < 2 or 8 + header_bytes > info.size_bytes:
        raise HeaderError(f"{store.url.child(info.name)}: header length {header_bytes} is impossible for the "
                          f"{info.size_bytes}-byte object (corrupt upload, or not a safetensors file)")
    return max(8 + int(header_bytes), len(first))


def _mirrored_size(store: ObjectStore, info: ObjectInfo, head: bytes) -> int:
    """The size of the sparse stand-in for ``info``: its listed size, checked against its header first.

    A listed size past the end the header declares is refused here, before a file is created (a
    listing claiming terabytes over a kilobyte header would otherwise make a terabyte sparse file).
    A shorter one is kept: the local checks report the truncated shard. A header that does not
    parse gets a stand-in of the header alone: the local checks report the header's own fault.
    """
    where = f"{store.url}/{info.name}"
    (header_bytes,) = struct.unpack("<Q", head[:8])  # checked by _header_end: the head holds all of it
    try:
        declared = parse_header(head[8:8 + header_bytes], path=where).file_bytes
    except HeaderError:
        return min(info.size_bytes, len(head))
    if info.size_bytes > declared:
        raise HeaderError(f"{where}: the listing gives it size {info.size_bytes} but its header's tensors end at "
                          f"byte {declared} (trailing data, or a listing that does not match the object); refused "
                          "before mirroring it: re-upload the shard, or remove what follows its tensors")
    return info.size_bytes


def _local_path(store: ObjectStore, root: str, name: str) -> str:
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts) or "\\" in name or "\0" in name or len(parts) > 32:
        raise StoreError(f"{store.url}: the listing holds {name!r}, not a plain relative path; refused")
    if has_control_characters(name):
        raise StoreError(f"{store.url}: the listing holds {name!r}, a name with control characters; refused (rename "
                         "or delete that object)")
    return os.path.join(root, *parts)


def _write_new(path: str, data: bytes, *, size_bytes: int, append: bool = False) -> None:
    """Create ``path`` (never through a link, never over a file), write ``data``, extend it to ``size_bytes``;
    ``append``: add ``data`` at the end of the file this mirror created before."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        flags = os.O_APPEND if append else os.O_CREAT | os.O_EXCL
        fd = os.open(path, os.O_WRONLY | flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:  # e.g. the listing holds both "a" and "a/b"
        raise StoreError(f"{path}: cannot mirror this object ({e.strerror}); the listing names it twice") from e
    try:
        write_fd(fd, data, path=path)
        os.ftruncate(fd, size_bytes)
    except OSError as e:
        raise local_copy_error(path, e) from e
    finally:
        os.close(fd)


def local_copy_error(where: str, e: OSError) -> StoreError:
    """A failed write of a store's local copy (the mirror's files, a fetched GGUF), naming ``where`` and the fix."""
    return StoreError(f"{where}: writing its local copy failed ({e.strerror or e}); free space in "
                      f"{tempfile.gettempdir()}, or point TMPDIR elsewhere")


def check_not_pickle_only(store: ObjectStore, objects: list[ObjectInfo], *, download: Callable[[str], str]) -> None:
    """Refuse a folder (or a pipeline component) whose weights are pickles only: never fetch one implicitly.

    ``download(name)`` is the command that fetches one object by hand (the store's own tool).
    """
    names = {o.name: o for o in objects}
    folders = {""}
    if MODEL_INDEX in names:
        folders |= {name.split("/")[0] for name in names if "/" in name}
    for folder in sorted(folders):
        inside = [o for name, o in names.items() if name.rpartition("/")[0] == folder]
        if any(o.name.endswith(".safetensors") for o in inside):
            continue
        pickles = sorted((o for o in inside if o.name.endswith(PICKLE_SUFFIXES)), key=lambda o: o.name)
        if pickles:
            listed = ", ".join(o.name for o in pickles[:3])
            sizes = ", ".join(f"{o.name} ({format_size(o.size_bytes)})" for o in pickles[:3])
            more = f" and {len(pickles) - 3} more" if len(pickles) > 3 else ""
            raise InvalidInputError(
                f"{store.url}: {folder + '/' if folder else ''}holds {listed}{more}, not safetensors weights: pickle "
                f"weights only ({sizes}{more}); shardkit reads only safetensors headers remotely and never downloads "
                f"a pickle implicitly: download it ({download(pickles[0].name)}) and pass the local path")


@contextlib.contextmanager
def renamed_errors(root: str, shown: str) -> Iterator[None]:
    """Errors from the local readers name the mirror's temporary folder: show the location instead.

    Only the text changes: the error keeps its type (a ``HeaderError`` stays one, a
    ``VerificationError`` keeps its exit code), so callers and the CLI treat it as before.
    """
    try:
        yield
    except ShardkitError as e:
        if root in str(e):
            e.parts = tuple(_renamed(part, root, shown) for part in e.parts)
            e.args = (join_parts(e.parts),)
        raise


def _renamed(part: Part, root: str, shown: str) -> Part:
    def rename(text: str) -> str:
        return text.replace(root + os.sep, shown + "/").replace(root, shown)

    if isinstance(part, str):
        return rename(part)
    if isinstance(part.value, (str, os.PathLike)) and root in os.fspath(part.value):
        return dataclasses.replace(part, value=rename(os.fspath(part.value)))
    return part
