"""Which files travel with a checkpoint folder's weights: every other file and subfolder, layout kept.

A split, convert or reshard of a folder into another folder rewrites the checkpoint (its shards,
index and manifest) and copies everything else unchanged, at the same relative path: configs,
tokenizer files, ``README.md``, ``.gitattributes`` and whole subfolders (sentence-transformers'
``1_Pooling/``, a pipeline's ``scheduler/``). Left out: the weight files of the folders being
rewritten (the old shards and index, a DCP ``.metadata``), shardkit's manifests, temporaries and
journal, and version-control and cache folders (``.git``, ``.cache`` ...).

Only regular files and folders are copied. A symlinked file is followed only under the one rule of
:mod:`shardkit.formats.links` (to a regular file inside the folder or in a Hugging Face cache's
``blobs/``); a symlinked folder, a link leading elsewhere, a fifo, socket or device is refused
with one line naming it, and so is a name the folder boundary refuses (control characters such as
a newline or an ANSI escape, invalid Unicode). Standard library only.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable

from ..errors import InvalidInputError
from .links import LINK_RULE, OutsideFolderError, check_name, leads_outside
from .suffixes import DCP_METADATA, is_manifest_file, is_weight_file

__all__ = ["MAX_SIDE_FILES", "SKIPPED_DIRS", "folder_side_files"]

# Version control and caches: never part of a model.
SKIPPED_DIRS = frozenset({".git", ".hg", ".svn", ".cache", "__pycache__"})
MAX_SIDE_FILES = 100_000  # a bound on what one folder may list (a model folder holds tens)
MAX_DEPTH = 32
_SHARDKIT_MARK = ".shardkit-"  # temporaries and the journal (atomic/journal.py)


def folder_side_files(folder: str | os.PathLike[str], *, rewritten: Iterable[str] = ("",)) -> list[str]:
    """The files of ``folder`` to copy beside a rewritten checkpoint, as sorted ``/``-separated relative paths.

    Args:
        folder: the source folder.
        rewritten: the subfolders (relative, ``""`` for ``folder`` itself) whose weight files are
            rewritten: their ``.safetensors``, pickles, DCP files and index files are not copied.

    Raises:
        InvalidInputError: a symlinked folder, a symlink leading outside, a special file, a name with
            control characters, or more than :data:`MAX_SIDE_FILES` files.

    folder_side_files("minilm/")
    ['.gitattributes', '1_Pooling/config.json', 'README.md', 'config.json', 'modules.json', ...]
    """
    root = os.fspath(folder)
    skip_weights = {os.path.normpath(d) if d else "." for d in rewritten}
    found: list[str] = []
    pending = ["."]
    while pending:
        rel_dir = pending.pop()
        if rel_dir.count(os.sep) >= MAX_DEPTH:
            raise InvalidInputError(f"{os.path.join(root, rel_dir)}: folders nested more than {MAX_DEPTH} deep; "
                                    "shardkit does not copy such a tree: move the checkpoint into its own folder")
        for entry in _entries(os.path.join(root, rel_dir)):
            rel = os.path.normpath(os.path.join(rel_dir, entry.name))
            if _is_skipped(entry.name):
                continue
            _check_side_name(root, rel)
            kind = _kind(entry, root, rel)
            if kind == "dir":
                pending.append(rel)
            elif not (is_manifest_file(entry.name) or (rel_dir in skip_weights and _is_checkpoint_file(entry.name))):
                found.append(rel.replace(os.sep, "/"))
                if len(found) > MAX_SIDE_FILES:
                    raise InvalidInputError(f"{root}: holds more than {MAX_SIDE_FILES} files besides the weights; "
                                            "move the checkpoint into its own folder")
    return sorted(found)


def _entries(path: str) -> list[os.DirEntry[str]]:
    with os.scandir(path) as it:
        return sorted(it, key=lambda e: e.name)


def _check_side_name(root: str, rel: str) -> None:
    """Refuse a name the folder boundary refuses (control characters, invalid Unicode): never copied, never printed raw."""
    try:
        check_name(rel.replace(os.sep, "/"), where=root)
    except OutsideFolderError as e:
        raise InvalidInputError(f"{e}; shardkit copies no such name beside the weights: rename it or move it out of "
                                "the folder") from None


def _is_skipped(name: str) -> bool:
    return name in SKIPPED_DIRS or _SHARDKIT_MARK in name


def _is_checkpoint_file(name: str) -> bool:
    return is_weight_file(name) or name == DCP_METADATA


def _kind(entry: os.DirEntry[str], root: str, rel: str) -> str:
    """``"dir"`` or ``"file"`` for what may be copied; anything else is refused with one line."""
    where = os.path.join(root, rel)
    if entry.is_symlink():
        target = os.path.realpath(where)
        if os.path.isdir(target):
            raise InvalidInputError(f"{where}: is a symlink to a folder ({target}); shardkit copies only regular "
                                    "files and folders beside the weights: replace it with a copy, or remove it")
        if not os.path.isfile(target):
            raise InvalidInputError(f"{where}: is a symlink to {target}, which is not a regular file; remove it")
        if leads_outside(target, root):
            raise InvalidInputError(f"{where}: is a symlink leading outside the checkpoint folder (to {target}); "
                                    f"{LINK_RULE}; copy the file in, or remove the link")
        return "file"
    mode = entry.stat(follow_symlinks=False).st_mode
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISREG(mode):
        return "file"
    raise InvalidInputError(f"{where}: is not a regular file or folder (a fifo, socket or device); shardkit copies "
                            "only regular files and folders beside the weights: move it out of the folder")
