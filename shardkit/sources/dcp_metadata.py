"""The pickled parts of a DCP folder, read with allowlists so that no pickled code ever runs.

* ``.metadata``: DCP's own dataclasses and enums plus a few plain torch values (dtypes, sizes);
  :func:`load_metadata` returns the ``Metadata`` object with ``state_dict_metadata`` and
  ``storage_data``.
* each chunk's embedded ``data.pkl``: read into a :class:`StoredTensor` (storage key, dtype,
  offset, layout) by :func:`load_chunk_record`, without building a tensor.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import math
import os
import pickle
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import InvalidInputError, SourceNotFoundError, UnsafePickleError
from ..formats.links import open_inside
from ..formats.suffixes import DCP_DATA_SUFFIX as DATA_SUFFIX

if TYPE_CHECKING:
    from collections.abc import Sequence
    from types import ModuleType

    from torch.distributed.checkpoint.metadata import Metadata

METADATA_FILE = ".metadata"
MAX_METADATA_BYTES = 2_000_000_000


# ----------------------------------------------------------------------------- .metadata

class _MetadataUnpickler(pickle.Unpickler):
    """Only DCP's own metadata dataclasses/enums and a few plain torch values may be built."""

    def find_class(self, module: str, name: str) -> object:
        import torch

        value = _allowed_metadata_global(module, name, torch)
        if value is None:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")
        return value


def _allowed_metadata_global(module: str, name: str, torch: ModuleType) -> object:
    import collections
    import importlib
    import pathlib

    plain = {("torch", "Size"): torch.Size, ("torch.serialization", "_get_layout"): None,
             ("collections", "OrderedDict"): collections.OrderedDict}
    if (module, name) in plain:
        return plain[(module, name)] or torch.serialization._get_layout
    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    if module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"):
        return getattr(pathlib, name)
    if module.startswith(("torch.distributed.checkpoint", "torch.distributed._shard")):
        try:
            value = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return None
        if isinstance(value, type) and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum)):
            return value
    return None


def load_metadata(folder: str) -> Metadata:
    """Unpickle ``folder/.metadata`` with the allowlist above, read through one checked descriptor.

    The file is opened by :func:`~shardkit.formats.links.open_inside`: a ``.metadata`` that is a
    symlink leading outside the folder, a FIFO or a device is refused before a byte is read.

    load_metadata("fsdp-checkpoint/").state_dict_metadata.keys()
    """
    path = os.path.join(folder, METADATA_FILE)
    try:
        fd = open_inside(folder, METADATA_FILE, where=folder, max_bytes=MAX_METADATA_BYTES)
    except FileNotFoundError:
        data = sorted(n for n in os.listdir(folder) if n.endswith(DATA_SUFFIX))
        raise SourceNotFoundError(
            f"{folder}: DCP folder has no {METADATA_FILE} file"
            + (f" (found {len(data)} .distcp data file(s); the save did not finish or the file was lost)" if data else "")
        ) from None
    try:
        with os.fdopen(fd, "rb") as f:
            metadata: Metadata = _MetadataUnpickler(f).load()  # checked below
    except pickle.UnpicklingError as e:
        raise UnsafePickleError(f"{path}: refused to unpickle DCP metadata ({e}); shardkit never executes pickled code") from e
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError, struct.error) as e:
        raise InvalidInputError(f"{path}: not readable DCP metadata ({type(e).__name__}: {e})") from e
    if not hasattr(metadata, "state_dict_metadata") or not hasattr(metadata, "storage_data"):
        raise InvalidInputError(f"{path}: not DCP metadata (found {type(metadata).__name__})")
    return metadata


# ----------------------------------------------------------------------------- chunk records

@dataclass(frozen=True)
class StoredTensor:
    """Where a chunk's bytes are inside its torch.save record: dtype code, storage key, element offset, layout."""

    storage_dtype: str
    key: str
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


class _BlobUnpickler(pickle.Unpickler):
    """Reads a chunk's ``data.pkl`` into a :class:`StoredTensor` without building a tensor."""

    def find_class(self, module: str, name: str) -> object:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _record_tensor
        if (module, name) == ("torch._utils", "_rebuild_tensor_v3"):  # dtypes without a typed storage (fp8...)
            return _record_tensor_v3
        if (module, name) == ("collections", "OrderedDict"):
            import collections

            return collections.OrderedDict
        if module in ("torch", "torch.storage") and name.endswith("Storage"):
            return ("storage-type", name)
        if module == "torch":
            import torch

            from ..formats.dtypes import from_torch

            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype):
                return ("dtype", from_torch(value))
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: object) -> tuple[str, str]:
        if not (isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage"):
            raise pickle.UnpicklingError("unexpected persistent id")
        return pid[1][1] if isinstance(pid[1], tuple) else str(pid[1]), str(pid[2])


def _record_tensor(storage: tuple[str, str], storage_offset: int, shape: Sequence[int], stride: Sequence[int],
                   *_: object) -> StoredTensor:
    storage_type, key = storage
    return StoredTensor(_STORAGE_CODES.get(storage_type, storage_type), key, int(storage_offset), tuple(shape),
                         tuple(stride))


def _record_tensor_v3(storage: tuple[str, str], storage_offset: int, shape: Sequence[int], stride: Sequence[int],
                      requires_grad: object, hooks: object, dtype: Any, *_rest: object) -> StoredTensor:
    _, key = storage
    code = dtype[1] if isinstance(dtype, tuple) and dtype[:1] == ("dtype",) else "?"
    return StoredTensor(code, key, int(storage_offset), tuple(shape), tuple(stride))


_STORAGE_CODES = {
    "FloatStorage": "F32", "DoubleStorage": "F64", "HalfStorage": "F16", "BFloat16Storage": "BF16",
    "LongStorage": "I64", "IntStorage": "I32", "ShortStorage": "I16", "CharStorage": "I8",
    "ByteStorage": "U8", "BoolStorage": "BOOL", "ComplexFloatStorage": "C64",
    "Float8_e4m3fnStorage": "F8_E4M3", "Float8_e5m2Storage": "F8_E5M2",
}


def load_chunk_record(raw: bytes) -> object:
    """A chunk's ``data.pkl`` as a :class:`StoredTensor` (anything else it holds is returned as is).

    Raises ``pickle.UnpicklingError`` for any global outside the allowlist.

    load_chunk_record(zip_file.read("archive/data.pkl")).key
    '0'
    """
    return _BlobUnpickler(io.BytesIO(raw)).load()


# ----------------------------------------------------------------------------- chunk tiling

MAX_DIM = 2**63  # every dimension below it: torch sizes are signed 64-bit
MAX_OVERLAP_CHECKS = 10_000_000  # box comparisons per tensor; real layouts (FSDP rows, TP columns) need a few per chunk

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def check_tiling(shape: Sequence[int], boxes: Sequence[Box], *, where: str) -> None:
    """Refuse chunks that do not tile ``shape`` exactly: outside it, overlapping, or leaving elements uncovered.

    Each chunk lies inside the shape, no two overlap, and their element counts sum to the shape's:
    so together they cover every element exactly once, and nothing is ever filled with zeros.

    >>> check_tiling((4, 2), [((0, 0), (2, 2)), ((2, 0), (2, 2))], where="x")
    >>> check_tiling((4, 2), [((0, 0), (2, 2))], where="x")
    Traceback (most recent call last):
    ...
    shardkit.errors.InvalidInputError: x: its chunks cover 4 of the 8 elements of shape [4, 2]; ...
    """
    fix = "a DCP checkpoint's chunks must tile each tensor exactly: the checkpoint is damaged or was edited; re-save it"
    if any(not isinstance(d, int) or d < 0 or d >= MAX_DIM for d in shape):
        raise InvalidInputError(f"{where}: shape {list(shape)} has a dimension that is not an integer in [0, 2^63)")
    covered = 0
    for offsets, sizes in boxes:
        if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                not isinstance(v, int) or v < 0 for v in (*offsets, *sizes)) or any(
                o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True)):
            raise InvalidInputError(f"{where}: a chunk at {list(offsets)} of size {list(sizes)} lies outside shape "
                                    f"{list(shape)}; {fix}")
        covered += math.prod(sizes)
    total = math.prod(shape)
    if covered != total:
        raise InvalidInputError(f"{where}: its chunks cover {covered} of the {total} elements of shape {list(shape)}; "
                                f"{fix}")
    _check_disjoint([b for b in boxes if math.prod(b[1])], where=where, fix=fix)


def _check_disjoint(boxes: list[Box], *, where: str, fix: str) -> None:
    """No two non-empty chunks share an element: a sweep along the first dimension."""
    if len(boxes) < 2:
        return
    if not boxes[0][0]:  # a scalar: two chunks of one element each always overlap
        raise InvalidInputError(f"{where}: {len(boxes)} chunks of one scalar; {fix}")
    active: list[Box] = []
    checks = 0
    for box in sorted(boxes):
        active = [a for a in active if a[0][0] + a[1][0] > box[0][0]]
        checks += len(active)
        if checks > MAX_OVERLAP_CHECKS:
            raise InvalidInputError(f"{where}: {len(boxes)} chunks overlapping along the first dimension, too many to "
                                    f"check; {fix}")
        for other in active:
            if all(o1 < o2 + s2 and o2 < o1 + s1 for o1, s1, o2, s2 in zip(box[0], box[1], other[0], other[1], strict=True)):
                raise InvalidInputError(f"{where}: chunks at {list(other[0])} and {list(box[0])} overlap; {fix}")
        active.append(box)
