"""Index files and the naming conventions of transformers and diffusers.

An index is ``{"metadata": {"total_size": N}, "weight_map": {tensor: shard_file}}``. Its shard
names are untrusted input: absolute paths, ``..``, path separators and files of the wrong kind
are refused before anything is opened. Shard files may be symlinks (the Hugging Face cache lays
snapshots out that way); the *names* in the index may not leave the folder.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CheckpointIndexError, SourceNotFoundError
from .links import LINK_RULE, OutsideFolderError, leads_outside, link_target, read_regular

DIFFUSERS_PREFIX = "diffusion_pytorch_model"
TRANSFORMERS_PREFIX = "model"
MAX_INDEX_BYTES = 256_000_000
_INDEX_RE = re.compile(r"^(?P<prefix>[^.]+)\.(?P<ext>safetensors|bin)\.index(?:\.(?P<variant>[^.]+))?\.json$")
_SHARD_RE = re.compile(r"^(?P<stem>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.(?P<ext>safetensors|bin)$")


def add_variant(filename: str, variant: str | None) -> str:
    """Insert a variant before the extension, as transformers and diffusers do.

    >>> add_variant("model.safetensors", "fp16"), add_variant("model.safetensors.index.json", "fp16")
    ('model.fp16.safetensors', 'model.safetensors.index.fp16.json')
    """
    if not variant:
        return filename
    parts = filename.split(".")
    return ".".join(parts[:-1] + [variant] + parts[-1:])


@dataclass(frozen=True)
class Naming:
    """How output files are named: ``prefix`` (``model`` or ``diffusion_pytorch_model``) and variant."""

    prefix: str = TRANSFORMERS_PREFIX
    variant: str | None = None
    ext: str = "safetensors"

    def single(self) -> str:
        return add_variant(f"{self.prefix}.{self.ext}", self.variant)

    def shard(self, number: int, total: int) -> str:
        stem = add_variant(f"{self.prefix}.{self.ext}", self.variant)[: -len(self.ext) - 1]
        return f"{stem}-{number:05d}-of-{total:05d}.{self.ext}"

    def index(self) -> str:
        return add_variant(f"{self.prefix}.{self.ext}.index.json", self.variant)


def naming_from_filename(filename: str) -> Naming:
    """Guess the naming convention a source file or index uses.

    >>> naming_from_filename("diffusion_pytorch_model.fp16-00001-of-00002.safetensors")
    Naming(prefix='diffusion_pytorch_model', variant='fp16', ext='safetensors')
    """
    name = os.path.basename(filename)
    index_match = _INDEX_RE.match(name)
    if index_match:
        name = add_variant(f"{index_match['prefix']}.{index_match['ext']}", index_match["variant"])
    match = _SHARD_RE.match(name)
    if match:
        name = f"{match['stem']}.{match['ext']}"
    ext = "bin" if name.endswith(".bin") else "safetensors"
    stem = name[: -len(ext) - 1] if name.endswith("." + ext) else name
    prefix, _, variant = stem.partition(".")
    if prefix == "pytorch_model":
        prefix = TRANSFORMERS_PREFIX
    if prefix not in (DIFFUSERS_PREFIX, TRANSFORMERS_PREFIX):
        return Naming()
    return Naming(prefix, variant or None)


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


def check_shard_name(name: object, *, where: str, ext: str = ".safetensors") -> str:
    """Refuse a shard name that could leave the folder or is not a ``ext`` file."""
    if not isinstance(name, str) or not name:
        raise CheckpointIndexError(f"{where}: shard name {name!r} must be a non-empty string")
    if os.path.isabs(name) or name.startswith(("/", "\\")):
        raise CheckpointIndexError(f"{where}: shard name {name!r} is an absolute path; only file names are allowed")
    if "/" in name or "\\" in name or name in (".", ".."):
        raise CheckpointIndexError(f"{where}: shard name {name!r} contains a path; only file names in the index's folder are allowed")
    if any(ord(c) < 32 or 0xD800 <= ord(c) <= 0xDFFF for c in name):
        raise CheckpointIndexError(f"{where}: shard name {name!r} contains control characters or invalid Unicode")
    if not name.endswith(ext):
        raise CheckpointIndexError(f"{where}: shard name {name!r} is not a {ext} file")
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
    """Validate index JSON bytes. See :func:`load_index`."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # ValueError: also integers over Python's digit limit
        raise CheckpointIndexError(f"{path}: not a valid UTF-8 JSON index ({e})") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("weight_map"), dict):
        raise CheckpointIndexError(f"{path}: index must be an object with a 'weight_map' object")
    metadata = doc.get("metadata")
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict):
        raise CheckpointIndexError(f"{path}: 'metadata' must be an object")
    weight_map: dict[str, str] = {}
    for tensor, shard in doc["weight_map"].items():
        weight_map[tensor] = check_shard_name(shard, where=f"{path}: tensor {tensor!r}", ext=ext)
    if not weight_map:
        raise CheckpointIndexError(f"{path}: weight_map is empty")
    return CheckpointIndex(path, weight_map, metadata)


def dump_index(weight_map: dict[str, str], *, total_size_bytes: int, metadata: dict | None = None) -> bytes:
    """Serialize an index the way transformers does (sorted keys, 2-space indent)."""
    meta = {"total_size": total_size_bytes, **(metadata or {})}
    doc = {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode("utf-8")


@dataclass(frozen=True)
class Layout:
    """What a checkpoint folder holds: an ``index`` file, or one ``file``."""

    kind: str  # "index" or "file"
    path: str
    naming: Naming


def find_checkpoint(folder: str | os.PathLike[str], *, variant: str | None = None, ext: str = "safetensors") -> Layout:
    """Locate the checkpoint in a folder: its index if it has one, else its single weights file.

    Raises when the folder holds none, or several that conflict (pass ``variant`` to choose).
    """
    root = Path(folder)
    if not root.is_dir():
        raise SourceNotFoundError(f"{folder}: no such folder")
    names = sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
    indexes = [n for n in names if re.fullmatch(rf".+\.{ext}\.index(\.[^.]+)?\.json", n)]
    singles = [n for n in names if n.endswith(f".{ext}") and not _SHARD_RE.match(n)]
    if variant is not None:
        indexes = [n for n in indexes if naming_from_filename(n).variant == variant]
        singles = [n for n in singles if naming_from_filename(n).variant == variant]
    else:
        indexes = [n for n in indexes if naming_from_filename(n).variant is None] or indexes
        singles = [n for n in singles if naming_from_filename(n).variant is None] or singles
    if len(indexes) > 1:
        raise CheckpointIndexError(
            f"{folder}: several index files ({', '.join(indexes)}); pass the one to use, or a variant"
        )
    if indexes:
        return Layout("index", shard_file(str(root), indexes[0], where=str(folder)), naming_from_filename(indexes[0]))
    if len(singles) > 1:
        raise CheckpointIndexError(
            f"{folder}: several .{ext} files and no index ({', '.join(singles)}); pass the file to use"
        )
    if singles:
        return Layout("file", shard_file(str(root), singles[0], where=str(folder)), naming_from_filename(singles[0]))
    shards = [n for n in names if (m := _SHARD_RE.match(n)) and m.group("ext") == ext]
    if shards:  # "no checkpoint" would be false: the shards are there, their index is what is missing
        expected = naming_from_filename(shards[0]).index()
        raise CheckpointIndexError(
            f"{folder}: the folder holds {len(shards)} shard file(s) ({shards[0]}, ...) but no index file "
            f"({expected}), so no loader can find the tensors; restore the index that names them"
        )
    raise SourceNotFoundError(f"{folder}: no .{ext} checkpoint or index found in this folder")
