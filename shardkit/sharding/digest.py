"""Digest what a job writes, on background threads, for the manifest (:mod:`shardkit.formats.manifest`).

Each finished shard's header region and tensors are crc32'd from the page cache (the writer just
put them there) while the next shard is copied; other files get a sha256. hashlib and zlib
release the GIL on large buffers. A tensor copied unchanged from a file whose manifest records its
crc32 carries that crc32 (``carried``) and is not read back: a reshard of a shardkit checkpoint,
cloned on a copy-on-write filesystem, reads its new headers only. Tensors copied kernel-side
(``copy_file_range``) are hashed from the *source's* descriptor over the source's byte range
(``copied``), never from the new file: on a copy-on-write filesystem the new file is a clone whose
pages are not in the page cache, so reading it back read every byte from the device (measured on a
loop-mounted XFS: 2.1 GB read through the loop device for a 2 GB split, 4.2-6.7 s instead of under
1 s), while the source's pages are usually cached (the caller just read or wrote it). Measured CPU
per GiB on this project's 2-core machine: read 0.23 s, crc32 0.40 s (sha256 would be 0.77 s).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from ..errors import ShardkitWriteError, describe_os_error
from ..formats.header import Header, read_header
from ..formats.links import UntrustedFileError, fd_path, open_inside
from ..formats.manifest import (
    MANIFEST_NAME,
    FileDigest,
    Manifest,
    ManifestError,
    Range,
    TensorDigest,
    crc_ranges_fd,
    find_manifest,
    read_digests,
    read_manifest,
)
from ..sources.base import Source
from .writer import TensorWrite

ENABLED = True  # benchmarks switch hashing off to measure its cost; nothing else should
Carried = Mapping[str, str]  # tensor name → crc32 recorded in the source's manifest


@dataclass
class CopiedRanges:
    """Tensors a shard got by ``copy_file_range`` from one source file (clones, on a copy-on-write
    filesystem), hashed from that file: ``fd`` is a descriptor of it that the hasher owns and
    closes; each range is ``(output tensor name, absolute begin, absolute end)`` in the source."""

    fd: int
    where: str
    ranges: list[Range]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class FileHasher:
    """Hash files on worker threads; :meth:`results` waits and returns every record.

    with FileHasher() as hasher:
        hasher.submit("model.safetensors", "/tmp/stage/model.safetensors", safetensors=True)
        hasher.results()["model.safetensors"].sha256
    """

    def __init__(self) -> None:
        # Two workers (two shards at once) where there are two cores: after a copy-on-write clone the
        # copy costs no CPU and the crc32s are all the time left (measured on a loop-mounted XFS, 2 GB
        # in 5 shards: 0.95 s against 1.0-1.8 s with one); a plain copy runs in the kernel beside them.
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1)), thread_name_prefix="shardkit-hash")
        self._stop = threading.Event()  # set when the write fails: Ctrl-C does not wait for a 5 GB hash
        self._pending: dict[str, Future[FileDigest]] = {}
        self._done: dict[str, FileDigest] = {}
        self._copied: list[CopiedRanges] = []  # their descriptors, closed after each task and on exit

    def submit(self, name: str, path: str, *, safetensors: bool, carried: Carried | None = None,
               copied: Sequence[CopiedRanges] = ()) -> None:
        """Queue ``path`` (published as ``name``): a shard gets crc32s of its header and tensors, any other file a sha256.

        ``copied``: tensors to hash from their source file instead (the hasher closes their descriptors).
        """
        self._copied.extend(copied)
        self._pending[name] = self._pool.submit(_digest_then_close, path, safetensors=safetensors, carried=carried,
                                                copied=list(copied), cancelled=self._stop.is_set)

    def add_bytes(self, name: str, data: bytes) -> None:
        """Record a small file written from memory (an index, the manifest's neighbours)."""
        self._done[name] = FileDigest(len(data), hashlib.sha256(data).hexdigest())

    def add(self, name: str, record: FileDigest) -> None:
        """Record a file this job did not write but keeps (carried over from the old manifest)."""
        self._done[name] = record

    def results(self) -> dict[str, FileDigest]:
        """Every record, once all queued files are hashed; raises the first failure."""
        pending, self._pending = self._pending, {}
        for name, future in pending.items():
            self._done[name] = future.result()
        return dict(self._done)

    def __enter__(self) -> FileHasher:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for future in self._pending.values():
            future.cancel()
        self._pool.shutdown(wait=True)
        for copied in self._copied:  # those of tasks cancelled before they ran
            copied.close()


def _digest_then_close(path: str, *, safetensors: bool, carried: Carried | None, copied: list[CopiedRanges],
                       cancelled: Callable[[], bool]) -> FileDigest:
    """:func:`digest_file`, then close the descriptors of ``copied`` (on every path)."""
    try:
        return digest_file(path, safetensors=safetensors, carried=carried, copied=copied, cancelled=cancelled)
    finally:
        for c in copied:
            c.close()


def digest_file(path: str, *, safetensors: bool, carried: Carried | None = None,
                cancelled: Callable[[], bool] | None = None, copied: Sequence[CopiedRanges] = ()) -> FileDigest:
    """A safetensors file's crc32s (header region and each tensor), or any other file's sha256.

    Args:
        path: the file to read.
        safetensors: whether it is a shard (crc32s) or another file (sha256).
        carried: crc32s recorded for its tensors by the source's manifest: those tensors were
            copied (or cloned) from exactly those bytes and are not read back, so a copy-on-write
            reshard of a shardkit checkpoint reads its headers only.
        cancelled: polled between chunks (see :func:`~shardkit.formats.manifest.read_digests`).
        copied: tensors copied kernel-side from a source file: hashed from that file's
            descriptor (over the source range), not read back from ``path``.

    Returns:
        The :class:`~shardkit.formats.manifest.FileDigest`.

    Raises:
        ShardkitWriteError: the file cannot be read.

    digest_file("out/model.safetensors", safetensors=True).tensors["w"].crc32
    '8a3f0c21'
    """
    carried = carried or {}
    try:
        size = os.path.getsize(path)
        if not safetensors:
            sha, _, _ = read_digests(path, [], cancelled=cancelled)
            return FileDigest(size, sha)
        header = read_header(path)
        ranges = _ranges(header)
        from_source = {name: crc for c in copied if c.ranges for name, crc in
                       zip((r[0] for r in c.ranges), crc_ranges_fd(c.fd, c.ranges, where=c.where, cancelled=cancelled),
                           strict=True)}
        unknown = [r for r in ranges if not r[0] or (r[0] not in carried and r[0] not in from_source)]
        _, crcs, _ = read_digests(path, unknown, sha256=False, cancelled=cancelled)
    except OSError as e:
        raise ShardkitWriteError(f"hashing {path} for the manifest failed: {describe_os_error(e)}; "
                                 "nothing was published") from e
    got = {**carried, **from_source, **dict(zip((name for name, _, _ in unknown), crcs, strict=True))}
    start = header.data_start
    tensors = {name: TensorDigest(begin - start, end - start, got[name]) for name, begin, end in ranges[1:]}
    return FileDigest(size, None, start, got[""], tensors)


def _ranges(header: Header) -> list[tuple[str, int, int]]:
    """``("", 0, data_start)`` for the header region, then each tensor's absolute byte range."""
    return [("", 0, header.data_start)] + [(e.name, e.offset, e.offset + e.nbytes) for e in header.entries]


def source_digests(paths: list[str]) -> dict[tuple[str, int, int], str]:
    """crc32 of every tensor recorded in the manifests of the source files ``paths``.

    Keyed by ``(realpath of the file, absolute begin, absolute end)``, so renamed tensors
    (``convert --strip-prefix``) still find theirs; only files whose size matches their record.

    source_digests(["ckpt/model-00001-of-00002.safetensors"])
    {('/abs/ckpt/model-00001-of-00002.safetensors', 4096, 73216): '0badf00d', ...}
    """
    found: dict[tuple[str, int, int], str] = {}
    manifests: dict[str, tuple[Manifest, str] | None] = {}
    for path in paths:
        folder = os.path.dirname(os.path.abspath(path))
        if folder not in manifests:
            try:
                manifests[folder] = find_manifest(folder)
            except (OSError, ManifestError):
                manifests[folder] = None  # an unreadable manifest: nothing to carry (verify reports it)
        hit = manifests[folder]
        record = hit[0].files.get(hit[1] + os.path.basename(path)) if hit else None
        if record is None or record.data_start is None or not _same_size(path, record.size_bytes):
            continue
        real = os.path.realpath(path)
        for t in record.tensors.values():
            if t.crc32 is not None:  # None: not hashed (copied in an object store); read it instead
                found[(real, record.data_start + t.begin, record.data_start + t.end)] = t.crc32
    return found


def _same_size(path: str, size_bytes: int) -> bool:
    try:
        return os.path.getsize(path) == size_bytes
    except OSError:
        return False


# ----------------------------------------------------------------------------- one job's manifest

class BytesSink(Protocol):
    """Where the manifest goes: the output transaction (local folder or store)."""

    def write_bytes(self, name: str, data: bytes, /) -> None: ...


class ManifestRecorder:
    """Collects the digests of everything one transaction writes, then writes the manifest into it.

    Used by :func:`shardkit.sharding.job.run_jobs`: :meth:`shard`/:meth:`file` after each file
    is written (hashed in the background), :meth:`data` for files written from memory, and
    :meth:`write` just before the commit, through the same transaction, so the manifest is
    fsynced and published with the files it lists and never disagrees with them.

    with ManifestRecorder("out/") as record:
        record.shard("model.safetensors", tx.path_for("model.safetensors"), writes)
        record.write(tx)
    """

    def __init__(self, output: str, *, stale: list[str], enabled: bool = True) -> None:
        self.enabled = enabled and ENABLED
        self.output = os.path.abspath(output)
        self.stale = set(stale)
        self._hasher = FileHasher()
        self._sources: dict[tuple[str, int, int], str] = {}
        self._looked_up: set[str] = set()

    def shard(self, name: str, path: str, writes: Sequence[TensorWrite], *, known: Mapping[str, str] | None = None,
              source: Source | None = None) -> None:
        """A finished shard ``name`` at ``path``, written from ``writes`` (TensorWrite records).

        ``known``: crc32s the writer took of the tensors it wrote through Python; with those
        carried from the source's manifest, they are not read back. ``source``: what the writer
        copied from; the tensors it copied kernel-side are hashed from its files (see the module
        docstring), through the descriptor it holds where it holds one.
        """
        if self.enabled:
            carried = {**self._carried(writes), **(known or {})}
            copied = _copied_ranges(writes, carried, source) if source is not None else []
            self._hasher.submit(name, path, safetensors=True, carried=carried, copied=copied)

    def file(self, name: str, path: str) -> None:
        """A finished side file (config.json...) ``name`` at ``path``."""
        if self.enabled:
            self._hasher.submit(name, path, safetensors=False)

    def data(self, name: str, data: bytes) -> None:
        """A small file written from memory (an index)."""
        if self.enabled:
            self._hasher.add_bytes(name, data)

    def add(self, name: str, record: FileDigest) -> None:
        """A file hashed elsewhere (by another rank of a collective write)."""
        if self.enabled:
            self._hasher.add(name, record)

    def results(self) -> dict[str, FileDigest]:
        """Wait for every digest recorded so far (none when disabled): what one rank of a collective
        write sends to the rank that writes the manifest."""
        return self._hasher.results() if self.enabled else {}

    def write(self, tx: BytesSink) -> None:
        """Wait for every digest, keep the old records of files left in place, write the manifest."""
        if not self.enabled:
            return
        records = self._hasher.results()
        records.update(self._kept(records))
        from ..formats.manifest import dump_manifest

        tx.write_bytes(MANIFEST_NAME, dump_manifest(records))

    def _carried(self, writes: Sequence[TensorWrite]) -> dict[str, str]:
        """crc32s from the source's manifest for the tensors copied unchanged."""
        files = sorted({w.src.file for w in writes if w.src.file} - self._looked_up)
        if files:
            self._looked_up.update(files)
            self._sources.update(source_digests(files))
        carried = {}
        for w in writes:
            src, out = w.src, w.out
            if src.file and src.dtype == out.dtype:
                crc = self._sources.get((os.path.realpath(src.file), src.offset, src.offset + src.nbytes))
                if crc is not None:
                    carried[out.name] = crc
        return carried

    def _kept(self, written: Mapping[str, FileDigest]) -> dict[str, FileDigest]:
        """Records of the old manifest for files this write leaves in place (an in-place reshard).

        An old record is kept when the file still has its size and was not modified after the
        old manifest: a file that rotted keeps failing ``verify`` instead of being blessed. A
        file changed since (a config edited on purpose) is hashed again.
        """
        try:
            found = find_manifest(self.output)
        except (OSError, ManifestError):
            return {}  # unreadable: nothing to keep; the new manifest covers what this write wrote
        if found is None:
            return {}
        old, prefix = found
        manifest_mtime_ns = os.stat(old.path).st_mtime_ns
        kept: dict[str, FileDigest] = {}
        for full, record in old.files.items():
            name = full[len(prefix):] if full.startswith(prefix) else None
            if name is None or name in written or name in self.stale or name == MANIFEST_NAME:
                continue
            try:
                st = os.stat(os.path.join(self.output, name))
            except OSError:
                continue  # gone: nothing to record
            if st.st_size == record.size_bytes and st.st_mtime_ns <= manifest_mtime_ns:
                kept[name] = record
            else:
                kept[name] = digest_file(os.path.join(self.output, name), safetensors=name.endswith(".safetensors"))
        return kept

    def __enter__(self) -> ManifestRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self._hasher.__exit__(*exc)


def _copied_ranges(writes: Sequence[TensorWrite], carried: Carried, source: Source) -> list[CopiedRanges]:
    """The tensors of ``writes`` copied byte for byte from a file (the writer's kernel-side copies),
    grouped by source file, each file opened as the writer opened it: a duplicate of the descriptor
    the source holds, else the path. A file that cannot be opened is left out (its tensors are
    then read back from the new file)."""
    by_file: dict[str, list[Range]] = {}
    for w in writes:
        src, out = w.src, w.out
        if src.file and src.dtype == out.dtype and src.nbytes and out.name not in carried:
            by_file.setdefault(src.file, []).append((out.name, src.offset, src.offset + src.nbytes))
    copied = []
    for file, ranges in by_file.items():
        held = source.held_fd(file)
        try:
            fd = os.dup(held) if held is not None else os.open(file, os.O_RDONLY)
        except OSError:
            continue
        copied.append(CopiedRanges(fd, file, ranges))
    return copied


def stale_manifests(output: str, folders: list[str]) -> list[str]:
    """Manifests a write into ``output`` replaces or removes: its own, and its components' (a
    pipeline written whole gets one manifest at the top; older per-component ones would disagree)."""
    names = [MANIFEST_NAME] + [f"{folder}/{MANIFEST_NAME}" for folder in folders if folder]
    return [n for n in names if os.path.lexists(os.path.join(output, n))]


def stale_side_files(output: str, written: Sequence[str]) -> list[str]:
    """Side files of the checkpoint a write replaces that the new one does not have: listed in the old
    manifest (shardkit wrote them), still byte for byte as it recorded them, and not written again
    (a model's ``generation_config.json`` left beside another model). A file edited since, one the
    manifest does not list, or a folder without a manifest is left alone: nothing of the user's is lost.

        stale += stale_side_files("out/", names_the_write_produces)
    """
    try:
        manifest = read_manifest(output)
    except ManifestError:
        return []  # not trustworthy: it decides nothing
    if manifest is None:
        return []
    keep = set(written)
    return [name for name, digest in manifest.files.items()
            if name not in keep and digest.sha256 is not None and _unchanged(output, name, digest)]


def _unchanged(output: str, name: str, digest: FileDigest) -> bool:
    """``name`` is a regular file inside ``output`` whose size and sha256 are those recorded."""
    try:
        fd = open_inside(output, name, where=output, max_bytes=digest.size_bytes, links=False)
    except (UntrustedFileError, OSError):  # gone, a link, not regular, grown past its record
        return False
    try:
        sha, _, _ = read_digests(fd_path(fd, os.path.join(output, name)), [])  # the checked file itself
    finally:
        os.close(fd)
    return sha == digest.sha256
