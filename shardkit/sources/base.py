"""The interface every source implements: tensor entries plus byte access."""

from __future__ import annotations

import abc
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Literal, TypeAlias

if TYPE_CHECKING:
    import torch

from ..errors import HeaderError
from ..formats.header import TensorEntry
from ..formats.index import Naming

__all__ = ["CheckpointSource", "ShardRule", "Source", "pread_exactly"]

# How sharding.plan places a tensor over the shard limit (see there).
ShardRule = Literal["huggingface_hub", "sequential"]

# What split, convert, info and open_source take: a path (file, index, folder; ``hf://...`` where
# the function says so), an in-memory state dict or module, or a source already open.
CheckpointSource: TypeAlias = "str | os.PathLike[str] | Mapping[str, torch.Tensor] | torch.nn.Module | Source"


def pread_exactly(fd: int, nbytes: int, offset: int, *, file: str, name: str) -> bytes:
    """``nbytes`` read at ``offset`` of ``fd``, or :class:`HeaderError` naming ``file`` and tensor ``name``.

    One check for every source: a file that shrank (or was rewritten) while it was read must
    never yield a short buffer that a writer would publish as a tensor.
    """
    data = os.pread(fd, nbytes, offset)
    if len(data) != nbytes:
        raise HeaderError(f"{file}: tensor {name!r} is truncated (got {len(data)} of {nbytes} bytes at offset "
                          f"{offset}; file shrank while reading?); restore the file, or convert from an intact copy")
    return data


class Source(abc.ABC):
    """A checkpoint to read from, as :func:`shardkit.open_source` returns it.

    ``entries()`` lists tensors in the source's natural order (file order for safetensors,
    insertion order for state dicts). ``read(entry, begin, end)`` returns bytes of one tensor's
    little-endian buffer; entries with ``file`` set may also be copied straight from that file.
    A source holds files open until :meth:`close` (it is a context manager).

    Attributes:
        description: a short human-readable name of the input, for messages.
        naming: the file-name convention (prefix, variant) the input uses.
        paths: the files the source reads.
        kernel_copy: whether the writer may copy tensor bytes straight from the files entries
            name (``copy_file_range``, reflinks), rather than through :meth:`read`.
    """

    description: str = "source"
    naming: Naming = Naming()
    paths: tuple[str, ...] = ()
    # How sharding.plan places a tensor over the shard limit: "sequential" keeps every shard one
    # run of the file order; in-memory state dicts use "huggingface_hub" to match its plan.
    shard_rule: ShardRule = "sequential"
    # False when the files that entries name give the layout (offsets, manifests) but their bytes
    # must come through read(): a Hub file streamed behind a sparse mirror (stores/streamed.py).
    kernel_copy: bool = True

    @abc.abstractmethod
    def entries(self) -> list[TensorEntry]:
        """Every tensor's name, dtype, shape and byte size (and file and offset when on disk)."""

    def metadata(self) -> dict[str, str]:
        """The checkpoint's string metadata (safetensors ``__metadata__``); empty when it has none."""
        return {}

    def aliases(self) -> dict[str, str]:
        """Dropped alias name → kept name, for tied tensors that are written once."""
        return {}

    @abc.abstractmethod
    def read(self, entry: TensorEntry, begin: int, end: int) -> bytes | memoryview:
        """Bytes ``begin:end`` of ``entry``'s little-endian data buffer (offsets relative to the tensor)."""

    def chunks(self, entry: TensorEntry, chunk_bytes: int) -> Iterator[bytes | memoryview]:
        """``entry``'s data buffer in order, in pieces of at most ``chunk_bytes`` (by :meth:`read`).

        A source whose bytes arrive in pieces of its own (a streamed file's windows) yields those
        instead, without copying them into ``chunk_bytes`` pieces.
        """
        for begin in range(0, entry.nbytes, chunk_bytes):
            yield self.read(entry, begin, min(begin + chunk_bytes, entry.nbytes))

    def held_fd(self, path: str) -> int | None:
        """A descriptor this source holds open on ``path``, if any.

        Kernel copies go through it, so they see the file this source validated even if another
        process has since renamed a new file onto the same path.
        """
        return self._held_fds().get(path)

    def _fd(self, path: str) -> int:
        """A read descriptor on ``path``, opened on first use and held until :meth:`close`."""
        fds = self._held_fds()
        if path not in fds:
            fds[path] = os.open(path, os.O_RDONLY)
        return fds[path]

    def _held_fds(self) -> dict[str, int]:
        # Created on demand so subclasses need not call an __init__ here.
        fds: dict[str, int] = self.__dict__.setdefault("_fds", {})
        return fds

    def close(self) -> None:
        """Close the descriptors this source holds."""
        fds = self._held_fds()
        for fd in fds.values():
            os.close(fd)
        fds.clear()

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
