"""What an ``hf://`` location names: the parsed spec and the repository's files as its tree listing gives them.

The one place ``hf://`` text is parsed (:func:`parse_spec`); :class:`~shardkit.stores.hf.HfStore` reads
the repository at one commit, and every listed path is checked (:func:`check_listed`) before it is used.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidInputError
from ..formats.links import OutsideFolderError, check_name

__all__ = ["MAX_REMOTE_FILE_BYTES", "REPO_TYPE_PREFIXES", "SCHEME", "RemoteFile", "RemoteSpec",
           "check_listed", "check_listing", "parse_spec"]

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


MAX_REMOTE_FILE_BYTES = 1 << 50  # 1 PiB: a listed size above it is no file the Hub stores


def check_listed(spec: RemoteSpec, path: object, size: object) -> tuple[str, int]:
    """A tree entry's path relative to the subfolder, and its size, validated like an index entry.

    The listing comes from the endpoint (``HF_ENDPOINT``, a mirror, a proxy): a path that is
    absolute, climbs with ``..``, has empty parts, backslashes or control characters, or lies
    outside the subfolder, and a size that is not an integer from 0 to 1 PiB, are refused before
    anything is created.

    >>> check_listed(RemoteSpec("org/m", subfolder="unet"), "unet/config.json", 12)
    ('config.json', 12)
    """
    prefix = spec.subfolder + "/" if spec.subfolder else ""
    where = f"{spec}: the Hub's file listing"
    if not isinstance(path, str) or not path.startswith(prefix):
        raise OutsideFolderError(f"{where} names {path!r}, outside the folder asked for; refused before anything "
                                 "was downloaded (check HF_ENDPOINT)")
    rel = path[len(prefix):]
    check_name(rel, where=where)
    if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_REMOTE_FILE_BYTES:
        raise OutsideFolderError(f"{where} gives {path!r} the size {str(size)[:40]}, not a file size; refused before "
                                 "anything was downloaded (check HF_ENDPOINT)")
    return rel, size


def check_listing(spec: RemoteSpec, rels: list[str]) -> None:
    """No listed file may also be a folder of another (``a`` and ``a/b``): the mirror could not hold both."""
    folders = {"/".join(rel.split("/")[:i]) for rel in rels for i in range(1, rel.count("/") + 1)}
    clash = sorted(folders.intersection(rels))
    if clash:
        raise OutsideFolderError(f"{spec}: the Hub's file listing names {clash[0]!r} both as a file and as a folder; "
                                 "refused before anything was downloaded (check HF_ENDPOINT)")
