"""In-memory sources: a state dict or an ``nn.Module``, tensors on any device.

Tensors are moved to the host one at a time, when the writer reaches them, so a model on a GPU
never needs a second full copy in host memory.

A state dict is saved exactly as ``huggingface_hub.save_torch_state_dict`` saves it: same files,
same tensors in each, same index. Names whose tensors overlap in one storage are tied: the first
name in sorted order among those covering the whole storage is written and the others are
recorded as aliases (views of part of it are dropped too, as the hub does). Where no name covers
the whole storage the hub refuses to save; shardkit writes each distinct view as its own tensor.
Zero-byte storages all share one address per device, so the hub puts every empty tensor in the
shard of the first one; :meth:`MemorySource.entries` lists them together for the same result.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Hashable, Mapping
from typing import TYPE_CHECKING

from ..errors import InvalidInputError, Option
from ..formats.header import TensorEntry
from ..formats.index import Naming
from ..units import tensor_nbytes
from .base import ShardRule, Source, pread_exactly

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("shardkit")


class MemorySource(Source):
    """Tensors held in a mapping of name → ``torch.Tensor``, planned like huggingface_hub."""

    shard_rule: ShardRule = "huggingface_hub"

    def __init__(self, tensors: Mapping[str, torch.Tensor], *, description: str = "in-memory state dict",
                 naming: Naming = Naming(), dedupe: bool = True, keep: Collection[str] = ()) -> None:
        from ..formats.dtypes import from_torch

        check_all_tensors(tensors, where=description)
        self.description = description
        self.naming = naming
        self._tensors = dict(tensors)
        self._aliases = find_aliases(self._tensors, keep=keep) if dedupe else {}
        self._entries = [
            TensorEntry(name, from_torch(t.dtype), tuple(t.shape), tensor_nbytes(from_torch(t.dtype), tuple(t.shape)))
            for name, t in ((n, self._tensors[n]) for n in hub_order(self._tensors))
            if name not in self._aliases
        ]
        self._cached: tuple[str, memoryview] | None = None

    def entries(self) -> list[TensorEntry]:
        return list(self._entries)

    def aliases(self) -> dict[str, str]:
        """Dropped name → written name, for the names a loader may serve from the written tensor.

        Only exact ties (same shape and dtype) qualify: a reshape or a partial view dropped as
        huggingface_hub drops it would come back with the written tensor's shape and data.
        """
        return {alias: kept for alias, kept in self._aliases.items()
                if _same_view(self._tensors[alias], self._tensors[kept])}

    def read(self, entry: TensorEntry, begin: int, end: int) -> bytes | memoryview:
        if entry.file is not None:
            return self._pread(entry, begin, end)
        if self._cached is None or self._cached[0] != entry.name:
            self._cached = None  # drop the previous tensor's host copy before making the next
            self._cached = (entry.name, host_bytes(self._tensors[entry.name]))
        return self._cached[1][begin:end]

    def _pread(self, entry: TensorEntry, begin: int, end: int) -> bytes:
        assert entry.file is not None
        return pread_exactly(self._fd(entry.file), end - begin, entry.offset + begin, file=entry.file,
                             name=entry.name)

    def tensor(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def close(self) -> None:
        self._cached = None
        super().close()


def check_all_tensors(tensors: Mapping[str, object], *, where: str) -> None:
    """Refuse non-tensor values and tensors without host-readable data, naming them."""
    import torch

    bad = [k for k, v in tensors.items() if not isinstance(v, torch.Tensor)]
    if bad:
        shown = ", ".join(f"{k!r} ({type(tensors[k]).__name__})" for k in bad[:5])
        raise InvalidInputError(
            f"{where}: {len(bad)} value(s) are not tensors: {shown}{' ...' if len(bad) > 5 else ''}; "
            "select the state dict with ", Option("key"), " or remove them"
        )
    if not tensors:
        raise InvalidInputError(f"{where}: holds no tensors")
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise InvalidInputError(f"{where}: tensor names must be strings, got {name!r}")
        if not isinstance(t, torch.Tensor):
            continue  # refused above
        if t.is_meta:
            raise InvalidInputError(f"{where}: tensor {name!r} is on the meta device and has no data to save")
        if t.layout != torch.strided:
            raise InvalidInputError(f"{where}: tensor {name!r} has layout {t.layout}; only dense tensors can be saved")


def find_aliases(tensors: Mapping[str, torch.Tensor], *, keep: Collection[str] = ()) -> dict[str, str]:
    """Names not to write because their memory is written under another name → that name.

    huggingface_hub's rule (``_remove_duplicate_names``): tensors of one storage whose byte
    ranges overlap form a group; among the names covering the whole storage, the first in sorted
    order is kept, or the first of those also in ``keep`` (the hub's ``preferred_names``). A group
    where none covers it keeps one name per distinct view instead (the hub raises there).

    Args:
        tensors: the state dict.
        keep: names to keep in preference (the ones transformers reloads).

    Returns:
        Dropped name → kept name.

    >>> import torch
    >>> w = torch.zeros(4, 2)
    >>> find_aliases({"lm_head.weight": w, "embed.weight": w, "row": w[0], "other": torch.ones(1)})
    {'lm_head.weight': 'embed.weight', 'row': 'embed.weight'}
    """
    aliases: dict[str, str] = {}
    for group in _shared_groups(tensors):
        complete = sorted(n for n in group if _is_complete(tensors[n]))
        if not complete:
            aliases.update(_repeated_views(group, tensors, keep))
            continue
        kept = min(complete, key=lambda n: (n not in keep, n))
        dropped = sorted(n for n in group if n != kept)
        partial = [n for n in dropped if n not in complete]
        if partial:
            logger.warning("%d tensor(s) view part of %r and are not saved (as huggingface_hub does): %s; "
                           "save a .clone() of them to keep them", len(partial), kept, ", ".join(partial[:5]))
        aliases.update(dict.fromkeys(dropped, kept))
    return dict(sorted(aliases.items()))


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and a.data_ptr() == b.data_ptr()


def _shared_groups(tensors: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """Names whose tensors overlap in one non-empty storage (``_find_shared_tensors``)."""
    by_storage: dict[tuple[torch.device, int, int], list[str]] = {}
    for name, t in tensors.items():
        storage = t.untyped_storage()
        if storage.data_ptr() != 0 and storage.nbytes() != 0:
            by_storage.setdefault((t.device, storage.data_ptr(), storage.nbytes()), []).append(name)
    groups: list[list[str]] = []
    for names in by_storage.values():
        # Sorted byte ranges; a range starting at or past the end of the ones before starts a
        # group. The hub compares with the last range's end only; with the furthest end, as here,
        # the groups differ only in state dicts the hub refuses to save.
        areas = sorted((tensors[n].data_ptr(), _end_ptr(tensors[n]), n) for n in names)
        stop = None
        for begin, end, name in areas:
            if stop is not None and begin < stop:
                groups[-1].append(name)
                stop = max(stop, end)
            else:
                groups.append([name])
                stop = end
    return groups


def _end_ptr(t: torch.Tensor) -> int:
    """One past the last element's first byte in logical order (the hub's ``_end_ptr``)."""
    if t.numel() == 0:
        return t.data_ptr()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr() + (last + 1) * t.element_size()


def _is_complete(t: torch.Tensor) -> bool:
    """Whether ``t`` starts where its storage starts and has as many bytes (the hub's test)."""
    storage = t.untyped_storage()
    return t.data_ptr() == storage.data_ptr() and t.numel() * t.element_size() == storage.nbytes()


def _repeated_views(group: list[str], tensors: Mapping[str, torch.Tensor], keep: Collection[str]) -> dict[str, str]:
    """Within ``group``, names that view exactly the same memory as a name preferred to them."""
    kept: dict[Hashable, str] = {}
    aliases: dict[str, str] = {}
    for name in sorted(group, key=lambda n: (n not in keep, n)):
        t = tensors[name]
        key = (t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if t.numel() and key in kept:
            aliases[name] = kept[key]
        kept.setdefault(key, name)
    return aliases


def hub_order(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The names in key order, except that later tensors of a zero-byte storage follow its first.

    huggingface_hub identifies a storage by ``(device, address, bytes)``; every zero-byte storage
    has address 0, so the hub ties all empty tensors of a device to the first and writes them in
    its shard. Listed together, they land there under any greedy plan, being zero bytes.

    >>> import torch
    >>> hub_order({"e1": torch.zeros(0), "a": torch.ones(2), "e2": torch.zeros(3, 0)})
    ['e1', 'e2', 'a']
    """
    runs: dict[Hashable, list[str]] = {}
    for name, t in tensors.items():
        storage = t.untyped_storage()
        key: Hashable = (str(t.device), storage.data_ptr()) if storage.nbytes() == 0 else ("name", name)
        runs.setdefault(key, []).append(name)
    return [name for run in runs.values() for name in run]


def host_bytes(tensor: torch.Tensor) -> memoryview:
    """A flat byte view of ``tensor`` on the host (copies only what must be copied)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous().reshape(-1)
    import torch

    return t.view(torch.uint8).numpy().data.cast("B")


def module_state_dict(obj: object) -> Mapping[str, torch.Tensor]:
    """A module's state dict, or the mapping itself."""
    import torch

    if isinstance(obj, torch.nn.Module):
        return obj.state_dict()
    if isinstance(obj, Mapping):
        return obj
    raise InvalidInputError(f"expected a state dict or torch.nn.Module, got {type(obj).__name__}")
