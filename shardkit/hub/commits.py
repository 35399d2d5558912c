"""The local half of a push: which files go, whether the Hub accepts them, and how they compare.

Pure except for reading the local files: no network. :mod:`shardkit.hub` feeds it the remote
tree and turns the result into uploads and commits.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, BinaryIO

from ..errors import InvalidInputError, Option, ShardkitWarning, SourceNotFoundError
from ..formats.links import (
    LINK_RULE,
    OutsideFolderError,
    check_name,
    leads_outside,
    link_target,
    open_inside,
    open_regular,
)
from ..formats.names import MODEL_INDEX, is_index_file, is_manifest_file, parse_weight_name
from ..units import format_size

if TYPE_CHECKING:
    from ..stores.base import ObjectInfo, ObjectStore

MAX_FILE_BYTES = 50 * 10**9  # the Hub refuses larger files
WARN_FILE_BYTES = 20 * 10**9  # the Hub's recommended maximum
MAX_FILES_PER_COMMIT = 100  # the Hub's advice; larger pushes take several commits
_LEAVE_OUT = ("leave it out (", Option("exclude"), ")")  # how a refusal of one file names the way around it



@dataclass(frozen=True)
class LocalFile:
    path_in_repo: str
    local_path: str
    size_bytes: int
    link_target: str | None = None  # a symlink: where it leads (its contents are what is sent)
    root: str = ""  # the folder pushed ("" for a file named directly): every read is checked against it
    name: str = ""  # the path inside ``root`` (or the object's name under the store's prefix)
    store: ObjectStore | None = field(default=None, compare=False)  # set: an object of this store, read by range


@dataclass(frozen=True)
class FollowedLink:
    """A symlink a push follows: its path in the repo, its target, whether that lies outside the folder."""

    path_in_repo: str
    target: str
    outside: bool


@dataclass(frozen=True)
class RemoteFile:
    size_bytes: int
    blob_id: str  # git blob id (of the LFS pointer, for LFS files)
    lfs_sha256: str | None


def collect_files(path: str | os.PathLike[str], *, path_in_repo: str | None = None,
                  include: list[str] | str | None = None, exclude: list[str] | str | None = None) -> list[LocalFile]:
    """The files to push, with their paths in the repo; hidden files and shardkit temporaries are skipped."""
    from huggingface_hub.utils import filter_repo_objects

    root = os.fspath(path)
    if os.path.isfile(root):
        relative = [os.path.basename(root)]
        root = os.path.dirname(os.path.abspath(root))
    elif os.path.isdir(root):
        relative = sorted(_walk(root))
    else:
        raise SourceNotFoundError(f"{root}: no such file or folder to push")
    chosen = list(filter_repo_objects(relative, allow_patterns=include, ignore_patterns=exclude))
    if not chosen:
        raise InvalidInputError(f"{path}: no files to push (check ", Option("include"), "/", Option("exclude"), ")")
    prefix = clean_prefix(path_in_repo)
    return [_local_file(root, name, prefix, folder=os.path.isdir(path)) for name in chosen]


def store_files(store: ObjectStore, objects: list[ObjectInfo], *, path_in_repo: str | None = None) -> list[LocalFile]:
    """Objects of ``store`` (from :func:`shardkit.hub.store_files.collect_store_files`) as files to push."""
    prefix = clean_prefix(path_in_repo)
    return [LocalFile(f"{prefix}{o.name}", str(store.url.child(o.name)), o.size_bytes, name=o.name, store=store)
            for o in objects]


def _local_file(root: str, name: str, prefix: str, *, folder: bool = True) -> LocalFile:
    path = os.path.join(root, name)
    check_name(name, where=f"{root}: file to push")  # no control characters, newlines or '..' in a repo path
    target = link_target(path)
    if target is not None and (not os.path.isfile(target) or _special(target)):
        raise InvalidInputError(f"{path} is a symlink to {target}, which is not a regular file of a disk filesystem "
                                "(a device, /proc, /sys or missing); remove the link or ", *_LEAVE_OUT)
    if target is None and not os.path.isfile(path):
        raise InvalidInputError(f"{path} is not a regular file (a FIFO, socket or device); remove it or ", *_LEAVE_OUT)
    return LocalFile(f"{prefix}{name}", path, os.path.getsize(path), target, root if folder else "", name)


_SPECIAL_ROOTS = ("/proc", "/sys", "/dev", "/run")


def _special(target: str) -> bool:
    """A file of a kernel or device filesystem (``/proc/self/environ`` holds the token): never uploaded."""
    return any(target == r or target.startswith(r + "/") for r in _SPECIAL_ROOTS)


def open_upload(f: LocalFile) -> BinaryIO:
    """The file to send, opened once and checked: what is hashed and uploaded is read from this descriptor.

    A file of a pushed folder goes through :func:`~shardkit.formats.links.open_inside` (no symlinked
    parent, a link only under the link rule); a link followed outside with ``--follow-symlinks``
    is opened at its checked target, which must still be a regular file outside ``/proc``, ``/sys``
    and devices; a file named directly is the user's choice (:func:`~shardkit.formats.links.open_regular`).
    An object of a store (``f.store``) is a buffered stream of ranged GETs: no local copy.
    """
    if f.store is not None:
        from .store_files import open_object

        return open_object(f.store, f.name, f.size_bytes)
    try:
        if not f.root:
            fd = open_regular(f.local_path)
        elif f.link_target is not None and leads_outside(f.link_target, f.root):
            target = os.path.realpath(f.local_path)
            if target != f.link_target or _special(target):
                raise OutsideFolderError(f"{f.local_path}: the symlink changed since it was checked (now to {target}); "
                                         "nothing was sent")
            fd = open_regular(target, where=f.local_path)
        else:
            fd = open_inside(f.root, f.name, where=f.root)
    except OSError as e:
        raise InvalidInputError(f"{f.local_path}: cannot be read for the upload ({e.strerror or e})") from e
    return os.fdopen(fd, "rb")




def check_links(path: str | os.PathLike[str], files: list[LocalFile], *, follow: bool) -> list[FollowedLink]:
    """Every symlink among ``files``; refuse one leading outside the folder unless ``follow``.

    The rule is :mod:`shardkit.formats.links` (inside the folder or into a Hugging Face cache's
    ``blobs/``), so a planted ``README.md -> ~/.ssh/id_rsa`` is never uploaded by accident. A file
    named directly (``push model.safetensors``) is the user's choice, not a link found in a folder.
    Links to folders are never followed (the walk does not enter them), with or without ``follow``.

    Raises:
        InvalidInputError: a link leads outside and ``follow`` is False; nothing was sent.
    """
    root = os.fspath(path)
    named = not os.path.isdir(root)
    links = [FollowedLink(f.path_in_repo, f.link_target, not named and leads_outside(f.link_target, root))
             for f in files if f.link_target is not None]
    outside = [link for link in links if link.outside]
    if outside and not follow:
        first = next(f for f in files if f.path_in_repo == outside[0].path_in_repo)
        more = f" (and {len(outside) - 1} more link(s) leading outside)" if len(outside) > 1 else ""
        raise InvalidInputError(
            f"{first.local_path} is a symlink to {first.link_target}, outside {root}{more}: push would upload that "
            f"file's contents; {LINK_RULE}; copy the file in, ", *_LEAVE_OUT, ", or pass ",
            Option("follow_symlinks", True), " to upload it knowingly")
    return links


def check_folder_links(folder: str | os.PathLike[str]) -> None:
    """:func:`check_links` (no ``follow``) for the files already in ``folder``, if it exists.

    For a job that writes into ``folder`` and pushes it afterwards (``split --push-to``): a link the
    push would refuse is found before the long job, not after it.
    """
    root = os.fspath(folder)
    if os.path.isdir(root):
        check_links(root, [_local_file(root, name, "") for name in _walk(root)], follow=False)


def _walk(root: str) -> Iterator[str]:
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            if not name.startswith(".") and ".shardkit-" not in name:
                yield os.path.relpath(os.path.join(folder, name), root).replace(os.sep, "/")


def clean_prefix(path_in_repo: str | None) -> str:
    prefix = (path_in_repo or "").strip("/")
    if any(part in ("..", ".", ".git", ".cache") for part in prefix.split("/")):
        raise InvalidInputError(Option("path_in_repo", path_in_repo), " must be a plain folder inside the repository")
    return f"{prefix}/" if prefix else ""


def check_sizes(files: list[LocalFile]) -> None:
    """Refuse files over the Hub's 50 GB limit before anything is sent; warn above 20 GB."""
    for f in files:
        if f.size_bytes > MAX_FILE_BYTES:
            raise InvalidInputError(
                f"{f.local_path}: {format_size(f.size_bytes)} is over the Hub's 50 GB per-file limit; "
                "re-split it with ", Option("max_shard_size", "5GB"))
        if f.size_bytes > WARN_FILE_BYTES:
            warnings.warn(ShardkitWarning(f"{f.path_in_repo} is {format_size(f.size_bytes)}, above the Hub's "
                                          "recommended 20 GB per file; consider ", Option("max_shard_size", "5GB")),
                          stacklevel=3)


def sha256_file(file: LocalFile) -> str:
    """The file's sha256, read in 8 MiB pieces through its checked descriptor (:func:`open_upload`)."""
    digest = hashlib.sha256()
    with open_upload(file) as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def git_blob_id(file: LocalFile) -> str:
    with open_upload(file) as f:
        data = f.read()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


# ----------------------------------------------------------------------------- comparing

def split_changed(files: list[LocalFile], remote: dict[str, RemoteFile],
                  digests: dict[str, str]) -> tuple[list[LocalFile], list[LocalFile]]:
    """``(changed or new, identical)``; sha256 digests computed on the way land in ``digests``."""
    changed: list[LocalFile] = []
    same: list[LocalFile] = []
    for f in files:
        r = remote.get(f.path_in_repo)
        if r is None or r.size_bytes != f.size_bytes:
            changed.append(f)
            continue
        if r.lfs_sha256 is not None:
            if f.path_in_repo not in digests:  # push fills in what verify or the manifest already know
                digests[f.path_in_repo] = sha256_file(f)
            identical = digests[f.path_in_repo] == r.lfs_sha256
        else:
            identical = git_blob_id(f) == r.blob_id
        (same if identical else changed).append(f)
    return changed, same


def checkpoint_family(path_in_repo: str) -> tuple[str, str, bool] | None:
    """``(folder, stem, complete)`` of a safetensors checkpoint file; ``complete`` for index or single file.

    >>> checkpoint_family("unet/diffusion_pytorch_model.safetensors.index.fp16.json")
    ('unet', 'diffusion_pytorch_model.fp16', True)
    """
    folder, _, name = path_in_repo.rpartition("/")
    weight = parse_weight_name(name)
    if weight is None or weight.ext != "safetensors":
        return None
    return folder, weight.stem, weight.kind != "shard"


def _last_commit(path_in_repo: str) -> bool:
    """Index files, ``model_index.json`` and the manifest (which lists every shard) go in the last commit."""
    name = path_in_repo.rpartition("/")[2]
    return name == MODEL_INDEX or is_manifest_file(name) or is_index_file(name)


def stale_files(files: list[LocalFile], remote: dict[str, RemoteFile]) -> list[str]:
    """Remote files of a checkpoint family the push replaces completely, that the folder no longer has."""
    local = {f.path_in_repo for f in files}
    families = set()
    for path in local:
        family = checkpoint_family(path)
        if family and family[2]:
            families.add(family[:2])
    return sorted(p for p in remote if p not in local and (family := checkpoint_family(p)) and family[:2] in families)


def plan_commits(upload: list[LocalFile], deletions: list[str],
                 remote: dict[str, RemoteFile]) -> list[tuple[list[LocalFile], list[str]]]:
    """Group operations into ``(uploads, deletions)`` commits; no commit shows an index before its shards.

    One commit when the push is small. Otherwise the early commits hold only new paths that are
    not index files (nothing visible can name them yet) and the last commit holds the rest.
    """
    limit = MAX_FILES_PER_COMMIT
    if len(upload) + len(deletions) <= limit:
        return [(upload, deletions)]
    early = [f for f in upload if f.path_in_repo not in remote and not _last_commit(f.path_in_repo)]
    last = [f for f in upload if f not in early]
    groups: list[tuple[list[LocalFile], list[str]]] = [(early[i:i + limit], []) for i in range(0, len(early), limit)]
    return groups + [(last, deletions)] if last or deletions else groups


