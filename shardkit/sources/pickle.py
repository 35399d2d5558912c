"""Pickled checkpoints (``.bin``, ``.pt``, ``.pth``, ``.ckpt``), loaded without running code.

``torch.load(weights_only=True)`` refuses every global that is not a tensor building block, so
a malicious ``__reduce__`` never runs. Zip-format files are opened with ``mmap=True``: tensors
are not copied into RAM, and their byte ranges inside the zip are located so the writer can copy
them kernel-side instead of touching the mapping.
"""

from __future__ import annotations

import os
import pickle
import re
import struct
import warnings
import zipfile
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeGuard

from ..errors import (
    InvalidInputError,
    ShardkitWarning,
    SourceNotFoundError,
    UnsafePickleError,
    first_line,
)
from ..formats.header import TensorEntry
from ..formats.index import naming_from_filename
from ..formats.links import fd_path, open_inside, open_regular
from .memory import MemorySource

if TYPE_CHECKING:
    import torch

STATE_DICT_KEYS = ("state_dict", "model", "module", "model_state_dict")


def open_checked(path: str, *, inside: str | None = None) -> int:
    """A checked read descriptor on the pickle ``path``: the folder boundary when it was found in ``inside``.

    A file found in a folder goes through :func:`~shardkit.formats.links.open_inside` (a symlink
    only inside the folder or into a Hugging Face cache's ``blobs/``); a file the user named goes
    through :func:`~shardkit.formats.links.open_regular`. Either way a FIFO or device is refused
    before a byte is read, and every later read (``torch.load`` included) goes through this descriptor.
    """
    try:
        if inside is not None:
            return open_inside(inside, os.path.relpath(path, inside).replace(os.sep, "/"), where=inside)
        return open_regular(path)
    except (FileNotFoundError, IsADirectoryError):
        raise SourceNotFoundError(f"{path}: no such file") from None


def load_pickle(path: str, *, fd: int | None = None) -> object:
    """``torch.load`` with ``weights_only=True`` (and ``mmap=True`` for zip files), errors mapped.

    ``fd``: a descriptor from :func:`open_checked` to load through (else ``path`` is opened so).
    """
    if fd is None:
        fd = open_checked(path)
        try:
            return load_pickle(path, fd=fd)
        finally:
            os.close(fd)
    if os.fstat(fd).st_size == 0:
        raise InvalidInputError(f"{path}: file is empty")
    checked = fd_path(fd, path)  # the checked file itself: a path swapped since cannot change what is loaded
    is_zip = zipfile.is_zipfile(checked)
    loaded = _torch_load(checked, path, mmap=is_zip)
    if not is_zip:  # warned only once loaded: a refused file gets its one-line error alone
        warnings.warn(ShardkitWarning(
            f"{path} is a legacy (non-zip) pickle: it is loaded fully into memory; "
            "re-save it with torch.save to stream it"), stacklevel=3)
    return loaded


def _torch_load(checked: str, path: str, *, mmap: bool) -> object:
    import torch

    try:
        return torch.load(checked, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise UnsafePickleError(
            f"{path}: refused to unpickle: it holds objects other than tensors ({_refusal_reason(e)}); "
            "shardkit never executes pickled code"
        ) from e
    except Exception as e:  # torch's unpickler raises many kinds (IndexError, KeyError...) on garbage
        first = first_line(e)
        raise InvalidInputError(f"{path}: not a readable PyTorch checkpoint ({first})") from e


_REFUSAL_RE = re.compile(
    r"(unsupported GLOBAL \S+(?: whose module \S+ is blocked)?|Unsupported global: GLOBAL \S+|Unsupported operand \S+)",
    re.IGNORECASE,
)


def _refusal_reason(error: Exception) -> str:
    """The specific part of torch's long weights_only message (the global it refused)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    match = _REFUSAL_RE.search(text)
    if match:
        return match.group(1).rstrip(".")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0][:200] if lines else type(error).__name__


def select_state_dict(obj: object, *, key: str | None = None, where: str = "checkpoint") -> Mapping[str, Any]:
    """Pick the tensor mapping out of a loaded checkpoint.

    With ``key``, ``obj[key]`` (a ``/``-separated path reaches nested dicts). Without it, a
    top-level ``state_dict`` / ``model`` / ``module`` dict is unwrapped when present.
    """
    if key is not None:
        node = obj
        for part in key.split("/"):
            if not isinstance(node, Mapping) or part not in node:
                keys = list(node.keys()) if isinstance(node, Mapping) else []
                raise InvalidInputError(
                    f"{where}: key {key!r} not found; top-level keys are: {', '.join(map(str, keys[:20]))}"
                )
            node = node[part]
        obj = node
    elif isinstance(obj, Mapping):
        for candidate in STATE_DICT_KEYS:
            if isinstance(obj.get(candidate), Mapping) and not _is_tensor(obj.get(candidate)):
                obj = obj[candidate]
                break
    if not isinstance(obj, Mapping):
        raise InvalidInputError(f"{where}: expected a dict of tensors, found {type(obj).__name__}")
    return obj


def _is_tensor(value: object) -> TypeGuard[torch.Tensor]:
    import torch

    return isinstance(value, torch.Tensor)


def zip_record_offsets(path: str, *, fd: int | None = None) -> dict[str, tuple[int, int]]:
    """Absolute data offset and size of each stored (uncompressed) member of a zip file (read through ``fd``)."""
    if fd is None:
        fd = open_checked(path)
        try:
            return zip_record_offsets(path, fd=fd)
        finally:
            os.close(fd)
    out: dict[str, tuple[int, int]] = {}
    with zipfile.ZipFile(fd_path(fd, path)) as z:
        for info in z.infolist():
            if info.compress_type != zipfile.ZIP_STORED:
                continue
            local = os.pread(fd, 30, info.header_offset)
            if len(local) < 30:
                continue
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            out[info.filename] = (info.header_offset + 30 + name_len + extra_len, info.file_size)
    return out


def locate_in_file(path: str, tensors: Mapping[str, torch.Tensor], *, every: object = None,
                   fd: int | None = None) -> dict[str, int]:
    """File offsets of tensors that ``torch.load(mmap=True)`` mapped straight from ``path`` (read through ``fd``).

    torch maps the whole file once; a storage's address minus the mapping base is its record's
    offset. The base is the one shift that maps every storage of the loaded object (``every``,
    which must hold all of them, or the selection is ambiguous) onto a record start. Located
    bytes are spot-checked against the file, so a wrong guess costs speed, never correctness.
    """
    if fd is None:
        fd = open_checked(path)
        try:
            return locate_in_file(path, tensors, every=every, fd=fd)
        finally:
            os.close(fd)
    records = {off: size for name, (off, size) in zip_record_offsets(path, fd=fd).items() if "/data/" in name}
    ptrs = {t.untyped_storage().data_ptr() for t in _all_tensors(tensors if every is None else every) if t.numel()}
    if not ptrs or not records:
        return {}
    lowest = min(ptrs)
    bases = [lowest - off for off in sorted(records) if all(p - (lowest - off) in records for p in ptrs)]
    if len(bases) != 1:
        return {}
    located = {}
    for name, t in tensors.items():
        record = t.untyped_storage().data_ptr() - bases[0]
        start = record + int(t.storage_offset()) * t.element_size()
        nbytes = t.numel() * t.element_size()
        if record in records and t.numel() and t.is_contiguous() and start + nbytes <= record + records[record] \
                and _ends_match(fd, start, t):
            located[name] = start
    return located


def _ends_match(fd: int, start: int, tensor: torch.Tensor) -> bool:
    """The first and last bytes of ``tensor`` are the file's bytes at ``start``."""
    import torch

    flat = tensor.reshape(-1).view(torch.uint8)
    k = min(64, flat.numel())
    head, tail = bytes(flat[:k].numpy()), bytes(flat[-k:].numpy())
    return os.pread(fd, k, start) == head and os.pread(fd, k, start + flat.numel() - k) == tail


def _all_tensors(obj: object, depth: int = 0) -> list[torch.Tensor]:
    """Every tensor inside nested dicts, lists and tuples (what a weights_only pickle can hold)."""
    if _is_tensor(obj):
        return [obj]
    if depth > 32:
        return []
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple, set)):
        return [t for item in obj for t in _all_tensors(item, depth + 1)]
    return []


def open_pickle(path: str, *, key: str | None = None, inside: str | None = None) -> MemorySource:
    """A source over a pickled checkpoint; see the module docstring for the safety story.

    ``inside``: the folder ``path`` was found in (not named by the user): the file is opened under
    the folder boundary (:func:`open_checked`).
    """
    fd = open_checked(path, inside=inside)
    try:
        source = _pickle_source(path, fd, key=key)
    except BaseException:
        os.close(fd)
        raise
    source._held_fds()[path] = fd  # held: later reads and kernel copies see this file even if replaced
    return source


def _pickle_source(path: str, fd: int, *, key: str | None) -> MemorySource:
    obj = load_pickle(path, fd=fd)
    tensors = select_state_dict(obj, key=key, where=path)
    source = MemorySource(tensors, description=f"pickle {path}", naming=naming_from_filename(path))
    if zipfile.is_zipfile(fd_path(fd, path)):
        offsets = locate_in_file(path, tensors, every=obj, fd=fd)
        source._entries = [
            TensorEntry(e.name, e.dtype, e.shape, e.nbytes, path, offsets[e.name]) if e.name in offsets else e
            for e in source._entries
        ]
    source.paths = (path,)
    # A pickle on disk is a file source: planned in its key order like a safetensors file (the
    # huggingface_hub rule is for state dicts in memory), so split, convert and sharded-pickle
    # folders of the same weights give the same shards.
    source.shard_rule = "sequential"
    return source
