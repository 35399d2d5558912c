"""The interface every source implements: tensor entries plus byte access."""

from __future__ import annotations

import abc
import os

from ..formats.header import TensorEntry
from ..formats.index import Naming


class Source(abc.ABC):
    """A checkpoint to read from.

    ``entries()`` lists tensors in the source's natural order (file order for safetensors,
    insertion order for state dicts). ``read(entry, begin, end)`` returns bytes of one tensor's
    little-endian buffer; entries with ``file`` set may also be copied straight from that file.
    """

    description: str = "source"
    naming: Naming = Naming()
    paths: tuple[str, ...] = ()

    @abc.abstractmethod
    def entries(self) -> list[TensorEntry]: ...

    def metadata(self) -> dict[str, str]:
        return {}

    def aliases(self) -> dict[str, str]:
        """Dropped alias name → kept name, for tied tensors that are written once."""
        return {}

    @abc.abstractmethod
    def read(self, entry: TensorEntry, begin: int, end: int) -> bytes | memoryview: ...

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
        return self.__dict__.setdefault("_fds", {})

    def close(self) -> None:
        fds = self._held_fds()
        for fd in fds.values():
            os.close(fd)
        fds.clear()

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
