"""The interface every source implements: tensor entries plus byte access."""

from __future__ import annotations

import abc

from ..format import TensorEntry
from ..index import Naming


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
        fds = getattr(self, "_fds", None)
        return fds.get(path) if isinstance(fds, dict) else None

    def close(self) -> None:
        pass

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
