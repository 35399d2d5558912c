"""Index files, and finding the checkpoint in a folder (the naming rules: :mod:`shardkit.formats.names`).

An index is ``{"metadata": {"total_size": N}, "weight_map": {tensor: shard_file}}``. Its shard
names are untrusted input: absolute paths, ``..``, path separators and files of the wrong kind
are refused before anything is opened. Shard files may be symlinks (the Hugging Face cache lays
snapshots out that way); the *names* in the index may not leave the folder.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..errors import CheckpointIndexError, SourceNotFoundError
from .links import LINK_RULE, OutsideFolderError, leads_outside, link_target, loads_json, read_regular
from .names import (  # the naming rules live in names.py; re-exported here for their many importers
    DIFFUSERS_PREFIX,
    TRANSFORMERS_PREFIX,
    NameProblem,
    Naming,
    add_variant,
    naming_from_filename,
    resolve_names,
    unsafe_name_reason,
)

__all__ = ["DIFFUSERS_PREFIX", "MAX_INDEX_BYTES", "TRANSFORMERS_PREFIX", "CheckpointIndex", "Layout", "Naming",
           "IndexContents", "IndexProblem", "add_variant", "check_shard_name", "dump_index", "find_checkpoint",
           "folder_names", "index_contents", "load_index", "naming_from_filename", "parse_index", "shard_file",
           "shard_name_problem"]

MAX_INDEX_BYTES = 256_000_000


@dataclass
class CheckpointIndex:
    """A validated index file."""

    path: str
    weight_map: dict[str, str]
    metadata: dict[str, object] = field(default_factory=dict)

    @property
    def folder(self) -> str:
        return os.path.dirname(os.path.abspath(self.path))

    def shard_names(self) -> list[str]:
        """Shard file names, each once, in the order the index first names them."""
        return list(dict.fromkeys(self.weight_map.values()))

    def shard_paths(self) -> list[str]:
        return [os.path.join(self.folder, name) for name in self.shard_names()]


def shard_name_problem(name: object, *, ext: str = ".safetensors") -> str | None:
    """Why an index's shard name is refused (it could leave the folder, or is not an ``ext`` file); None if fine."""
    reason = unsafe_name_reason(name, folder="the index's folder")
    if reason is not None:
        return f"shard name {name!r} {reason}"
    if not str(name).endswith(ext):
        return f"shard name {name!r} is not a {ext} file"
    return None


def check_shard_name(name: object, *, where: str, ext: str = ".safetensors") -> str:
    """Refuse a shard name that could leave the folder or is not a ``ext`` file."""
    problem = shard_name_problem(name, ext=ext)
    if problem is not None:
        raise CheckpointIndexError(f"{where}: {problem}")
    assert isinstance(name, str)
    return name


def shard_file(folder: str, name: str, *, where: str) -> str:
    """The path of file ``name`` found in ``folder``, after the symlink policy.

    Names never hold paths (see :func:`check_shard_name`). A file that is a symlink is followed
    only to a regular file inside ``folder`` or into a Hugging Face cache's ``blobs/`` (the one
    rule, :mod:`shardkit.formats.links`). Anything else, e.g. a link a downloaded repo planted
    towards ``~/.ssh`` or another model, is refused.
    """
    path = os.path.join(folder, name)
    if not os.path.lexists(path):
        raise CheckpointIndexError(f"{where}: names shard {name!r}, which does not exist in {folder}")
    target = link_target(path)
    if target is not None:
        if not os.path.isfile(target):
            raise CheckpointIndexError(f"{where}: {name!r} is a symlink to {target}, which is not a regular file")
        if leads_outside(target, folder):
            raise CheckpointIndexError(
                f"{where}: {name!r} is a symlink leading outside the checkpoint folder (to {target}); {LINK_RULE}; "
                "copy the file in, or pass its path directly"
            )
    elif not os.path.isfile(path):
        raise CheckpointIndexError(f"{where}: {name!r} in {folder} is not a regular file")
    return path


def load_index(path: str | os.PathLike[str], *, ext: str = ".safetensors") -> CheckpointIndex:
    """Read and validate an index JSON file; shard files are not opened.

    index = load_index("out/model.safetensors.index.json")
    index.shard_names()
    ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors']
    """
    path = os.fspath(path)
    try:  # one checked descriptor, size from fstat: a FIFO or /dev/zero is refused before any read
        raw = read_regular(path, max_bytes=MAX_INDEX_BYTES)
    except FileNotFoundError as e:
        raise SourceNotFoundError(f"{path}: no such index file") from e
    except IsADirectoryError as e:
        raise CheckpointIndexError(f"{path}: is a directory, expected an index JSON file") from e
    except OutsideFolderError as e:
        raise CheckpointIndexError(f"{path}: not usable as an index file ({str(e).removeprefix(f'{path}: ')})") from e
    return parse_index(raw, path=path, ext=ext)


def parse_index(raw: bytes, *, path: str, ext: str = ".safetensors") -> CheckpointIndex:
    """Validate index JSON bytes, raising for the first problem. See :func:`load_index`."""
    try:
        doc = loads_json(raw)
    except (ValueError, RecursionError) as e:  # ValueError: also integers over Python's digit limit
        raise CheckpointIndexError(f"{path}: not a valid UTF-8 JSON index ({e})") from e
    contents = index_contents(doc, ext=ext)
    for problem in contents.problems:
        raise CheckpointIndexError(f"{path}: {problem}")
    return CheckpointIndex(path, contents.weight_map, contents.metadata)


@dataclass(frozen=True)
class IndexProblem:
    """One thing wrong with an index: about one tensor's entry, or (``tensor`` None) the whole file."""

    tensor: str | None
    message: str

    def __str__(self) -> str:
        return self.message if self.tensor is None else f"tensor {self.tensor!r}: {self.message}"


@dataclass
class IndexContents:
    """An index document checked entry by entry: the usable entries, and every problem found.

    ``usable`` is False when the document is not an object with a ``weight_map`` object (then
    nothing in it can be trusted); a refused shard name drops its entry and adds a problem.
    """

    weight_map: dict[str, str]
    metadata: dict[str, object]
    problems: list[IndexProblem]
    usable: bool = True


def index_contents(doc: object, *, ext: str = ".safetensors") -> IndexContents:
    """Check a parsed index document without raising: the one set of index rules, for
    :func:`parse_index` (which raises for the first problem) and for verify (which reports all).

    >>> index_contents({"weight_map": {"w": "../x.safetensors"}}).problems[0].tensor
    'w'
    """
    if not isinstance(doc, dict) or not isinstance(doc.get("weight_map"), dict):
        return IndexContents({}, {}, [IndexProblem(None, "index must be an object with a 'weight_map' object")], False)
    problems: list[IndexProblem] = []
    metadata = doc.get("metadata")
    if metadata is None:
        metadata = {}
    elif not isinstance(metadata, dict):
        problems.append(IndexProblem(None, "'metadata' must be an object"))
        metadata = {}
    weight_map: dict[str, str] = {}
    for tensor, shard in doc["weight_map"].items():
        problem = shard_name_problem(shard, ext=ext)
        if problem is None:
            weight_map[tensor] = shard
        else:
            problems.append(IndexProblem(tensor, problem))
    if not doc["weight_map"]:
        problems.append(IndexProblem(None, "weight_map is empty"))
    return IndexContents(weight_map, metadata, problems)


def dump_index(weight_map: Mapping[str, str], *, total_size_bytes: int,
               metadata: Mapping[str, object] | None = None) -> bytes:
    """Serialize an index the way transformers does (sorted keys, 2-space indent)."""
    meta = {"total_size": total_size_bytes, **(metadata or {})}
    doc = {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode("utf-8")


@dataclass(frozen=True)
class Layout:
    """What a checkpoint folder holds: an ``index`` file, or one ``file``; see :func:`find_checkpoint`.

    ``"shards"`` (``strict=False`` only): shard files without their index; ``path`` is the first,
    ``shards`` names them all and ``problems`` says what a strict resolution would have raised.
    """

    kind: Literal["index", "file", "shards"]
    path: str
    naming: Naming
    shards: tuple[str, ...] = ()
    problems: tuple[NameProblem, ...] = ()


def folder_names(folder: str | os.PathLike[str]) -> list[str]:
    """The names directly inside ``folder``, sorted: the listing :func:`~shardkit.formats.names.resolve_names` takes."""
    return sorted(entry.name for entry in os.scandir(folder))


def find_checkpoint(folder: str | os.PathLike[str], *, variant: str | None = None, ext: str = "safetensors",
                    strict: bool = True) -> Layout:
    """Locate the checkpoint in a folder: its index if it has one, else its single weights file.

    The rules are :func:`~shardkit.formats.names.resolve_names`'; ``strict`` (loaders, split) also
    applies the symlink policy (:func:`shard_file`) to the file found. ``strict=False`` (verify)
    returns shards without an index or hostile names as problems; the checks that read the files
    report their links.

    Raises:
        SourceNotFoundError: no such folder, or it holds no checkpoint.
        CheckpointIndexError: several that conflict (pass ``variant`` or the file to choose); strict:
            shards without their index, a hostile name, a link leading outside.
    """
    root = Path(folder)
    if not root.is_dir():
        raise SourceNotFoundError(f"{folder}: no such folder")
    found = resolve_names(folder_names(root), where=str(folder), variant=variant, ext=ext, strict=strict)
    path = shard_file(str(root), found.name, where=str(folder)) if strict else os.path.join(str(root), found.name)
    return Layout(found.kind, path, found.naming, found.shards, found.problems)
