"""An ``hf://`` folder as a read-only :class:`~shardkit.stores.base.ObjectStore`: the second store behind one interface.

The repository is pinned to one commit when the store opens: every later read names it, so a push
in the meantime cannot mix two versions. ``list_objects`` and ``stat`` answer from the tree
listing (each file's entity tag and digest are its LFS sha256 or git blob id, which the streamed
reader checks: :mod:`shardkit.stores.streamed`). ``read_into`` is one ranged GET through
:func:`read_range`, which checks the ``206`` reply and the byte count; the store counts the bytes.
The generic pieces then work on a repository:
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

from ..errors import HeaderError, HubError, InvalidInputError, Option, SourceNotFoundError
from ..formats.links import OutsideFolderError
from .base import ObjectInfo, ObjectStore, ObjectWriter, PendingUpload
from .hf_errors import RETRIES, HubCall, hub_errors
from .hf_spec import SCHEME, RemoteFile, RemoteSpec, check_listed, check_listing, parse_spec
from .urls import StoreUrl

if TYPE_CHECKING:
    from huggingface_hub import HfApi

__all__ = ["HfStore", "list_files", "read_call", "read_range", "resolve_commit"]

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



def read_call(spec: RemoteSpec) -> HubCall:
    """A read of ``spec``, as the error translator names it."""
    return HubCall("read", spec.repo_id, spec.revision or "main", shown=str(spec), subfolder=spec.subfolder)


def read_range(spec: RemoteSpec, commit: str, remote: RemoteFile, begin: int, end: int, *, token: str | None,
               stop: threading.Event | None = None) -> bytes:
    """Bytes ``[begin, end)`` of a remote file, retried on transient failures (huggingface_hub's backoff).

    A part of a file must come back as ``206 Partial Content``: a server that ignores ``Range``
    and sends the whole file (``200``) is refused before its body is read, since every window
    would download the whole file again. ``stop`` (when set) ends the retries: the reader was closed.
    """
    from huggingface_hub import constants, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, http_stream_backoff, httpx

    where = f"{spec}:{remote.path}"
    url = hf_hub_url(spec.repo_id, remote.path, revision=commit, repo_type=spec.repo_type)
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
                       "Range requests; use an endpoint (HF_ENDPOINT, proxy) that serves ranges, or drop ",
                       Option("cache", False))





class HfStore:
    """``hf://[datasets/]ORG/REPO[@REVISION][/SUBFOLDER]``, read by range at one commit.

    ``files`` is the tree listing (by path relative to the subfolder); each :class:`ObjectInfo`
    carries the digest the Hub lists for its file (the LFS sha256, or the git blob id of a small one).
    """

    def __init__(self, spec: RemoteSpec | str, *, token: str | None = None) -> None:
        from huggingface_hub import HfApi

        self.spec = parse_spec(spec) if isinstance(spec, str) else spec
        self._token = token
        self._lock = threading.Lock()
        self._stopping = threading.Event()  # set by close(): range reads retrying give up
        self.transferred_bytes = 0
        api = HfApi(token=token)
        with hub_errors(read_call(self.spec)):
            self.commit = resolve_commit(api, self.spec)
            self.files = list_files(api, self.spec, self.commit)
        repo = str(self.spec).removeprefix(SCHEME).removesuffix(self.spec.subfolder).rstrip("/")
        self.url = StoreUrl("hf", repo, self.spec.subfolder)

    def list_objects(self, folder: str = "") -> list[ObjectInfo]:
        inside = f"{folder}/" if folder else ""
        return [_info(rel, f) for rel, f in sorted(self.files.items()) if rel.startswith(inside)]

    def stat(self, name: str) -> ObjectInfo:
        return _info(name, self._file(name))

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        remote = self._file(name)
        with hub_errors(read_call(self.spec)):
            data = read_range(self.spec, self.commit, remote, offset, offset + len(out), token=self._token,
                              stop=self._stopping)
        with self._lock:
            self.transferred_bytes += len(data)
        out[:] = data

    def download_command(self, name: str) -> str:
        kind = "" if self.spec.repo_type == "model" else f" --repo-type {self.spec.repo_type}"  # `hf download`'s flag
        return f"hf download {self.spec.repo_id} {self._file(name).path}{kind}"

    def _file(self, name: str) -> RemoteFile:
        remote = self.files.get(name)
        if remote is None:
            raise SourceNotFoundError(f"{self.spec}: no file {name!r} at commit {self.commit[:12]}")
        return remote

    def _read_only(self) -> InvalidInputError:
        return InvalidInputError(f"{self.spec}: an hf:// folder is read here; publish to it with shardkit push")

    def put(self, name: str, data: bytes) -> ObjectInfo:
        raise self._read_only()

    def writer(self, name: str) -> ObjectWriter:
        raise self._read_only()

    def delete(self, names: Sequence[str]) -> None:
        if names:  # nothing to delete is no write (recover of a repository finds no leftovers)
            raise self._read_only()

    def pending_uploads(self) -> list[PendingUpload]:
        return []

    def abort(self, upload: PendingUpload) -> None:
        raise self._read_only()

    def close(self) -> None:
        self._stopping.set()  # huggingface_hub owns its connections

    def __enter__(self) -> HfStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _info(name: str, remote: RemoteFile) -> ObjectInfo:
    digest = ("sha256", remote.sha256) if remote.sha256 else ("git blob id", remote.blob_id)
    return ObjectInfo(name, remote.size_bytes, remote.sha256 or remote.blob_id, digest=digest)


if TYPE_CHECKING:  # mypy checks that HfStore is an ObjectStore
    def _is_an_object_store(store: HfStore) -> ObjectStore:
        return store
