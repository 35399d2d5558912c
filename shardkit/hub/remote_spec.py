"""What an ``hf://`` spec names: the parsed spec, the repository's files, and the header-only mirror
that stands in for them locally (see :mod:`shardkit.hub.remote`).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import TypeGuard

from ..errors import InvalidInputError

__all__ = ["REPO_TYPE_PREFIXES", "SCHEME", "Mirror", "RemoteFile", "RemoteSpec", "is_remote", "local_path",
           "parse_spec"]

SCHEME = "hf://"
REPO_TYPE_PREFIXES = {"datasets": "dataset", "spaces": "space"}  # hf://datasets/ORG/REPO, as HfFileSystem


@dataclass(frozen=True)
class RemoteSpec:
    """A parsed ``hf://[datasets/|spaces/]ORG/REPO[@REVISION][/SUBFOLDER]``."""

    repo_id: str
    revision: str | None = None
    subfolder: str = ""
    repo_type: str = "model"

    def __str__(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        kind = next((f"{p}/" for p, t in REPO_TYPE_PREFIXES.items() if t == self.repo_type), "")
        return f"{SCHEME}{kind}{self.repo_id}{rev}" + (f"/{self.subfolder}" if self.subfolder else "")


@dataclass(frozen=True)
class RemoteFile:
    """One file of the repository, as the tree listing describes it (``path`` is repo-relative)."""

    path: str
    size_bytes: int
    blob_id: str
    sha256: str | None  # the LFS oid, for LFS files


@dataclass
class Mirror:
    """A header-only local mirror of a remote folder; ``root`` is where the local readers look."""

    spec: RemoteSpec
    root: str
    commit: str
    files: dict[str, RemoteFile]  # by path relative to the subfolder
    transferred_bytes: int = 0
    prefix_bytes: dict[str, int] = field(default_factory=dict)  # real bytes at the start of each sparse file
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, nbytes: int) -> None:
        with self.lock:
            self.transferred_bytes += nbytes


def is_remote(path: object) -> TypeGuard[str]:
    """True for a string that names a Hub repository (``hf://...``)."""
    return isinstance(path, str) and path.startswith(SCHEME)


def parse_spec(text: str) -> RemoteSpec:
    """Parse ``hf://ORG/REPO[@REVISION][/SUBFOLDER]``.

    A revision ends at the next ``/``, except a pull-request ref (``@refs/pr/3``); a revision
    holding another ``/`` is written with ``%2F``.

    >>> parse_spec("hf://black-forest-labs/FLUX.1-dev@main/transformer")
    RemoteSpec(repo_id='black-forest-labs/FLUX.1-dev', revision='main', subfolder='transformer', repo_type='model')
    >>> parse_spec("hf://datasets/org/ckpts/run-1").repo_type
    'dataset'
    """
    from urllib.parse import unquote

    body = text.removeprefix(SCHEME).strip("/")
    parts = body.split("/")
    repo_type = REPO_TYPE_PREFIXES.get(parts[0], "model") if len(parts) > 2 else "model"
    if repo_type != "model":
        parts = parts[1:]
    if len(parts) < 2 or not parts[0] or not parts[1] or parts[1].startswith("@"):
        raise InvalidInputError(f"{text}: expected hf://ORG/REPO[@REVISION][/SUBFOLDER] (or hf://datasets/ORG/REPO...)")
    name, _, revision = parts[1].partition("@")
    rest = parts[2:]
    if revision == "refs" and len(rest) >= 2 and rest[0] == "pr":
        revision, rest = f"refs/pr/{rest[1]}", rest[2:]
    if any(p in ("", ".", "..") for p in rest):
        raise InvalidInputError(f"{text}: the subfolder must be a plain relative path")
    return RemoteSpec(f"{parts[0]}/{name}", unquote(revision) or None, "/".join(rest), repo_type)


def local_path(mirror: Mirror, remote: RemoteFile) -> str:
    """Where ``remote`` lies in the mirror."""
    prefix = mirror.spec.subfolder + "/" if mirror.spec.subfolder else ""
    return os.path.join(mirror.root, *remote.path[len(prefix):].split("/"))
