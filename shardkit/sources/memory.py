"""In-memory sources: a state dict or an ``nn.Module``, tensors on any device.

Tensors are moved to the host one at a time, when the writer reaches them, so a model on a GPU
never needs a second full copy in host memory. Tied tensors (several names, one storage and the
same view) are written once: the first name in sorted order is kept and the others are recorded
as aliases, as huggingface_hub does.
"""

from __future__ import annotations

import os
from typing import Any, Collection, Mapping

from ..errors import InvalidInputError
from ..formats.header import TensorEntry
from ..formats.index import Naming
from ..units import tensor_nbytes
from .base import Source


class MemorySource(Source):
    """Tensors held in a mapping of name → ``torch.Tensor``."""

    def __init__(self, tensors: Mapping[str, Any], *, description: str = "in-memory state dict",
                 naming: Naming = Naming(), dedupe: bool = True, keep: Collection[str] = ()) -> None:
        from ..formats.dtypes import from_torch

        check_all_tensors(tensors, where=description)
        self.description = description
        self.naming = naming
        self._tensors = dict(tensors)
        self._aliases = find_aliases(self._tensors, keep=keep) if dedupe else {}
        self._entries = [
            TensorEntry(name, from_torch(t.dtype), tuple(t.shape), tensor_nbytes(from_torch(t.dtype), tuple(t.shape)))
            for name, t in self._tensors.items()
            if name not in self._aliases
        ]
        self._cached: tuple[str, memoryview] | None = None

    def entries(self) -> list[TensorEntry]:
        return list(self._entries)

    def aliases(self) -> dict[str, str]:
        return dict(self._aliases)

    def read(self, entry: TensorEntry, begin: int, end: int) -> bytes | memoryview:
        if entry.file is not None:
            return self._pread(entry, begin, end)
        if self._cached is None or self._cached[0] != entry.name:
            self._cached = None  # drop the previous tensor's host copy before making the next
            self._cached = (entry.name, host_bytes(self._tensors[entry.name]))
        return self._cached[1][begin:end]

    def _pread(self, entry: TensorEntry, begin: int, end: int) -> bytes:
        assert entry.file is not None
        return os.pread(self._fd(entry.file), end - begin, entry.offset + begin)

    def tensor(self, name: str) -> Any:
        return self._tensors[name]

    def close(self) -> None:
        self._cached = None
        super().close()


def check_all_tensors(tensors: Mapping[str, Any], *, where: str) -> None:
    """Refuse non-tensor values and tensors without host-readable data, naming them."""
    import torch

    bad = [k for k, v in tensors.items() if not isinstance(v, torch.Tensor)]
    if bad:
        shown = ", ".join(f"{k!r} ({type(tensors[k]).__name__})" for k in bad[:5])
        raise InvalidInputError(
            f"{where}: {len(bad)} value(s) are not tensors: {shown}{' ...' if len(bad) > 5 else ''}; "
            "select the state dict with key=... (CLI: --key) or remove them"
        )
    if not tensors:
        raise InvalidInputError(f"{where}: holds no tensors")
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise InvalidInputError(f"{where}: tensor names must be strings, got {name!r}")
        if t.is_meta:
            raise InvalidInputError(f"{where}: tensor {name!r} is on the meta device and has no data to save")
        if t.layout != torch.strided:
            raise InvalidInputError(f"{where}: tensor {name!r} has layout {t.layout}; only dense tensors can be saved")


def find_aliases(tensors: Mapping[str, Any], *, keep: Collection[str] = ()) -> dict[str, str]:
    """Names that view exactly the same memory as another name → the name that is kept.

    A name in ``keep`` is kept in preference (the one transformers reloads); else the first in sorted order.
    """
    groups: dict[tuple, list[str]] = {}
    for name, t in tensors.items():
        if t.numel() == 0:
            continue
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        groups.setdefault(key, []).append(name)
    aliases: dict[str, str] = {}
    for names in groups.values():
        kept, *dropped = sorted(names, key=lambda n: (n not in keep, n))
        aliases.update({d: kept for d in dropped})
    return aliases


def host_bytes(tensor: Any) -> memoryview:
    """A flat byte view of ``tensor`` on the host (copies only what must be copied)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous().reshape(-1)
    import torch

    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def module_state_dict(obj: Any) -> Mapping[str, Any]:
    """A module's state dict, or the mapping itself."""
    import torch

    if isinstance(obj, torch.nn.Module):
        return obj.state_dict()
    if isinstance(obj, Mapping):
        return obj
    raise InvalidInputError(f"expected a state dict or torch.nn.Module, got {type(obj).__name__}")
