"""``shardkit.manifest.json``: the integrity record shardkit writes with every checkpoint folder.

One JSON file at the root of each output that shardkit publishes (a checkpoint folder, or the
top of a pipeline folder), written and fsynced in the same transaction as the files it lists,
so it never disagrees with them. It lists every file of that transaction by its path relative
to the manifest's folder (``unet/diffusion_pytorch_model-00001-of-00002.safetensors``)::

    {
      "format": "shardkit.manifest",
      "version": 1,
      "tensor_digest": "crc32",
      "files": {
        "model-00001-of-00002.safetensors": {
          "size_bytes": 4999610368,
          "data_start": 4096,
          "header_crc32": "1a2b3c4d",
          "tensors": {"conv_in.weight": {"data_offsets": [0, 69120], "crc32": "0badf00d"}}
        },
        "config.json": {"size_bytes": 1712, "sha256": "3c1e..."}
      }
    }

A shard (a safetensors file) is recorded by crc32s: ``header_crc32`` covers bytes
``[0, data_start)`` and each tensor's ``crc32`` covers ``data_offsets`` (relative to
``data_start``, as in the file's own header), so together they cover every byte and name the
tensor that changed. Every other file (index, configs) gets the ``sha256`` of its bytes. Why not a
sha256 of each shard: it costs about as much CPU as the copy itself (1.0 s/GiB against crc32's
0.4 s/GiB here), which made a 10 GB split 1.6x slower on 2 cores, and a copy-on-write reshard
would have to read every byte it cloned. crc32 catches bit rot and bad copies, which is what
this record is for; it is not a signature against deliberate tampering (the Hub's LFS sha256,
which ``push`` computes, is). A tensor copied from a checkpoint that has a manifest carries its
crc32 from there, unread. A tensor copied inside an object store (``UploadPartCopy``) from a
source without a manifest is recorded with ``"crc32": null``: not hashed, never a guessed value.

Loaders never read it: transformers, diffusers, accelerate and huggingface_hub look for
weight, index and config names only, and shardkit's readers skip it (see
:mod:`shardkit.formats.suffixes`). Standard tools can check its small files::

    jq -r '.files | to_entries[] | select(.value.sha256) | "\\(.value.sha256)  \\(.key)"' shardkit.manifest.json | sha256sum -c

>>> doc = dump_manifest({"config.json": FileDigest(2, "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a")})
>>> parse_manifest(doc, path="m").files["config.json"].size_bytes
2
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ManifestError as ManifestError  # re-exported: defined with every public error
from .links import MAX_JSON_BYTES, OutsideFolderError, check_name, parse_json, read_inside
from .suffixes import MANIFEST_FILE

MANIFEST_NAME = MANIFEST_FILE
FORMAT = "shardkit.manifest"
VERSION = 1
TENSOR_DIGEST = "crc32"

__all__ = ["MANIFEST_NAME", "FileDigest", "Manifest", "ManifestError", "TensorDigest", "dump_manifest",
           "find_manifest", "parse_manifest", "read_manifest"]


@dataclass(frozen=True)
class TensorDigest:
    """One tensor's bytes: ``[begin, end)`` relative to the data buffer, and their crc32 (8 hex digits).

    ``crc32`` None (``null`` in the file): not hashed, the bytes were copied inside an object store
    from a source without a manifest and never passed through shardkit; ``verify`` says so.
    """

    begin: int
    end: int
    crc32: str | None


@dataclass(frozen=True)
class FileDigest:
    """One file's record. ``data_start``/``header_crc32``/``tensors`` only for safetensors files."""

    size_bytes: int
    sha256: str | None  # None for shards: their crc32s (header region + every tensor) cover every byte
    data_start: int | None = None
    header_crc32: str | None = None
    tensors: Mapping[str, TensorDigest] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        doc: dict[str, object] = {"size_bytes": self.size_bytes}
        if self.sha256 is not None:
            doc["sha256"] = self.sha256
        if self.data_start is not None:
            doc["data_start"] = self.data_start
            doc["header_crc32"] = self.header_crc32
            doc["tensors"] = {name: {"data_offsets": [t.begin, t.end], "crc32": t.crc32}
                              for name, t in self.tensors.items()}
        return doc


@dataclass(frozen=True)
class Manifest:
    """A parsed manifest: where it lies and every file it lists (paths relative to ``folder``)."""

    path: str
    files: dict[str, FileDigest]

    @property
    def folder(self) -> str:
        return os.path.dirname(self.path)


def dump_manifest(files: Mapping[str, FileDigest]) -> bytes:
    """The manifest's bytes for ``files`` (sorted by path, so equal checkpoints give equal manifests).

    Args:
        files: every file's record, keyed by its path relative to the manifest's folder.

    Returns:
        UTF-8 JSON bytes ending in a newline.
    """
    head = json.dumps({"format": FORMAT, "version": VERSION, "tensor_digest": TENSOR_DIGEST})[:-1]
    lines = [f" {json.dumps(name)}: {json.dumps(files[name].to_json(), separators=(',', ':'))}" for name in sorted(files)]
    return (head + ', "files": {\n' + ",\n".join(lines) + "\n}}\n").encode()  # one line per file: diffable


def parse_manifest(data: bytes, *, path: str) -> Manifest:
    """Parse manifest bytes read from ``path``.

    Raises:
        ManifestError: not JSON, not a shardkit manifest, a newer version, or a malformed entry.
    """
    try:
        doc = parse_json(data, path=path, what="manifest")
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} file")
        if doc.get("version") != VERSION or doc.get("tensor_digest") != TENSOR_DIGEST:
            raise ValueError(f"version {doc.get('version')!r} / digest {doc.get('tensor_digest')!r} is not "
                             f"{VERSION} / {TENSOR_DIGEST}: written by a newer shardkit? upgrade shardkit")
        files = {str(name): _parse_file(entry) for name, entry in doc["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as e:
        raise ManifestError(f"{path}: unreadable manifest ({str(e).removeprefix(f'{path}: ')[:200]}); delete it to verify structure only, "
                            "or restore it from the checkpoint's origin") from e
    for name in files:
        try:
            check_name(name, where=path)
        except OutsideFolderError as e:
            raise ManifestError(f"{path}: lists {name!r}, a path outside its folder; the manifest is not trustworthy") \
                from e
    return Manifest(path, files)


def _parse_file(entry: Mapping[str, Any]) -> FileDigest:
    size, sha = int(entry["size_bytes"]), (str(entry["sha256"]) if entry.get("sha256") is not None else None)
    if sha is None and "data_start" not in entry:
        raise KeyError("sha256")  # a plain file's only digest
    if "data_start" not in entry:
        return FileDigest(size, sha)
    tensors = {str(name): TensorDigest(int(t["data_offsets"][0]), int(t["data_offsets"][1]),
                                       None if t["crc32"] is None else str(t["crc32"]))
               for name, t in entry["tensors"].items()}
    return FileDigest(size, sha, int(entry["data_start"]), str(entry["header_crc32"]), tensors)


def read_manifest(folder: str | os.PathLike[str]) -> Manifest | None:
    """The manifest in ``folder`` itself, or None when it has none.

    Raises:
        ManifestError: the file exists but cannot be parsed.
    """
    folder = os.fspath(folder)
    path = os.path.join(folder, MANIFEST_NAME)
    try:  # a checked descriptor: a link leaving the folder, a FIFO or a device is refused unread
        data = read_inside(folder, MANIFEST_NAME, where=folder, max_bytes=MAX_JSON_BYTES)
    except FileNotFoundError:
        return None
    except OutsideFolderError as e:
        raise ManifestError(f"{path}: {str(e).removeprefix(f'{folder}: ').removeprefix(f'{path} ')}; the manifest "
                            "is not trustworthy: delete it to verify structure only") from e
    except OSError as e:
        raise ManifestError(f"{path}: cannot be read ({e.strerror or e})") from e
    return parse_manifest(data, path=path)


def find_manifest(folder: str | os.PathLike[str]) -> tuple[Manifest, str] | None:
    """The manifest covering ``folder``: its own, else its parent's (a pipeline component).

    Returns:
        ``(manifest, prefix)`` where ``prefix`` is ``folder``'s path inside the manifest's folder
        (``""`` or ``"unet/"``); entries under that prefix describe ``folder``'s files. None when
        neither folder has a manifest, or the parent's lists nothing under ``folder``.

    find_manifest("sd-pipeline/unet")
    (Manifest(path='sd-pipeline/shardkit.manifest.json', ...), 'unet/')
    """
    folder = os.path.abspath(os.fspath(folder))
    own = read_manifest(folder)
    if own is not None:
        return own, ""
    parent = read_manifest(os.path.dirname(folder))
    prefix = f"{os.path.basename(folder)}/"
    if parent is not None and any(name.startswith(prefix) for name in parent.files):
        return parent, prefix
    return None


# ----------------------------------------------------------------------------- reading digests

READ_BYTES = 1 << 20  # a page-aligned buffer of about 1 MiB reads a warm file at cat speed (see checking/bytescan)
Range = tuple[str, int, int]  # (label, absolute begin, absolute end)


def read_digests(path: str, ranges: list[Range], *, sha256: bool = True,
                 cancelled: Callable[[], bool] | None = None) -> tuple[str, list[str], int]:
    """Read ``path`` once: its sha256, the crc32 of each range, and its size.

    Args:
        path: the file.
        ranges: sorted, non-overlapping absolute byte ranges (a safetensors file's header region
            and tensors tile it).
        sha256: whether to compute the sha256 (``""`` is returned when not).
        cancelled: polled between chunks; when it returns True the read stops with
            ``InterruptedError`` (a writer that failed or was interrupted does not wait for it).

    Returns:
        ``(sha256 hex, [crc32 as 8 hex digits per range], bytes read)``.

    Raises:
        OSError: the file cannot be read.

    read_digests("model.safetensors", [("", 0, 8)])
    ('9f2c...', ['1a2b3c4d'], 4096)
    """
    if not sha256:
        return "", _crc_ranges(path, ranges, cancelled), os.path.getsize(path)
    sha = hashlib.sha256()
    crcs = [0] * len(ranges)
    buffer = mmap.mmap(-1, READ_BYTES)
    view = memoryview(buffer)
    pos, i = 0, 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while n := os.readv(fd, [view]):
            if cancelled is not None and cancelled():
                raise InterruptedError(f"{path}: hashing cancelled")
            chunk = view[:n]
            if sha256:
                sha.update(chunk)
            if ranges:
                i = crc_chunk(ranges, crcs, i, pos, chunk)
            pos += n
            del chunk
    finally:
        os.close(fd)
        view.release()
        buffer.close()
    return sha.hexdigest() if sha256 else "", [f"{c:08x}" for c in crcs], pos


def _crc_ranges(path: str, ranges: list[Range], cancelled: Callable[[], bool] | None) -> list[str]:
    """crc32 of each range, reading only those bytes (a shard's carried tensors are skipped)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return crc_ranges_fd(fd, ranges, where=path, cancelled=cancelled)
    finally:
        os.close(fd)


def crc_ranges_fd(fd: int, ranges: list[Range], *, where: str, cancelled: Callable[[], bool] | None = None) -> list[str]:
    """crc32 (8 hex digits) of each range of the open file ``fd`` (``where`` names it in errors).

    Raises:
        OSError: a read failed, or the file ends inside a range.
        InterruptedError: ``cancelled()`` returned True between chunks.
    """
    crcs = []
    buffer = mmap.mmap(-1, READ_BYTES)
    view = memoryview(buffer)
    try:
        for _, begin, end in ranges:
            crc, pos = 0, begin
            while pos < end:
                if cancelled is not None and cancelled():
                    raise InterruptedError(f"{where}: hashing cancelled")
                n = os.preadv(fd, [view[:min(READ_BYTES, end - pos)]], pos)
                if n == 0:
                    raise OSError(errno.EIO, f"{where} ended at byte {pos}, inside a range that should reach {end}")
                crc = zlib.crc32(view[:n], crc)
                pos += n
            crcs.append(f"{crc:08x}")
    finally:
        view.release()
        buffer.close()
    return crcs


def crc_chunk(ranges: list[Range], crcs: list[int], i: int, pos: int, chunk: memoryview) -> int:
    """Feed ``chunk`` (file bytes from ``pos``) to the sorted ``ranges`` it overlaps; returns the next range index.

    A reader going through a file front to back calls it on each chunk, with ``i`` from the call before.
    """
    end = pos + len(chunk)
    while i < len(ranges):
        _, begin, stop = ranges[i]
        lo, hi = max(begin, pos), min(stop, end)
        if hi > lo:
            crcs[i] = zlib.crc32(chunk[lo - pos:hi - pos], crcs[i])
        if stop > end:
            return i
        i += 1
    return i
