"""A GGUF file in a store (``s3://BUCKET/PATH/NAME.gguf``, ``hf://ORG/REPO[@REV]/PATH/NAME.gguf``) for the local readers.

GGUF is parsed locally (its header from a file, a split's other parts found beside the first), so each file's header
is fetched into a temporary folder, removed on exit: for the first part of llama.cpp's gguf-split layout
(``NAME-00001-of-0000N.gguf``, ``split.count`` N in its header), every part's. Errors name the location, never the
temporary folder. Three ways, by what the caller reads:

- :func:`gguf_headers` (what ``convert``, ``shardkit.open_source`` and the GGUF readers use): each header is parsed
  through ranged reads of growing size (at most the header's bounds, :data:`~shardkit.formats.gguf.MAX_HEADER_BYTES`) and
  written as it arrives into a sparse file of the object's size (the header, then a hole); each tensor's bytes are
  then read by range from the object (:class:`RangedGguf`: one ranged request, or parallel parts of
  :data:`RANGE_PART_BYTES` for a larger read), never fetched whole. Costs: the headers on disk,
  the bytes read in memory.
- ``fetched_gguf(headers_only=True)`` (``info``): the same stand-ins, no tensor bytes.
- :func:`fetched_gguf` (``verify``, which reads every byte and reports each file's sha256, and the Hub's files
  read with the cache: the sha256 its LFS listing gives is checked against the whole file): every object through
  the store's ranged reads (parallel, :data:`FETCH_BYTES` of memory at most) from the version listed. Costs: 1× the
  GGUF on the local disk.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..errors import InvalidInputError, SourceNotFoundError, StoreError
from ..formats.gguf import read_gguf, read_gguf_from
from ..formats.gguf_split import MAX_SPLITS, SPLIT_NAME, part_name, split_count
from ..formats.links import write_fd
from ..formats.ranges import RangeFile
from . import ObjectInfo, ObjectStore, RangeRequest, RemoteObject, open_store, read_ranges
from .mirror import local_copy_error, renamed_errors

__all__ = ["FETCH_BYTES", "RangedGguf", "RemoteGguf", "fetched_gguf", "gguf_headers", "names_a_gguf"]

FETCH_BYTES = 64 << 20  # bytes of an object held at once while it is fetched
FIRST_HEADER_READ_BYTES = 64 << 10  # the first ranged request of a header (the fixed part, most tensor infos)
HEADER_READ_BYTES = 1 << 20  # the largest one while a header is parsed (a vocabulary is a few of them)
RANGE_PART_BYTES = 4 << 20  # a larger read of tensor bytes is cut into parallel requests of this size

_Fetch = Callable[[ObjectStore, dict[str, ObjectInfo], str, str], str]


def names_a_gguf(path: str) -> bool:
    """Whether the location ``path`` names one ``.gguf`` file.

    >>> names_a_gguf("s3://models/llama/model-q8_0.gguf"), names_a_gguf("hf://org/model")
    (True, False)
    """
    return path.endswith(".gguf")


@dataclass(frozen=True)
class RemoteGguf:
    """A GGUF in a store as :func:`gguf_headers` lays it out for the local readers.

    Attributes:
        local: the stand-in of the file named (a split's first part): its header, then a hole.
        root: the temporary folder holding every part's stand-in.
        folder: the store folder ``root`` stands for (what messages show).
        open_file: a stand-in's path → its object, read by range (:class:`RangedGguf`).
    """

    local: str
    root: str
    folder: str
    open_file: Callable[[str], RangeFile]


class RangedGguf:
    """One GGUF object as a :class:`~shardkit.formats.ranges.RangeFile`: a read of up to ``RANGE_PART_BYTES`` is one
    ranged request, a larger one parallel requests of that size (:func:`~shardkit.stores.read_ranges`); every
    read's byte count is checked by the store, every range against the object's size here."""

    def __init__(self, store: ObjectStore, info: ObjectInfo) -> None:
        self._store, self._info, self._one = store, info, RemoteObject(store, info)

    @property
    def name(self) -> str:
        return self._one.name

    @property
    def size_bytes(self) -> int:
        return self._info.size_bytes

    def read_into(self, offset: int, out: memoryview) -> None:
        if len(out) <= RANGE_PART_BYTES or offset < 0 or offset + len(out) > self._info.size_bytes:
            self._one.read_into(offset, out)  # one request; a range past the end is refused there, naming it
            return
        read_ranges(self._store, [RangeRequest(self._info.name, offset, out)], part_bytes=RANGE_PART_BYTES)

    def close(self) -> None:
        pass  # the store owns the connections


@contextlib.contextmanager
def fetched_gguf(path: str, *, token: str | None = None, headers_only: bool = False) -> Iterator[str]:
    """The GGUF ``path`` (and a split's every part) in a temporary folder: the local path of the file named.

    with fetched_gguf("s3://models/llama/model-00001-of-00003.gguf") as local:
        shardkit.verify(local)

    Raises:
        SourceNotFoundError: the file, or a part of its split, is not in the store.
        StoreError: an object changed while it was fetched, or its bytes differ from the digest the store lists.
    """
    with _fetched(path, token=token, fetch=_fetch_header if headers_only else _fetch) as found:
        yield found[3]


@contextlib.contextmanager
def gguf_headers(path: str, *, token: str | None = None) -> Iterator[RemoteGguf]:
    """The GGUF ``path`` (a split's every part) as header stand-ins in a temporary folder, each tensor's bytes read
    by range from its object through :attr:`RemoteGguf.open_file` (nothing fetched whole).

    with gguf_headers("s3://models/llama/model-q8_0.gguf") as remote:
        part = remote.open_file(remote.local)   # a RangeFile over the object
    """
    with _fetched(path, token=token, fetch=_fetch_header) as (store, listed, tmp, local):
        folder = str(store.url)

        def open_file(stand_in: str) -> RangeFile:
            name = os.path.basename(stand_in)
            info = listed.get(name)
            if info is None or os.path.dirname(os.path.abspath(stand_in)) != os.path.abspath(tmp):
                raise SourceNotFoundError(f"{folder}/{name}: not a GGUF file of this location (a split's parts are "
                                          "read from the first part's folder)")
            return RangedGguf(store, info)

        yield RemoteGguf(local, tmp, folder, open_file)


@contextlib.contextmanager
def _fetched(path: str, *, token: str | None,
             fetch: _Fetch) -> Iterator[tuple[ObjectStore, dict[str, ObjectInfo], str, str]]:
    """``(store, listed .gguf objects, temporary folder, local file named)``, each file (a split's every part)
    put there by ``fetch``; errors inside name the location."""
    folder, _, name = path.rpartition("/")
    if not names_a_gguf(name) or "://" not in folder:
        raise InvalidInputError(f"{path}: expected a store location naming a .gguf file (s3://BUCKET/PATH/NAME.gguf or "
                                "hf://ORG/REPO/PATH/NAME.gguf)")
    tmp = tempfile.mkdtemp(prefix="shardkit-gguf-")
    try:
        with open_store(folder, token=token, check_bucket=False) as store, renamed_errors(tmp, folder):
            listed = {o.name: o for o in store.list_objects() if o.name.endswith(".gguf") and "/" not in o.name}
            local = fetch(store, listed, name, tmp)
            match = SPLIT_NAME.fullmatch(name)
            count = split_count(read_gguf(local))
            if count > 1 and match is not None and int(match.group(2)) == 1 and count <= MAX_SPLITS:
                for number in range(2, count + 1):  # one missing is named by the split reader, as for a local split
                    with contextlib.suppress(SourceNotFoundError):
                        fetch(store, listed, part_name(match.group(1), number, count), tmp)
            yield store, listed, tmp, local
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _listed(store: ObjectStore, listed: dict[str, ObjectInfo], name: str) -> ObjectInfo:
    info = listed.get(name)
    if info is None:
        raise SourceNotFoundError(f"{store.url.child(name)}: no such object (check the name; a split GGUF is named by "
                                  "its first part, NAME-00001-of-0000N.gguf)")
    return info


def _write_all(fd: int, data: memoryview, offset: int, where: str) -> None:
    """``data`` written at ``offset`` of ``fd`` through the one checked loop: a write that writes nothing (or fails)
    is the stores' error naming ``where`` (never a loop that spins)."""
    try:
        write_fd(fd, data, path=where, offset=offset)
    except OSError as e:
        raise local_copy_error(where, e) from e


def _fetch(store: ObjectStore, listed: dict[str, ObjectInfo], name: str, folder: str) -> str:
    """Object ``name`` of the store's folder into ``folder``, checked against its listed sha256 where there is one."""
    info = _listed(store, listed, name)
    local, where = os.path.join(folder, name), str(store.url.child(name))
    digest = hashlib.sha256()
    buffer = bytearray(min(FETCH_BYTES, info.size_bytes))
    fd = os.open(local, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for offset in range(0, info.size_bytes, FETCH_BYTES):
            view = memoryview(buffer)[: min(FETCH_BYTES, info.size_bytes - offset)]
            read_ranges(store, [RangeRequest(info.name, offset, view)])
            digest.update(view)
            _write_all(fd, view, offset, where)
    finally:
        os.close(fd)
    if info.digest is not None and info.digest[0] == "sha256" and info.digest[1] != digest.hexdigest():
        raise StoreError(f"{where}: the bytes fetched have sha256 {digest.hexdigest()}, the store lists "
                         f"{info.digest[1]}; fetch it again")
    return local


class _HeaderStream:
    """A remote object read front to back for the header parser: requests of :data:`FIRST_HEADER_READ_BYTES`,
    doubling up to :data:`HEADER_READ_BYTES` (a small header costs one small request), each one's bytes also written
    at their offset into the local stand-in ``fd``. Memory: the bytes asked for and one request."""

    def __init__(self, remote: RangedGguf, fd: int) -> None:
        self.remote, self.fd = remote, fd
        self.fetched = 0  # bytes of the object fetched (and written) so far
        self.pending = memoryview(b"")  # fetched, not yet read
        self.step = FIRST_HEADER_READ_BYTES

    def read(self, n: int, /) -> bytes:
        if n > len(self.pending):
            wanted = min(self.remote.size_bytes - self.fetched, max(n - len(self.pending), self.step))
            self.step = min(HEADER_READ_BYTES, self.step * 2)
            more = memoryview(bytearray(wanted))
            self.remote.read_into(self.fetched, more)
            _write_all(self.fd, more, self.fetched, self.remote.name)
            self.fetched += wanted
            self.pending = memoryview(bytes(self.pending) + more) if self.pending else more
        data, self.pending = bytes(self.pending[:n]), self.pending[n:]
        return data


def _fetch_header(store: ObjectStore, listed: dict[str, ObjectInfo], name: str, folder: str) -> str:
    """Object ``name``'s GGUF header into a sparse file of its size in ``folder`` (the tensor data a hole), written
    as it is parsed: memory holds one read buffer and the parsed header, never the header's bytes again."""
    info = _listed(store, listed, name)
    remote = RangedGguf(store, info)
    local = os.path.join(folder, name)
    fd = os.open(local, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, info.size_bytes)
        stream = _HeaderStream(remote, fd)
        header = read_gguf_from(stream, remote.name, info.size_bytes)
        if stream.fetched < header.data_start:  # the padding before the data section (less than the alignment)
            rest = memoryview(bytearray(header.data_start - stream.fetched))
            remote.read_into(stream.fetched, rest)
            _write_all(fd, rest, stream.fetched, remote.name)
    finally:
        os.close(fd)
    return local
