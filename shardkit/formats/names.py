"""Checkpoint file names: the one set of rules, and the resolution of a folder's listing to its files.

Every place that asks "is this an index?", "which checkpoint does this folder hold?" or "which
files belong to the same checkpoint?" asks this module, for a local folder, an ``hf://``
listing or (later) an object-store prefix alike: the functions here take names, never paths,
and read nothing.

The rules, as transformers and diffusers write them (``stem`` is the checkpoint's family, the
prefix plus its variant, e.g. ``model.fp16``), name → kind, stem:

- ``model.safetensors`` → single, ``model``
- ``model-00001-of-00002.safetensors`` → shard, ``model``
- ``model.safetensors.index.json`` → index, ``model``
- ``diffusion_pytorch_model.fp16-00001-of-00002.safetensors`` → shard, ``diffusion_pytorch_model.fp16``
- ``diffusion_pytorch_model.safetensors.index.fp16.json`` → index, ``diffusion_pytorch_model.fp16``
- ``model.fp16.safetensors.index.json`` (variant written first) → index, ``model.fp16``
- ``pytorch_model.bin.index.json`` → index of pickles (ext ``bin``), ``pytorch_model``

A variant is the part of the stem after its first dot when the prefix is one of the library
prefixes (``model``, ``diffusion_pytorch_model``, ``pytorch_model``), or the part an index puts
between ``.index.`` and ``.json``. A diffusers pipeline folder has ``model_index.json`` at its
root (never an index of weights) and one subfolder per component.

>>> parse_weight_name("model.fp16.safetensors.index.json")
WeightName(name='model.fp16.safetensors.index.json', kind='index', ext='safetensors', stem='model.fp16', variant='fp16')
>>> resolve_names(["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
...                "model.safetensors.index.json"], where="out").name
'model.safetensors.index.json'
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from ..errors import CheckpointIndexError, SourceNotFoundError

SAFETENSORS_SUFFIX = ".safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
DCP_DATA_SUFFIX = ".distcp"
DCP_METADATA = ".metadata"
# What transformers' and diffusers' save_pretrained write (and so what a component folder may hold).
SAVED_WEIGHT_SUFFIXES = (SAFETENSORS_SUFFIX, ".bin")
# Every file shardkit can read tensors from.
CHECKPOINT_SUFFIXES = (SAFETENSORS_SUFFIX, *PICKLE_SUFFIXES, DCP_DATA_SUFFIX)
# The integrity record shardkit writes beside a checkpoint (formats/manifest.py): neither a weight
# file nor an index, never copied as a side file (each output gets its own).
MANIFEST_FILE = "shardkit.manifest.json"
MODEL_INDEX = "model_index.json"  # a diffusers pipeline folder's root file

DIFFUSERS_PREFIX = "diffusion_pytorch_model"
TRANSFORMERS_PREFIX = "model"
PICKLE_PREFIX = "pytorch_model"  # transformers' pickles; written out again as "model"
LIBRARY_PREFIXES = (DIFFUSERS_PREFIX, TRANSFORMERS_PREFIX, PICKLE_PREFIX)

WeightKind = Literal["index", "shard", "single"]
_INDEX_RE = re.compile(r"^(?P<stem>.+)\.(?P<ext>safetensors|bin)\.index(?:\.(?P<variant>[^.]+))?\.json$", re.DOTALL)
_SHARD_RE = re.compile(r"^(?P<stem>.+)-(?P<number>\d{5})-of-(?P<total>\d{5})\.(?P<ext>safetensors|bin)$", re.DOTALL)
_SINGLE_RE = re.compile(r"^(?P<stem>.+)\.(?P<ext>safetensors|bin)$", re.DOTALL)


# ----------------------------------------------------------------------------- one name

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


@dataclass(frozen=True)
class WeightName:
    """What a weight file's name says: its kind, extension, family ``stem`` and variant."""

    name: str
    kind: WeightKind
    ext: str                 # "safetensors" or "bin"
    stem: str                # prefix plus variant: the same for every file of one checkpoint
    variant: str | None


def parse_weight_name(name: str) -> WeightName | None:
    """The weight file a (base) name denotes, or None for any other file.

    >>> parse_weight_name("diffusion_pytorch_model.fp16-00001-of-00002.safetensors").stem
    'diffusion_pytorch_model.fp16'
    >>> parse_weight_name("model_index.json") is None, parse_weight_name("model.safetensors.index.v2.json").variant
    (True, 'v2')
    """
    kind: WeightKind
    explicit = None
    if match := _INDEX_RE.match(name):
        kind, explicit = "index", match["variant"]
        stem = match["stem"] + (f".{explicit}" if explicit else "")
    elif match := _SHARD_RE.match(name):
        kind, stem = "shard", match["stem"]
    elif match := _SINGLE_RE.match(name):
        kind, stem = "single", match["stem"]
    else:
        return None
    prefix, _, dotted = stem.partition(".")
    variant = explicit or (dotted if prefix in LIBRARY_PREFIXES and dotted else None)
    return WeightName(name, kind, match["ext"], stem, variant)


def library_naming(filename: str) -> Naming | None:
    """The naming of a file written by transformers or diffusers; None for any other name.

    >>> library_naming("unet/diffusion_pytorch_model.fp16-00001-of-00002.safetensors")
    Naming(prefix='diffusion_pytorch_model', variant='fp16', ext='safetensors')
    >>> library_naming("sd_xl_base_1.0.safetensors") is None
    True
    """
    name = os.path.basename(filename)
    parsed = parse_weight_name(name)
    if parsed is not None:
        stem = parsed.stem
    else:  # a pickle or other file named directly: model.pt, pytorch_model.ckpt
        stem = name.removesuffix(SAFETENSORS_SUFFIX)
    prefix, _, variant = stem.partition(".")
    if prefix == PICKLE_PREFIX:
        prefix = TRANSFORMERS_PREFIX
    if prefix not in (DIFFUSERS_PREFIX, TRANSFORMERS_PREFIX):
        return None
    return Naming(prefix, variant or None)


def naming_from_filename(filename: str) -> Naming:
    """The naming convention a source file or index uses (transformers' when it uses neither).

    >>> naming_from_filename("diffusion_pytorch_model.fp16-00001-of-00002.safetensors")
    Naming(prefix='diffusion_pytorch_model', variant='fp16', ext='safetensors')
    >>> naming_from_filename("model.fp16.safetensors.index.json").variant
    'fp16'
    """
    return library_naming(filename) or Naming()


def is_index_file(name: str) -> bool:
    """``model.safetensors.index.json``, ``pytorch_model.bin.index.json``, with or without a variant.

    >>> is_index_file("diffusion_pytorch_model.fp16.safetensors.index.json"), is_index_file("model_index.json")
    (True, False)
    """
    parsed = parse_weight_name(name)
    return parsed is not None and parsed.kind == "index"


# What a header-only mirror (hf://, s3://) fetches whole besides the headers: configs (``config.json``,
# ``*_config.json``), ``model_index.json`` and safetensors indexes, at any folder depth.
_CONFIG_RE = re.compile(r"(^|/)(config|model_index|[\w.-]*_config|[\w.-]+\.safetensors\.index(\.[\w-]+)?)\.json$")


def is_config_file(name: str) -> bool:
    """Whether ``name`` (a path inside a checkpoint folder) is a config or index that a mirror fetches whole.

    >>> [is_config_file(n) for n in ("unet/config.json", "model.fp16.safetensors.index.json", "model.safetensors")]
    [True, True, False]
    """
    return bool(_CONFIG_RE.search(name))


def is_weight_file(name: str) -> bool:
    """A file holding tensors (any kind shardkit reads) or the index of a sharded checkpoint.

    >>> is_weight_file("model-00001-of-00002.safetensors"), is_weight_file("config.json")
    (True, False)
    """
    return name.endswith(CHECKPOINT_SUFFIXES) or is_index_file(name)


def is_saved_weight_file(name: str) -> bool:
    """A file ``save_pretrained`` writes for weights: ``.safetensors``, ``.bin`` or their index."""
    return name.endswith(SAVED_WEIGHT_SUFFIXES) or is_index_file(name)


def is_manifest_file(name: str) -> bool:
    """shardkit's integrity manifest (``shardkit.manifest.json``), which no loader reads."""
    return name == MANIFEST_FILE


def named_file_kind(name: str) -> Literal["index", "file"] | None:
    """What a safetensors file the user named directly is: any ``.json`` but a pickle index is read as
    an index (whatever it is called), a ``.safetensors`` file as one file; None: not safetensors.

    >>> named_file_kind("model.safetensors"), named_file_kind("my-index.json"), named_file_kind("w.bin")
    ('file', 'index', None)
    """
    if name.endswith(SAFETENSORS_SUFFIX):
        return "file"
    parsed = parse_weight_name(name)
    if name.endswith(".json") and (parsed is None or parsed.ext == "safetensors"):
        return "index"
    return None


def unsafe_name_reason(name: object, *, folder: str = "the folder") -> str | None:
    """Why a file name from untrusted input (an index, a listing) cannot name a file in its folder.

    >>> unsafe_name_reason("model-00001-of-00002.safetensors") is None, unsafe_name_reason("../x")
    (True, 'contains a path; only file names in the folder are allowed')
    """
    if not isinstance(name, str) or not name:
        return "must be a non-empty string"
    if os.path.isabs(name) or name.startswith(("/", "\\")):
        return "is an absolute path; only file names are allowed"
    if "/" in name or "\\" in name or name in (".", ".."):
        return f"contains a path; only file names in {folder} are allowed"
    if any(ord(c) < 32 or 0xD800 <= ord(c) <= 0xDFFF for c in name):
        return "contains control characters or invalid Unicode"
    return None


# ----------------------------------------------------------------------------- a folder's listing

@dataclass(frozen=True)
class NameProblem:
    """What a lenient resolution found instead of raising: the file it concerns, and one line."""

    file: str
    message: str


@dataclass(frozen=True)
class Resolution:
    """The checkpoint a listing holds.

    ``kind`` is ``"index"`` (``name`` is the index), ``"file"`` (``name`` is the one weights file) or,
    in lenient mode only, ``"shards"``: shard files whose index is missing (``name`` is the first,
    ``shards`` all of them, and a problem says so).
    """

    kind: Literal["index", "file", "shards"]
    name: str
    naming: Naming
    shards: tuple[str, ...] = ()
    problems: tuple[NameProblem, ...] = ()


def resolve_names(names: Iterable[str], *, where: str, variant: str | None = None, ext: str = "safetensors",
                  strict: bool = True) -> Resolution:
    """The checkpoint among a folder's file names: its index if it has one, else its one weights file.

    Hidden names and names in subfolders (holding ``/``) are not candidates, nor are names with
    control characters (hostile: never chosen, never printed raw). With ``variant``, only that
    variant's files count; without, the plain files are preferred to variants. ``strict`` (loaders,
    split) raises for shards without their index; lenient (verify) returns them, and the hostile
    names, as :class:`NameProblem`.

    Raises:
        SourceNotFoundError: no weights file or index of ``ext`` among the names.
        CheckpointIndexError: several candidates (pass the file, or a variant); only hostile names;
            strict: shards without their index.
    """
    parsed, hostile = _candidates(names, ext=ext)
    problems = () if strict else hostile
    index = _one_index(parsed, where=where, variant=variant)
    if index is not None:
        return Resolution("index", index, naming_from_filename(index), problems=problems)
    singles = _prefer_variant([w for w in parsed if w.kind == "single"], variant)
    if len(singles) > 1:
        raise CheckpointIndexError(f"{where}: several .{ext} files and no index "
                                   f"({', '.join(w.name for w in singles)}); pass the file to use")
    if singles:
        return Resolution("file", singles[0].name, naming_from_filename(singles[0].name), problems=problems)
    shards = [w.name for w in parsed if w.kind == "shard"]
    if not shards and hostile:  # "no checkpoint" would hide why: the one weights file has a hostile name
        raise CheckpointIndexError(f"{where}: {hostile[0].file}: {hostile[0].message}")
    if not shards:
        raise SourceNotFoundError(f"{where}: no .{ext} checkpoint or index found in this folder")
    naming = naming_from_filename(shards[0])
    message = (f"the folder holds {len(shards)} shard file(s) ({shards[0]}, ...) but no index file "
               f"({Naming(naming.prefix, naming.variant, ext).index()}), so no loader can find the tensors; "
               "restore the index that names them")
    if strict:  # "no checkpoint" would be false: the shards are there, their index is what is missing
        raise CheckpointIndexError(f"{where}: {message}")
    return Resolution("shards", shards[0], naming, tuple(shards), (*problems, NameProblem(shards[0], message)))


def resolve_index_name(names: Iterable[str], *, where: str, variant: str | None = None,
                       ext: str = "safetensors") -> str | None:
    """The one index of ``ext`` among the names, by :func:`resolve_names`' rules; None when there is none.

    >>> resolve_index_name(["pytorch_model.bin.index.json", "pytorch_model.bin.index.fp16.json"], where="f", ext="bin")
    'pytorch_model.bin.index.json'
    """
    return _one_index(_candidates(names, ext=ext)[0], where=where, variant=variant)


def family_files(names: Iterable[str], stem: str, *, kind: WeightKind = "shard", ext: str = "safetensors") -> list[str]:
    """The names of ``kind`` in checkpoint family ``stem`` (e.g. every ``model.fp16-*-of-*`` shard), sorted.

    >>> family_files(["model.fp16-00001-of-00002.safetensors", "model-00001-of-00002.safetensors"], "model.fp16")
    ['model.fp16-00001-of-00002.safetensors']
    """
    return sorted(n for n in names
                  if (w := parse_weight_name(n)) and w.kind == kind and w.stem == stem and w.ext == ext)


def _candidates(names: Iterable[str], *, ext: str) -> tuple[list[WeightName], tuple[NameProblem, ...]]:
    """The weight files of ``ext`` among the names; hostile ones (control characters) apart, as problems."""
    parsed: list[WeightName] = []
    hostile: list[NameProblem] = []
    for name in sorted(set(names)):
        if name.startswith(".") or "/" in name:
            continue
        weight = parse_weight_name(name)
        if weight is None or weight.ext != ext:
            continue
        reason = unsafe_name_reason(name)
        if reason is None:
            parsed.append(weight)
        else:  # never a candidate, never printed raw: ascii() keeps the message one line
            hostile.append(NameProblem(ascii(name), f"file name {reason}; rename or remove it (not read)"))
    return parsed, tuple(hostile)


def _one_index(parsed: list[WeightName], *, where: str, variant: str | None) -> str | None:
    indexes = _prefer_variant([w for w in parsed if w.kind == "index"], variant)
    if len(indexes) > 1:
        raise CheckpointIndexError(f"{where}: several index files ({', '.join(w.name for w in indexes)}); "
                                   "pass the one to use, or a variant")
    return indexes[0].name if indexes else None


def _prefer_variant(found: list[WeightName], variant: str | None) -> list[WeightName]:
    if variant is not None:
        return [w for w in found if w.variant == variant]
    return [w for w in found if w.variant is None] or found
