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
import os
import pickle
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import InvalidInputError, SourceNotFoundError, UnsafePickleError
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
    """Unpickle ``folder/.metadata`` with the allowlist above.

    load_metadata("fsdp-checkpoint/").state_dict_metadata.keys()
    """
    path = os.path.join(folder, METADATA_FILE)
    if not os.path.isfile(path):
        data = sorted(n for n in os.listdir(folder) if n.endswith(DATA_SUFFIX))
        raise SourceNotFoundError(
            f"{folder}: DCP folder has no {METADATA_FILE} file"
            + (f" (found {len(data)} .distcp data file(s); the save did not finish or the file was lost)" if data else "")
        )
    if os.path.getsize(path) > MAX_METADATA_BYTES:
        raise InvalidInputError(f"{path}: too large to be DCP metadata")
    try:
        with open(path, "rb") as f:
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
