"""A GGUF file in a store (``s3://BUCKET/PATH/NAME.gguf``, ``hf://ORG/REPO[@REV]/PATH/NAME.gguf``) for the local readers.

GGUF is read locally (its header parsed from the file, its tensors by ``pread``, a split's other parts found beside
the first), so the file is fetched whole into a temporary folder, removed on exit: for the first part of llama.cpp's
gguf-split layout (``NAME-00001-of-0000N.gguf``, ``split.count`` N in its header), every part. Each object is read
through the store's ranged reads (:func:`~shardkit.stores.read_ranges`, parallel, :data:`FETCH_BYTES` of memory at
most) from the version listed, and where the store lists a sha256 (the Hub's LFS files) checked against it.
Errors name the location, never the temporary folder. Costs: 1× the GGUF on the local disk.

``headers_only`` (what ``info`` needs) fetches each file's header alone (parsed through buffered ranged reads, at
most the header's bounds) into a sparse file of the object's size: the header, then a hole.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..errors import InvalidInputError, SourceNotFoundError, StoreError
from ..formats.gguf import read_gguf, read_gguf_from
from ..formats.gguf_split import MAX_SPLITS, SPLIT_NAME, part_name, split_count
from . import ObjectInfo, ObjectStore, RangeRequest, RemoteObject, open_store, read_ranges
from .mirror import renamed_errors

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

__all__ = ["FETCH_BYTES", "fetched_gguf", "names_a_gguf"]

FETCH_BYTES = 64 << 20  # bytes of an object held at once while it is fetched
HEADER_READ_BYTES = 1 << 20  # one ranged request while a header is parsed


def names_a_gguf(path: str) -> bool:
    """Whether the location ``path`` names one ``.gguf`` file.

    >>> names_a_gguf("s3://models/llama/model-q8_0.gguf"), names_a_gguf("hf://org/model")
    (True, False)
    """
    return path.endswith(".gguf")


@contextlib.contextmanager
def fetched_gguf(path: str, *, token: str | None = None, headers_only: bool = False) -> Iterator[str]:
    """The GGUF ``path`` (and a split's every part) in a temporary folder: the local path of the file named.

    with fetched_gguf("s3://models/llama/model-00001-of-00003.gguf") as local:
        shardkit.convert(local, "llama/", dtype="bf16")

    Raises:
        SourceNotFoundError: the file, or a part of its split, is not in the store.
        StoreError: an object changed while it was fetched, or its bytes differ from the digest the store lists.
    """
    folder, _, name = path.rpartition("/")
    if not names_a_gguf(name) or "://" not in folder:
        raise InvalidInputError(f"{path}: expected a store location naming a .gguf file (s3://BUCKET/PATH/NAME.gguf or "
                                "hf://ORG/REPO/PATH/NAME.gguf)")
    tmp = tempfile.mkdtemp(prefix="shardkit-gguf-")
    try:
        with open_store(folder, token=token, check_bucket=False) as store, renamed_errors(tmp, folder):
            listed = {o.name: o for o in store.list_objects() if o.name.endswith(".gguf") and "/" not in o.name}
            fetch = _fetch_header if headers_only else _fetch
            local = fetch(store, listed, name, tmp)
            match = SPLIT_NAME.fullmatch(name)
            count = split_count(read_gguf(local))
            if count > 1 and match is not None and int(match.group(2)) == 1 and count <= MAX_SPLITS:
                for number in range(2, count + 1):  # one missing is named by the split reader, as for a local split
                    with contextlib.suppress(SourceNotFoundError):
                        fetch(store, listed, part_name(match.group(1), number, count), tmp)
            yield local
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _listed(store: ObjectStore, listed: dict[str, ObjectInfo], name: str) -> ObjectInfo:
    info = listed.get(name)
    if info is None:
        raise SourceNotFoundError(f"{store.url.child(name)}: no such object (check the name; a split GGUF is named by "
                                  "its first part, NAME-00001-of-0000N.gguf)")
    return info


def _fetch(store: ObjectStore, listed: dict[str, ObjectInfo], name: str, folder: str) -> str:
    """Object ``name`` of the store's folder into ``folder``, checked against its listed sha256 where there is one."""
    info = _listed(store, listed, name)
    local = os.path.join(folder, name)
    digest = hashlib.sha256()
    buffer = bytearray(min(FETCH_BYTES, info.size_bytes))
    fd = os.open(local, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for offset in range(0, info.size_bytes, FETCH_BYTES):
            view = memoryview(buffer)[: min(FETCH_BYTES, info.size_bytes - offset)]
            read_ranges(store, [RangeRequest(info.name, offset, view)])
            digest.update(view)
            while view:
                view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    if info.digest is not None and info.digest[0] == "sha256" and info.digest[1] != digest.hexdigest():
        raise StoreError(f"{store.url.child(name)}: the bytes fetched have sha256 {digest.hexdigest()}, the store lists "
                         f"{info.digest[1]}; fetch it again")
    return local



class _RangeReader(io.RawIOBase):
    """A remote object as a raw binary stream (for :class:`io.BufferedReader`): each read one ranged request."""

    def __init__(self, remote: RemoteObject) -> None:
        self.remote, self.pos = remote, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        view = memoryview(buffer).cast("B")[: max(0, self.remote.size_bytes - self.pos)]
        self.remote.read_into(self.pos, view)
        self.pos += len(view)
        return len(view)


def _fetch_header(store: ObjectStore, listed: dict[str, ObjectInfo], name: str, folder: str) -> str:
    """Object ``name``'s GGUF header into a sparse file of its size in ``folder`` (the tensor data a hole)."""
    info = _listed(store, listed, name)
    remote = RemoteObject(store, info)
    with io.BufferedReader(_RangeReader(remote), buffer_size=HEADER_READ_BYTES) as reader:
        header = read_gguf_from(reader, remote.name, info.size_bytes)
    head = bytearray(header.data_start)
    read_ranges(store, [RangeRequest(info.name, 0, memoryview(head))])
    local = os.path.join(folder, name)
    fd = os.open(local, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        view = memoryview(head)
        while view:
            view = view[os.write(fd, view):]
        os.ftruncate(fd, info.size_bytes)
    finally:
        os.close(fd)
    return local
