"""Progress counting, background fsync and side-file copies: what every writing job shares around
:func:`~shardkit.sharding.writer.write_safetensors`.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import Future

from .. import _faults
from ..atomic.journal import fsync_dir as _fsync_path  # fsync works the same on a file
from ..errors import ShardkitWriteError, describe_os_error
from ..formats.links import open_regular
from ..units import ByteCounter

__all__ = ["BackgroundSync", "ByteCounter", "copy_side_file", "write_error"]


class BackgroundSync:
    """fsync finished files on a worker thread while the next one is written.

    Copying is page-cache speed and flushing is disk speed; overlapping them keeps the disk busy
    the whole time instead of idling while the next shard is copied. :meth:`wait` must return
    before anything that names these files is published.
    """

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardkit-fsync")
        self._pending: list[tuple[str, Future[None]]] = []

    def submit(self, path: str) -> None:
        self._pending.append((path, self._pool.submit(_fsync_path, path)))

    def wait(self) -> None:
        """Block until every submitted file is on disk; raise the first failure."""
        pending, self._pending = self._pending, []
        for path, future in pending:
            try:
                future.result()
            except OSError as e:
                raise write_error(path, e) from e

    def __enter__(self) -> BackgroundSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True)


def copy_side_file(src: str, path: str, *, sync: BackgroundSync) -> None:
    """Copy a file that travels with the weights (config, tokenizer...) to a new ``path``.

    Its fsync goes to ``sync`` like a shard's: a side file that is published but still only in
    the page cache could come back empty after a power loss, beside complete shards.
    """
    fd = open_regular(src)  # checked descriptor: a file swapped for a FIFO or device since listing is refused unread
    try:
        with os.fdopen(fd, "rb") as f, open(path, "wb") as out:
            shutil.copyfileobj(f, out, 1 << 20)
    except OSError as e:
        raise write_error(path, e) from e
    sync.submit(path)
    _faults.point("file-done:side-file")


def write_error(path: str, e: OSError) -> ShardkitWriteError:
    return ShardkitWriteError(f"writing {path} failed: {describe_os_error(e)}; nothing was published")
