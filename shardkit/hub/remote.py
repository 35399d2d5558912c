"""Hub repositories as sources: ``hf://ORG/REPO[@REVISION][/SUBFOLDER]``, read header by header.

A remote checkpoint is materialized as a *header-only mirror*: a temporary local folder where
index, config and ``model_index.json`` files are fetched whole and each ``.safetensors`` file is a
sparse file of its true size holding only its real header (its first ``8 + N`` bytes, fetched
with HTTP range requests); the rest is a hole. It is the one mirror of every remote store,
:func:`shardkit.stores.mirror.build_header_mirror`, run on the repository as a store
(:class:`~shardkit.hub.hf_store.HfStore`, pinned to one commit).

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
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..errors import InvalidInputError, ShardkitError
from ..formats.layout import MODEL_INDEX
from ..formats.names import is_config_file
from ..formats.suffixes import PICKLE_SUFFIXES
from ..stores.mirror import FIRST_RANGE_BYTES, build_header_mirror
from ..units import format_size
from .hf_store import HfStore, list_files, read_range, resolve_commit
from .remote_errors import hub_read_errors
from .remote_spec import MAX_REMOTE_FILE_BYTES, Mirror, RemoteSpec, is_remote, parse_spec

if TYPE_CHECKING:
    from ..checking.info import CheckpointInfo

__all__ = ["FIRST_RANGE_BYTES", "MAX_FETCHED_FILE_BYTES", "NOT_DOWNLOADED", "check_not_pickle_only", "list_files",
           "local_checkpoint", "open_mirror", "read_range", "remote_info", "renamed_errors", "resolve_commit"]

logger = logging.getLogger("shardkit")

MAX_FETCHED_FILE_BYTES = 10_000_000  # configs and indexes; a bigger .json is not one of them
# Weight formats never mirrored or downloaded implicitly: pickles (safety), Flax, TF, ONNX, GGUF (not torch).
NOT_DOWNLOADED = (*(f"*{suffix}" for suffix in PICKLE_SUFFIXES), "*.msgpack", "*.h5", "*.onnx", "*.gguf", "*.ot")


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
    """The generic header mirror (:func:`shardkit.stores.mirror.build_header_mirror`) over the repository
    as a store (:class:`~shardkit.hub.hf_store.HfStore`): the one mirror for ``hf://`` and ``s3://``."""
    store = HfStore(spec, token=token)
    mirror = store.mirror
    mirror.root = root
    os.makedirs(root, exist_ok=True)
    check_not_pickle_only(mirror)
    if side_files:  # every file but weights, whole: what a streamed split copies beside its shards
        whole = {rel for rel, f in mirror.files.items()
                 if not rel.endswith(".safetensors") and not _fnmatch_any(f.path, NOT_DOWNLOADED)}
        limits = {"max_whole_bytes": MAX_REMOTE_FILE_BYTES, "max_whole_total_bytes": MAX_REMOTE_FILE_BYTES}
    else:  # configs and indexes; a bigger one is not one of them
        whole = {rel for rel, f in mirror.files.items() if is_config_file(rel) and f.size_bytes <= MAX_FETCHED_FILE_BYTES}
        limits = {}
    built = build_header_mirror(store, root, store.list_objects(), whole=whole.__contains__, **limits)
    mirror.prefix_bytes.update({mirror.files[rel].path: n for rel, n in built.prefix_bytes.items()})
    return mirror


def _fnmatch_any(path: str, patterns: tuple[str, ...]) -> bool:
    """True when the file name of ``path`` matches one of ``patterns``."""
    from fnmatch import fnmatch

    return any(fnmatch(path.rpartition("/")[2], p) for p in patterns)


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

