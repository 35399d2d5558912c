"""Which bytes of a file share disk extents with another file (copy-on-write clones), via FIEMAP.

XFS (reflink), btrfs and other copy-on-write filesystems let ``copy_file_range`` clone a range
instead of copying it: both files then point at the same blocks, marked ``shared`` in the
``FS_IOC_FIEMAP`` ioctl's answer (the flag ``filefrag -v`` prints as ``shared``). The
filesystem says *that* an extent is shared, not with which file.

``None`` means "the filesystem does not tell" (tmpfs, some network filesystems, non-Linux
systems); 0 means it answers and nothing is shared (ext4 always answers 0).
"""

from __future__ import annotations

import errno
import os
import struct

__all__ = ["CLONE_BLOCK_BYTES", "shared_bytes", "shared_bytes_fd"]

# Clones happen in filesystem blocks; 4096 is the block of XFS, btrfs and ext4 on every common
# set-up, and a multiple of 4096 is aligned for smaller blocks too.
CLONE_BLOCK_BYTES = 4096

_FS_IOC_FIEMAP = 0xC020660B  # _IOWR('f', 11, struct fiemap)
_FIEMAP_EXTENT_LAST = 0x1
_FIEMAP_EXTENT_SHARED = 0x2000
_HEAD = struct.Struct("=QQIIII")       # fm_start, fm_length, fm_flags, fm_mapped_extents, fm_extent_count, reserved
_EXTENT = struct.Struct("=QQQQQIIII")  # fe_logical, fe_physical, fe_length, 2 reserved, fe_flags, 3 reserved
_BATCH = 256  # extents per ioctl call
_UNSUPPORTED = (errno.ENOTTY, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS, errno.EBADRQC)


def shared_bytes(path: str | os.PathLike[str], *, start: int = 0, end: int | None = None) -> int | None:
    """Bytes of ``path`` in ``[start, end)`` that share extents with another file, or None when unknown.

    Args:
        path: a regular file.
        start: first byte of the range.
        end: end of the range (default: the end of the file).

    Returns:
        The shared byte count, or None where the filesystem does not answer FIEMAP.

    shared_bytes("out/model-00001-of-00003.safetensors")
    4999610368
    """
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        return shared_bytes_fd(fd, start=start, end=end)
    finally:
        os.close(fd)


def shared_bytes_fd(fd: int, *, start: int = 0, end: int | None = None) -> int | None:
    """:func:`shared_bytes` on an open file descriptor (the writer asks about the file it just wrote).

    Extents still in the page cache (delayed allocation) are not shared: only clones are, and a
    clone is on the extent map as soon as ``copy_file_range`` returns.

    shared_bytes_fd(fd, start=4096)
    0
    """
    import fcntl

    end = os.fstat(fd).st_size if end is None else end
    total, cursor = 0, start
    while cursor < end:
        request = bytearray(_HEAD.pack(cursor, end - cursor, 0, 0, _BATCH, 0) + bytes(_EXTENT.size * _BATCH))
        try:
            fcntl.ioctl(fd, _FS_IOC_FIEMAP, request, True)
        except OSError as e:
            if e.errno in _UNSUPPORTED:
                return None
            raise
        mapped = _HEAD.unpack_from(request)[3]
        if mapped == 0:
            break  # the rest is a hole
        last = False
        for i in range(mapped):
            logical, _, length, _, _, flags, *_ = _EXTENT.unpack_from(request, _HEAD.size + i * _EXTENT.size)
            if flags & _FIEMAP_EXTENT_SHARED:
                total += max(0, min(end, logical + length) - max(start, logical))
            cursor = max(cursor, logical + length)
            last = last or bool(flags & _FIEMAP_EXTENT_LAST)
        if last:
            break
    return total
