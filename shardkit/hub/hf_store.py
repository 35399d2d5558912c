"""An ``hf://`` folder as a read-only :class:`~shardkit.stores.base.ObjectStore`: the second store behind one interface.

The repository is pinned to one commit when the store opens: every later read names it, so a push
in the meantime cannot mix two versions. ``list_objects`` and ``stat`` answer from the tree
listing (each file's entity tag is its LFS sha256 or git blob id). ``read_into`` is one ranged
GET through :func:`read_range`, which checks the ``206`` reply and the byte
count and counts the bytes on the mirror record. The generic pieces then work on a repository:
:class:`~shardkit.stores.base.RemoteObject` (a ``RangeFile`` for the readers),
:func:`~shardkit.stores.base.read_ranges` and
:func:`~shardkit.stores.mirror.build_header_mirror`. Publishing goes through ``shardkit push``
(Hub commits, not multipart objects), so the writing half of the interface refuses in one line.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import HeaderError, HubError, InvalidInputError, SourceNotFoundError
from ..formats.links import OutsideFolderError
from ..stores.base import ObjectInfo, ObjectStore, ObjectWriter, PendingUpload
from ..stores.urls import StoreUrl
from .remote_errors import RETRIES, hub_read_errors
from .remote_spec import Mirror, RemoteFile, RemoteSpec, check_listed, check_listing, parse_spec

if TYPE_CHECKING:
    from huggingface_hub import HfApi

__all__ = ["HfStore", "list_files", "read_range", "resolve_commit"]

RETRY_WAIT_SECONDS = 0.25


def resolve_commit(api: HfApi, spec: RemoteSpec) -> str:
    """The commit ``spec``'s revision points at now: every later read names it, so a push meanwhile
    cannot mix two versions of the repository."""
    info = api.repo_info(spec.repo_id, repo_type=spec.repo_type, revision=spec.revision)
    return info.sha or spec.revision or "main"


def list_files(api: Any, spec: RemoteSpec, commit: str) -> dict[str, RemoteFile]:
    """Every file under the subfolder at ``commit`` (one paginated tree listing), by relative path."""
    from huggingface_hub.errors import EntryNotFoundError

    try:
        tree = api.list_repo_tree(spec.repo_id, spec.subfolder or None, recursive=True, revision=commit,
                                  repo_type=spec.repo_type)
        files = {}
        for item in tree:
            if hasattr(item, "size"):
                rel, size_bytes = check_listed(spec, item.path, item.size)
                if rel in files:
                    raise OutsideFolderError(f"{spec}: the Hub's file listing names {rel!r} twice; refused before "
                                             "anything was downloaded (check HF_ENDPOINT)")
                files[rel] = RemoteFile(item.path, size_bytes, item.blob_id, item.lfs.sha256 if item.lfs else None)
        check_listing(spec, list(files))
    except EntryNotFoundError as e:
        raise InvalidInputError(f"{spec}: no folder {spec.subfolder!r} in {spec.repo_id} at "
                                f"{spec.revision or 'main'}; check the path (see the repository's file list)") from e
    if spec.subfolder and not files:
        raise InvalidInputError(f"{spec}: no folder {spec.subfolder!r} in {spec.repo_id} at {spec.revision or 'main'}")
    return files



def read_range(mirror: Mirror, remote: RemoteFile, begin: int, end: int, *, token: str | None,
               stop: threading.Event | None = None) -> bytes:
    """Bytes ``[begin, end)`` of a remote file, retried on transient failures (huggingface_hub's backoff).

    A part of a file must come back as ``206 Partial Content``: a server that ignores ``Range``
    and sends the whole file (``200``) is refused before its body is read, since every window
    would download the whole file again. ``stop`` (when set) ends the retries: the reader was closed.
    """
    from huggingface_hub import constants, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, http_stream_backoff, httpx

    where = f"{mirror.spec}:{remote.path}"
    url = hf_hub_url(mirror.spec.repo_id, remote.path, revision=mirror.commit, repo_type=mirror.spec.repo_type)
    headers = {**build_hf_headers(token=token), "Range": f"bytes={begin}-{end - 1}"}
    whole = begin == 0 and end >= remote.size_bytes
    for attempt in range(RETRIES + 1):
        if stop is not None and stop.is_set():
            raise HubError(f"{where}: range read stopped: the source was closed")
        # A timeout (the client's default is none): a stalled transfer is retried, then one line, never a hang.
        with http_stream_backoff("GET", url, headers=headers, max_retries=RETRIES, base_wait_time=RETRY_WAIT_SECONDS,
                                 max_wait_time=2 * RETRY_WAIT_SECONDS,
                                 timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as response:
            _check_range_reply(response, where=where, begin=begin, end=end, whole=whole)
            try:  # caught inside: an error thrown into http_stream_backoff's generator breaks it
                data, cut = response.read(), None
            except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as e:
                data, cut = b"", e
        if cut is None:
            break
        if attempt == RETRIES:  # the body was cut every time: one line from describe_read_error
            raise cut
        time.sleep(RETRY_WAIT_SECONDS * 2**attempt)
    mirror.count(len(data))
    if len(data) != end - begin:
        raise HeaderError(f"{where}: asked for bytes {begin}-{end - 1}, got {len(data)} bytes "
                          "(the file is shorter than the Hub lists, or the transfer was cut)")
    return data


def _check_range_reply(response: Any, *, where: str, begin: int, end: int, whole: bool) -> None:
    """An error status raised as huggingface_hub raises it; a part of the file answered with anything
    but 206 refused in one line naming the reply."""
    from huggingface_hub.utils import hf_raise_for_status

    hf_raise_for_status(response)
    if response.status_code != 206 and not whole:
        length = response.headers.get("Content-Length", "unknown")
        raise HubError(f"{where}: asked for bytes {begin}-{end - 1} and the server answered {response.status_code} "
                       f"{response.reason_phrase or ''} with {length} bytes instead of 206 Partial Content: it ignores "
                       "Range requests; use an endpoint (HF_ENDPOINT, proxy) that serves ranges, or drop cache=False")





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
