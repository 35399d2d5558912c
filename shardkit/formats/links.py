"""The checkpoint-folder boundary: which files shardkit may open, create, rename or delete for a folder.

Which symlinks shardkit follows is the one rule every reader and ``push`` apply to a folder's files.

A file in a checkpoint folder that is a symlink is followed only to a regular file inside the
folder, or into the ``blobs/`` of a Hugging Face cache: the cache repo whose ``snapshots/`` holds
the folder (the cache's own layout), or any cache repo folder (``models--org--name/blobs/``),
which ``hf download --local-dir`` and many user scripts link to. Anything else, e.g. a link a
downloaded repo planted towards ``~/.ssh``, a token or another project's weights, leads outside.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from collections.abc import Callable

from ..errors import OutsideFolderError as OutsideFolderError  # re-exported: defined with every public error
from ..errors import Part
from ..errors import UntrustedFileError as UntrustedFileError  # re-exported: defined with every public error

__all__ = ["BOUNDARY_RULE", "LINK_RULE", "MAX_JSON_BYTES", "OutsideFolderError", "UntrustedFileError", "check_name", "check_write_target",
           "fd_path", "leads_outside", "link_target", "loads_json", "open_inside", "open_parent", "open_regular", "parse_json", "read_fd", "read_inside",
           "read_regular", "write_fd"]

LINK_RULE = "shardkit follows such links only inside the folder or into a Hugging Face cache's blobs/"
_CACHE_REPO_RE = re.compile(r"^(models|datasets|spaces)--.+")


def link_target(path: str) -> str | None:
    """Where the symlink ``path`` finally leads (every link resolved), or None if it is not a symlink.

    link_target("ckpt/config.json")
    '/home/me/.cache/huggingface/hub/models--org--m/blobs/3c1e...'
    """
    return os.path.realpath(path) if os.path.islink(path) else None


def leads_outside(target: str, folder: str) -> bool:
    """Whether a link in ``folder`` resolving to ``target`` (a real path) leaves what shardkit trusts.

    >>> leads_outside("/data/ckpt/real.safetensors", "/data/ckpt")
    False
    >>> leads_outside("/home/me/.ssh/id_rsa", "/data/ckpt")
    True
    """
    return not (any(_inside(target, root) for root in _link_roots(folder)) or _in_cache_blobs(target))


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def _link_roots(folder: str) -> list[str]:
    """The folder itself, and ``<repo>/blobs`` for a folder inside an HF-cache snapshot."""
    real = os.path.realpath(folder)
    roots = [real]
    parts = os.path.abspath(folder).split(os.sep)
    if "snapshots" in parts:
        repo = os.sep.join(parts[: len(parts) - 1 - parts[::-1].index("snapshots")]) or os.sep
        roots.append(os.path.realpath(os.path.join(repo, "blobs")))
    return roots


def _in_cache_blobs(target: str) -> bool:
    """``<cache>/models--org--name/blobs/<blob>``: a file the Hugging Face cache holds."""
    blobs = os.path.dirname(target)
    return os.path.basename(blobs) == "blobs" and bool(_CACHE_REPO_RE.match(os.path.basename(os.path.dirname(blobs))))


# ----------------------------------------------------------------------------- the folder boundary
#
# Every path shardkit reads, writes, renames or deletes on behalf of a checkpoint folder (shards,
# index, manifest, config, side files, journal entries, pipeline components, hf:// mirror entries,
# push uploads) is a *name inside a folder*. :func:`check_name` refuses names that could leave it
# (absolute, ``..``, empty parts, backslashes, control characters); :func:`open_inside` opens the
# file through an ``openat``-style walk in which no parent may be a symlink and the file itself is a
# regular file (a symlink only under the link rule above); reads then go through that descriptor,
# so a swap after the check cannot change what is read. :func:`check_write_target` is the same
# walk for names about to be created, renamed onto or deleted: nothing through a link, never a folder.


MAX_JSON_BYTES = 100_000_000  # the cap on any JSON shardkit reads (configs, indexes, manifests, journals)
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)  # O_NONBLOCK: a FIFO never blocks open


def check_name(name: object, *, where: str) -> list[str]:
    """The parts of ``name``, a relative ``/``-separated path that stays inside its folder.

    >>> check_name("unet/config.json", where="x")
    ['unet', 'config.json']
    """
    if not isinstance(name, str) or not name:
        raise OutsideFolderError(f"{where}: {name!r} is not a file name")
    if name.startswith(("/", "\\")) or os.path.isabs(name) or "\\" in name:
        raise OutsideFolderError(f"{where}: {name!r} is an absolute path or uses backslashes; only names inside the "
                                 "folder are allowed")
    if any(ord(c) < 32 or ord(c) == 127 or 0xD800 <= ord(c) <= 0xDFFF for c in name):
        raise OutsideFolderError(f"{where}: {name!r} contains control characters or invalid Unicode")
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise OutsideFolderError(f"{where}: {name!r} leaves the folder or has empty parts ('..', '.', '//', a "
                                 "trailing '/'); only names inside the folder are allowed")
    return parts


def open_parent(folder: str, name: str, *, where: str) -> tuple[int, str]:
    """``(dir_fd, base)``: a descriptor on the folder holding ``name`` (no symlink among its parents) and its last part.

    Renames and unlinks then use ``dir_fd``, so a parent swapped for a link after the check changes nothing.
    Raises ``FileNotFoundError`` when a parent does not exist.
    """
    parts = check_name(name, where=where)
    return _open_parent(folder, parts, where=where, name=name), parts[-1]


def _open_parent(folder: str, parts: list[str], *, where: str, name: str) -> int:
    try:
        dir_fd = os.open(folder or ".", os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise OutsideFolderError(f"{where}: cannot open the folder {folder} ({e.strerror or e})") from e
    for part in parts[:-1]:
        try:
            sub = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                          dir_fd=dir_fd)
        except OSError as e:
            os.close(dir_fd)
            if e.errno == errno.ENOENT:
                raise FileNotFoundError(errno.ENOENT, "no such file", os.path.join(folder, name)) from e
            raise OutsideFolderError(f"{where}: {name!r} passes through {part!r}, which is a symlink or not a folder; "
                                     f"{BOUNDARY_RULE}") from e
        os.close(dir_fd)
        dir_fd = sub
    return dir_fd


BOUNDARY_RULE = ("shardkit reads and writes only regular files inside the folder, never through a symlinked folder "
                 "(file links only inside the folder or into a Hugging Face cache's blobs/)")


def open_inside(folder: str, name: str, *, where: str, max_bytes: int | None = None, links: bool = True) -> int:
    """A read-only descriptor on the regular file ``folder/name``, opened once and checked.

    No parent of ``name`` may be a symlink; ``name`` itself may be one only when ``links`` and the
    link rule allow it (:func:`leads_outside`). FIFOs, devices, sockets and folders are refused
    before any byte is read; ``max_bytes`` caps the size ``fstat`` gives. Raises
    ``FileNotFoundError`` when the file does not exist, :class:`OutsideFolderError` otherwise.

    fd = open_inside("ckpt", "config.json", where="ckpt", max_bytes=MAX_JSON_BYTES)
    """
    parts = check_name(name, where=where)
    path = os.path.join(folder, *parts)
    dir_fd = _open_parent(folder, parts, where=where, name=name)
    try:
        fd = os.open(parts[-1], _OPEN_FLAGS | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.EMLINK):
            if e.errno == errno.ENOENT:
                raise
            raise OutsideFolderError(f"{where}: {path} cannot be opened ({e.strerror or e})") from e
        fd = _open_link(path, folder, where=where, links=links)
    finally:
        os.close(dir_fd)
    return _checked(fd, path, where=where, max_bytes=max_bytes)


def _open_link(path: str, folder: str, *, where: str, links: bool) -> int:
    target = os.path.realpath(path)
    if not links or leads_outside(target, folder):
        raise OutsideFolderError(f"{where}: {path} is a symlink leading outside the folder (to {target}); {LINK_RULE}; "
                                 "nothing behind it was read")
    try:
        return os.open(target, _OPEN_FLAGS | os.O_NOFOLLOW)
    except OSError as e:
        raise OutsideFolderError(f"{where}: {path} is a symlink to {target}, which cannot be opened as a regular "
                                 f"file ({e.strerror or e})") from e


def open_regular(path: str, *, where: str | None = None, max_bytes: int | None = None) -> int:
    """A read-only descriptor on ``path`` (named by the user: links followed), refused unless a regular file.

    fd = open_regular("model.safetensors")
    """
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        raise
    except OSError as e:
        raise OutsideFolderError(f"{where or path}: cannot be opened ({e.strerror or e})") from e
    return _checked(fd, path, where=where or path, max_bytes=max_bytes)


def _checked(fd: int, path: str, *, where: str, max_bytes: int | None) -> int:
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OutsideFolderError(f"{where}: {path} is {_kind(st.st_mode)}, not a regular file; refused before "
                                     "reading it")
        if max_bytes is not None and st.st_size > max_bytes:
            raise OutsideFolderError(f"{where}: {path} is {st.st_size} bytes, over the {max_bytes}-byte limit for "
                                     "this kind of file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "a special file"


def fd_path(fd: int, path: str) -> str:
    """A path naming the very file open on ``fd`` (``/proc/self/fd/N``), for a library that opens by name.

    Opening it reaches the checked file even if ``path`` was swapped since; ``path`` itself where
    the system has no ``/proc``.
    """
    proc = f"/proc/self/fd/{fd}"
    return proc if os.path.exists(proc) else path


def read_fd(fd: int, *, path: str) -> bytes:
    """Every byte of the regular file open on ``fd``: exactly ``fstat``'s size, checked."""
    size_bytes = os.fstat(fd).st_size
    chunks, got = [], 0
    while got < size_bytes:
        chunk = os.pread(fd, min(size_bytes - got, 1 << 24), got)
        if not chunk:
            raise OutsideFolderError(f"{path}: shrank while being read ({got} of {size_bytes} bytes); try again")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def write_fd(fd: int, data: bytes | bytearray | memoryview, *, path: str, offset: int | None = None,
             wrote: Callable[[int], None] | None = None) -> None:
    """Write every byte of ``data`` on ``fd``: at its position, or from ``offset`` (``pwrite``); each call's count
    checked. The one write loop: shards, GGUF files, plan records and the stores' local copies all write through it.

    ``wrote(n)`` after each call (the writer's fault points count output bytes there).

    Raises:
        OSError: the system's; or ``EIO`` for a call that wrote nothing (never for a regular file: a loop would spin
            forever instead), its ``filename`` ``path`` and its ``strerror`` how far it got. Callers turn it into
            their own error (:class:`~shardkit.errors.ShardkitWriteError`, :class:`~shardkit.errors.StoreError`).
    """
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        rest = view[done:]
        written = os.write(fd, rest) if offset is None else os.pwrite(fd, rest, offset + done)
        if written <= 0:
            at = "" if offset is None else f" at offset {offset + done}"
            raise OSError(errno.EIO, f"took 0 of {len(rest)} bytes{at}", path)
        done += written
        if wrote is not None:
            wrote(written)


def read_inside(folder: str, name: str, *, where: str, max_bytes: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of ``folder/name`` through :func:`open_inside`, at most ``max_bytes``."""
    fd = open_inside(folder, name, where=where, max_bytes=max_bytes)
    try:
        return read_fd(fd, path=os.path.join(folder, name))
    finally:
        os.close(fd)


def read_regular(path: str, *, where: str | None = None, max_bytes: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of ``path`` (named by the user) through :func:`open_regular`, at most ``max_bytes``."""
    fd = open_regular(path, where=where, max_bytes=max_bytes)
    try:
        return read_fd(fd, path=path)
    finally:
        os.close(fd)


def _no_constants(token: str) -> float:
    raise ValueError(f"{token} is not a JSON number")


def loads_json(data: bytes | bytearray | str,
               object_pairs_hook: Callable[[list[tuple[str, object]]], object] | None = None) -> object:
    """JSON already read through a checked descriptor or a bounded buffer, as Python values (``NaN``/``Infinity`` refused).

    The one place besides :func:`parse_json` where shardkit parses JSON; the caller names the file
    and field. Raises ``ValueError`` (bad UTF-8, bad JSON, integers over Python's digit limit) or
    ``RecursionError`` (nested too deeply).

    >>> loads_json(b'{"a": [1, 2]}')
    {'a': [1, 2]}
    """
    text = data if isinstance(data, str) else bytes(data).decode("utf-8")
    return json.loads(text, parse_constant=_no_constants, object_pairs_hook=object_pairs_hook)


def parse_json(data: bytes, *, path: Part, what: str = "JSON file") -> object:
    """JSON bytes as Python values; any malformation (depth, huge numbers, NaN, bad UTF-8) is one line naming ``path``."""
    try:
        return loads_json(data)
    except RecursionError as e:
        raise UntrustedFileError(path, f": not valid JSON (a {what} nested too deeply)") from e
    except ValueError as e:  # also bad UTF-8, and integers over Python's digit limit
        raise UntrustedFileError(path, f": not valid JSON (a UTF-8 {what} expected: {str(e)[:200]})") from e


def check_write_target(folder: str, name: str, *, where: str, may_exist: bool = True, link_ok: bool = False) -> str:
    """The path of ``folder/name`` about to be created, renamed onto or deleted: no symlinked parent, never a folder.

    An existing file there must be a regular file (``may_exist``), or a symlink itself when
    ``link_ok`` (unlinked or replaced, never followed); a symlink among the parents refuses the
    name. Raises :class:`OutsideFolderError` with one line naming it.
    """
    parts = check_name(name, where=where)
    path = os.path.join(folder, *parts)
    try:
        dir_fd = _open_parent(folder, parts, where=where, name=name)
    except FileNotFoundError:
        return path  # a parent that does not exist yet: nothing there to leave through
    try:
        st = os.stat(parts[-1], dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return path
    finally:
        os.close(dir_fd)
    if link_ok and stat.S_ISLNK(st.st_mode) and may_exist:
        return path
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode) or not may_exist:
        what = "a symlink" if stat.S_ISLNK(st.st_mode) else _kind(st.st_mode) if not stat.S_ISREG(st.st_mode) else \
            "an existing file"
        raise OutsideFolderError(f"{where}: {path} is {what}; shardkit only creates, replaces or deletes its own "
                                 f"regular files inside the folder; {BOUNDARY_RULE}")
    return path
