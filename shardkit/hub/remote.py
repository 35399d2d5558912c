"""Hub repositories as sources: ``hf://ORG/REPO[@REVISION][/SUBFOLDER]``, read header by header.

A remote checkpoint is materialized as a *header-only mirror*: a temporary local folder where
index, config and ``model_index.json`` files are downloaded whole (through the Hugging Face
cache) and each ``.safetensors`` file is a sparse file of its true size holding only its real
header (its first ``8 + N`` bytes, fetched with HTTP range requests); the rest is a hole.

Why a mirror rather than a file-object abstraction threaded through the readers: every local
code path (``info``, ``fit``, ``plan``, the structural half of ``verify``) reads exactly headers,
index/config files and file sizes, so they run unchanged on the mirror, with their validation,
their error messages and their output format; nothing below ``hub`` learns about HTTP. The
sparse holes cost no disk, and tensor data is never read by these commands.

Pickle weights are never mirrored or fetched: a folder that holds only pickles is refused with
the name of the file that would have to be downloaded.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ..errors import HeaderError, HubError, InvalidInputError, ShardkitError
from ..formats.header import MAX_HEADER_BYTES
from ..formats.layout import MODEL_INDEX
from ..formats.links import OutsideFolderError, read_regular
from ..formats.names import is_config_file
from ..formats.suffixes import PICKLE_SUFFIXES
from ..units import format_size
from .remote_errors import RETRIES, hub_read_errors
from .remote_spec import Mirror, RemoteFile, RemoteSpec, check_listed, check_listing, is_remote, local_path, parse_spec

if TYPE_CHECKING:
    from huggingface_hub import HfApi
    
    from ..checking.info import CheckpointInfo

logger = logging.getLogger("shardkit")

FIRST_RANGE_BYTES = 64 * 1024  # most headers fit; a larger one costs exactly one more request
MAX_FETCHED_FILE_BYTES = 10_000_000  # configs and indexes; a bigger .json is not one of them
# Weight formats never mirrored or downloaded implicitly: pickles (safety), Flax, TF, ONNX, GGUF (not torch).
NOT_DOWNLOADED = (*(f"*{suffix}" for suffix in PICKLE_SUFFIXES), "*.msgpack", "*.h5", "*.onnx", "*.gguf", "*.ot")
RETRY_WAIT_SECONDS = 0.25
_FETCH_THREADS = 8
DIRECT_CHUNK_BYTES = 16 << 20


@contextlib.contextmanager
def open_mirror(spec: RemoteSpec | str, *, token: str | None = None, side_files: bool = False) -> Iterator[Mirror]:
    """Materialize a header-only mirror of ``spec`` in a temporary folder, removed on exit.

    Args:
        spec: ``hf://...`` text or a :class:`RemoteSpec`.
        token: a Hub token; default ``HF_TOKEN`` or the stored login (``HF_ENDPOINT`` is respected).
        side_files: also fetch every other file that is not a weight file (tokenizers, schedulers,
            READMEs), whole and without the HF cache: the mirror is then a complete folder
            whose safetensors data alone is missing (what a streamed split copies beside its shards).

    Returns:
        A context manager yielding a :class:`Mirror`. Errors raised inside name ``spec``, not
        the temporary folder.

    with open_mirror("hf://org/model") as m:
        shardkit.info(m.root).parameter_count
    """
    spec = parse_spec(spec) if isinstance(spec, str) else spec
    tmp = tempfile.mkdtemp(prefix="shardkit-remote-")
    root = os.path.join(tmp, spec.repo_id.replace("/", "--"))
    try:
        with hub_read_errors(spec), renamed_errors(root, str(spec)):
            mirror = _build_mirror(spec, root, token=token, side_files=side_files)
            logger.debug("%s: header-only mirror at %s, %d bytes transferred", spec, root, mirror.transferred_bytes)
            yield mirror
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _build_mirror(spec: RemoteSpec, root: str, *, token: str | None, side_files: bool) -> Mirror:
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    commit = resolve_commit(api, spec)
    files = list_files(api, spec, commit)
    os.makedirs(root, exist_ok=True)
    mirror = Mirror(spec, root, commit, files)
    check_not_pickle_only(mirror)
    weights = [f for rel, f in files.items() if rel.endswith(".safetensors")]
    if side_files:
        fetched = [f for f in files.values() if f not in weights and not _fnmatch_any(f.path, NOT_DOWNLOADED)]
        fetch = _fetch_direct
    else:
        fetched = [f for rel, f in files.items() if is_config_file(rel) and f.size_bytes <= MAX_FETCHED_FILE_BYTES]
        fetch = _fetch_whole
    with ThreadPoolExecutor(_FETCH_THREADS) as pool:
        jobs = [pool.submit(fetch, mirror, f, token) for f in fetched]
        jobs += [pool.submit(_fetch_header_file, mirror, f, token) for f in weights]
        for job in jobs:
            job.result()
    return mirror


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


def check_not_pickle_only(mirror: Mirror) -> None:
    """Refuse a folder (or a pipeline component) whose weights are pickles only: never fetch one implicitly."""
    folders = {""}
    if MODEL_INDEX in mirror.files:
        folders |= {rel.split("/")[0] for rel in mirror.files if "/" in rel}
    for folder in sorted(folders):
        inside = [f for rel, f in mirror.files.items() if rel.rpartition("/")[0] == folder]
        if any(f.path.endswith(".safetensors") for f in inside):
            continue
        pickles = sorted((f for f in inside if f.path.endswith(PICKLE_SUFFIXES)), key=lambda f: f.path)
        if pickles:
            names = ", ".join(f"{f.path} ({format_size(f.size_bytes)})" for f in pickles[:3])
            more = f" and {len(pickles) - 3} more" if len(pickles) > 3 else ""
            raise InvalidInputError(
                f"{mirror.spec}: {folder + '/' if folder else ''} holds pickle weights only ({names}{more}); shardkit "
                f"reads only safetensors headers remotely and never downloads a pickle implicitly: download it "
                f"(hf download {mirror.spec.repo_id} {pickles[0].path}{_repo_type_flag(mirror.spec)}) and pass the local path")


def _repo_type_flag(spec: RemoteSpec) -> str:
    return "" if spec.repo_type == "model" else f" --repo-type {spec.repo_type}"  # the `hf download` command's flag


def _write_new(mirror: Mirror, remote: RemoteFile, chunks: Iterator[bytes], *, size_bytes: int | None = None) -> None:
    """Write ``chunks`` to ``remote``'s place in the mirror: the file is created only once the first chunk
    has arrived (never through a link, never over an existing file) and removed if any later one fails;
    ``size_bytes`` extends it with a hole (a header-only stand-in)."""
    path = local_path(mirror, remote)
    fd = None
    try:
        for chunk in chunks:
            if fd is None:
                fd = _create(path)
            _write_all(fd, chunk, path)
        if fd is None:
            fd = _create(path)
        if size_bytes is not None:
            os.ftruncate(fd, size_bytes)
    except BaseException:
        if fd is not None:
            os.close(fd)
            fd = None
            with contextlib.suppress(OSError):
                os.unlink(path)
        raise
    finally:
        if fd is not None:
            os.close(fd)


def _create(path: str) -> int:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)


def _write_all(fd: int, data: bytes, path: str) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(f"{path}: short write")
        view = view[n:]


def _fetch_whole(mirror: Mirror, remote: RemoteFile, token: str | None) -> None:
    """A config or index file, through the Hugging Face cache (``hf_hub_download``)."""
    from huggingface_hub import hf_hub_download

    cached = hf_hub_download(mirror.spec.repo_id, remote.path, revision=mirror.commit, token=token,
                             repo_type=mirror.spec.repo_type)
    _write_new(mirror, remote, iter([read_regular(cached, max_bytes=MAX_FETCHED_FILE_BYTES)]))
    mirror.count(remote.size_bytes)


def _fetch_direct(mirror: Mirror, remote: RemoteFile, token: str | None) -> None:
    """A whole file by range reads straight into the mirror (not through the HF cache)."""
    chunks = (read_range(mirror, remote, begin, min(begin + DIRECT_CHUNK_BYTES, remote.size_bytes), token=token)
              for begin in range(0, remote.size_bytes, DIRECT_CHUNK_BYTES))
    _write_new(mirror, remote, chunks)


def _fnmatch_any(path: str, patterns: tuple[str, ...]) -> bool:
    """True when the file name of ``path`` matches one of ``patterns``."""
    from fnmatch import fnmatch

    return any(fnmatch(path.rpartition("/")[2], p) for p in patterns)


def _fetch_header_file(mirror: Mirror, remote: RemoteFile, token: str | None) -> None:
    """A sparse local stand-in: the real header (and the rest of its first range), then a hole up to
    the file's true size. The real bytes are counted in ``mirror.prefix_bytes``: a streamed read
    starts after them, so no byte is fetched twice."""
    raw = fetch_prefix(mirror, remote, token=token)
    _write_new(mirror, remote, iter([raw]), size_bytes=remote.size_bytes)
    with mirror.lock:
        mirror.prefix_bytes[remote.path] = len(raw)


def fetch_prefix(mirror: Mirror, remote: RemoteFile, *, token: str | None) -> bytes:
    """The first bytes of a remote safetensors file, its whole ``8 + N``-byte header at least: one
    range request of ``FIRST_RANGE_BYTES``, two if the header is larger.

    Raises:
        HeaderError: the length prefix is impossible for the file's listed size, or the server
            sent fewer bytes than asked.
    """
    where = f"{mirror.spec}:{remote.path}"
    if remote.size_bytes < 8:
        raise HeaderError(f"{where}: file is {remote.size_bytes} bytes, too short to be safetensors")
    first = read_range(mirror, remote, 0, min(FIRST_RANGE_BYTES, remote.size_bytes), token=token)
    (header_bytes,) = struct.unpack("<Q", first[:8])
    if header_bytes > MAX_HEADER_BYTES or header_bytes < 2 or 8 + header_bytes > remote.size_bytes:
        raise HeaderError(f"{where}: header length {header_bytes} is impossible for the {remote.size_bytes}-byte "
                          "file the Hub lists (corrupt upload, or not a safetensors file)")
    end = 8 + header_bytes
    if end <= len(first):
        return first
    return first + read_range(mirror, remote, len(first), end, token=token)


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


@contextlib.contextmanager
def renamed_errors(root: str, shown: str) -> Iterator[None]:
    """Errors from the local readers name the mirror's temporary folder: show the ``hf://`` spec instead.

    Only the text changes: the error keeps its type (a ``HeaderError`` stays one, a
    ``VerificationError`` keeps its exit code), so callers and the CLI treat it as before.
    """
    try:
        yield
    except ShardkitError as e:
        text = str(e)
        if root in text:
            e.args = (text.replace(root + os.sep, shown + "/").replace(root, shown),)
        raise


@contextlib.contextmanager
def local_checkpoint(path: str, *, token: str | None = None) -> Iterator[str]:
    """``path`` itself, or for ``hf://...`` the root of its header-only mirror (while the block runs).

    with local_checkpoint("hf://org/model", token=None) as folder:
        shardkit.fit(folder, gpu=["16GB", "16GB"])
    """
    if not is_remote(path):
        yield path
        return
    with open_mirror(path, token=token) as mirror:
        yield mirror.root


def remote_info(path: str, *, token: str | None = None) -> CheckpointInfo:
    """:func:`shardkit.info` of a Hub repository, from its headers, indexes and configs only.

    Args:
        path: ``hf://ORG/REPO[@REVISION][/SUBFOLDER]``.
        token: a Hub token; default ``HF_TOKEN`` or the stored login.

    Returns:
        A ``CheckpointInfo`` whose ``path`` is ``path``; ``shared_bytes`` are None (not local files).

    remote_info("hf://black-forest-labs/FLUX.1-dev").parameter_count
    """
    from ..checking.info import info

    with open_mirror(path, token=token) as mirror:
        summary = info(mirror.root)
        summary.path = str(mirror.spec)
        for part in [summary, *summary.components.values()]:
            part.shared_bytes = None
            for shard in part.shards:
                shard.shared_bytes = None
        return summary

