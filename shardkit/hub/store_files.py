"""The objects of a store (``s3://BUCKET/PREFIX``) as files to push, read by range as they are sent.

A push from a bucket makes no local copy: each object is listed and filtered like a folder's
files (hidden names and shardkit's journals left out, ``include``/``exclude`` globs), and the
upload reads it through :class:`ObjectStream`, a seekable binary stream whose every read is one
ranged GET (:class:`~shardkit.stores.base.RemoteObject`, byte count checked, retried). A small
file (a config, an index) is read whole and sent as bytes.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from ..errors import InvalidInputError, Option
from ..formats.links import check_name
from ..stores.base import ObjectInfo, ObjectStore, RemoteObject

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

__all__ = ["READ_BYTES", "ObjectStream", "collect_store_files", "open_object"]

READ_BYTES = 8 << 20  # one ranged GET per buffer refill: the upload and the hash read 8 MiB at a time


class ObjectStream(io.RawIOBase):
    """One object of a store as a read-only, seekable raw stream (wrap it in ``io.BufferedReader``)."""

    def __init__(self, store: ObjectStore, info: ObjectInfo) -> None:
        super().__init__()
        self._object = RemoteObject(store, info)
        self._size_bytes = info.size_bytes
        self._pos = 0

    @property
    def name(self) -> str:
        return self._object.name

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size_bytes}[whence]
        if base + offset < 0:
            raise ValueError(f"{self.name}: negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: WriteableBuffer) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._size_bytes - self._pos))
        if n:
            self._object.read_into(self._pos, view[:n])
            self._pos += n
        return n


def open_object(store: ObjectStore, name: str, size_bytes: int) -> io.BufferedReader:
    """The object ``name`` as a buffered binary stream (each buffer refill one ranged GET of ``READ_BYTES``)."""
    return io.BufferedReader(ObjectStream(store, ObjectInfo(name, size_bytes)), buffer_size=READ_BYTES)


def collect_store_files(store: ObjectStore, *, include: list[str] | str | None = None,
                        exclude: list[str] | str | None = None) -> list[ObjectInfo]:
    """The objects a push sends: every object under the prefix but hidden names (a part starting
    with ``.``, shardkit's write journals among them) and shardkit temporaries, filtered by the globs."""
    from huggingface_hub.utils import filter_repo_objects

    listed = {o.name: o for o in store.list_objects()
              if not any(part.startswith(".") for part in o.name.split("/")) and ".shardkit-" not in o.name}
    chosen = list(filter_repo_objects(sorted(listed), allow_patterns=include, ignore_patterns=exclude))
    if not chosen:
        raise InvalidInputError(f"{store.url}: no objects to push (check the prefix and ", Option("include"), "/",
                                Option("exclude"), ")")
    for name in chosen:
        check_name(name, where=f"{store.url}: object to push")
    return [listed[name] for name in chosen]
