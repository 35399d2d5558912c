"""An ``hf://`` folder as a read-only :class:`~shardkit.stores.base.ObjectStore`: the second store behind one interface.

The repository is pinned to one commit when the store opens: every later read names it, so a push
in the meantime cannot mix two versions. ``list_objects`` and ``stat`` answer from the tree
listing (each file's entity tag is its LFS sha256 or git blob id). ``read_into`` is one ranged
GET through :func:`shardkit.hub.remote.read_range`, which checks the ``206`` reply and the byte
count and counts the bytes on the mirror record. The generic pieces then work on a repository:
:class:`~shardkit.stores.base.RemoteObject` (a ``RangeFile`` for the readers),
:func:`~shardkit.stores.base.read_ranges` and
:func:`~shardkit.stores.mirror.build_header_mirror`. Publishing goes through ``shardkit push``
(Hub commits, not multipart objects), so the writing half of the interface refuses in one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..errors import InvalidInputError, SourceNotFoundError
from ..stores.base import ObjectInfo, ObjectStore, ObjectWriter, PendingUpload
from ..stores.urls import StoreUrl
from .remote import list_files, read_range, resolve_commit
from .remote_errors import hub_read_errors
from .remote_spec import Mirror, RemoteSpec, parse_spec

__all__ = ["HfStore"]


class HfStore:
    """``hf://[datasets/]ORG/REPO[@REVISION][/SUBFOLDER]``, read by range at one commit."""

    def __init__(self, spec: RemoteSpec | str, *, token: str | None = None) -> None:
        from huggingface_hub import HfApi

        self.spec = parse_spec(spec) if isinstance(spec, str) else spec
        self._token = token
        api = HfApi(token=token)
        with hub_read_errors(self.spec):
            commit = resolve_commit(api, self.spec)
            files = list_files(api, self.spec, commit)
        self.mirror = Mirror(self.spec, "", commit, files)  # read_range's record: commit, byte counts
        repo = str(self.spec).removeprefix("hf://").removesuffix(self.spec.subfolder).rstrip("/")
        self.url = StoreUrl("hf", repo, self.spec.subfolder)

    def list_objects(self, folder: str = "") -> list[ObjectInfo]:
        inside = f"{folder}/" if folder else ""
        return [ObjectInfo(rel, f.size_bytes, f.sha256 or f.blob_id)
                for rel, f in sorted(self.mirror.files.items()) if rel.startswith(inside)]

    def stat(self, name: str) -> ObjectInfo:
        remote = self.mirror.files.get(name)
        if remote is None:
            raise SourceNotFoundError(f"{self.spec}: no file {name!r} at commit {self.mirror.commit[:12]}")
        return ObjectInfo(name, remote.size_bytes, remote.sha256 or remote.blob_id)

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        remote = self.mirror.files.get(name)
        if remote is None:
            raise SourceNotFoundError(f"{self.spec}: no file {name!r} at commit {self.mirror.commit[:12]}")
        with hub_read_errors(self.spec):
            out[:] = read_range(self.mirror, remote, offset, offset + len(out), token=self._token)

    def _read_only(self) -> InvalidInputError:
        return InvalidInputError(f"{self.spec}: an hf:// folder is read here; publish to it with shardkit push")

    def put(self, name: str, data: bytes) -> ObjectInfo:
        raise self._read_only()

    def writer(self, name: str) -> ObjectWriter:
        raise self._read_only()

    def delete(self, names: Sequence[str]) -> None:
        raise self._read_only()

    def pending_uploads(self) -> list[PendingUpload]:
        return []

    def abort(self, upload: PendingUpload) -> None:
        raise self._read_only()

    @property
    def transferred_bytes(self) -> int:
        return self.mirror.transferred_bytes

    def close(self) -> None:
        pass  # huggingface_hub owns its connections

    def __enter__(self) -> HfStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if TYPE_CHECKING:  # mypy checks that HfStore is an ObjectStore
    def _is_an_object_store(store: HfStore) -> ObjectStore:
        return store
