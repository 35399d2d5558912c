"""A checkpoint file read by byte range, wherever it lives: a local descriptor or a remote object.

The readers (parallel ``pread``/``O_DIRECT``, or ranged requests to a store) fill caller-owned
memory through this one interface, so loading, splitting and verifying read a local file, an
``hf://`` repository and an ``s3://`` bucket the same way.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class RangeFile(Protocol):
    """What the readers need from one file.

    ``name`` is what messages show (a path or a URL, never a secret); ``size_bytes`` is the file's
    length. ``read_into(offset, out)`` fills ``out`` with exactly the bytes at ``offset`` ..
    ``offset + len(out)``, or raises a :class:`~shardkit.errors.ShardkitError` naming the file and
    the range; it may be called from several threads at once. ``close`` is idempotent.
    """

    @property
    def name(self) -> str: ...

    @property
    def size_bytes(self) -> int: ...

    def read_into(self, offset: int, out: memoryview) -> None: ...

    def close(self) -> None: ...
