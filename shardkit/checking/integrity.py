"""``verify`` against the manifest: every byte of every listed file, with the changed tensor named.

The manifest (:mod:`shardkit.formats.manifest`) that covers the checked path lists each file's
size and sha256, and for safetensors files the crc32 of the header region and of each tensor.
``verify`` hashes every file anyway; a file whose sha256 differs is read once more to find which
tensor (or the header) changed. Which manifest covers which file: a folder's own manifest, else
its parent's entries under the folder's name (a pipeline component); in a pipeline folder a
component's own manifest (written by an in-place reshard of that component) wins over the top
one for that component's files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..formats.manifest import (
    MANIFEST_NAME,
    FileDigest,
    Manifest,
    ManifestError,
    find_manifest,
    read_digests,
    read_manifest,
)

__all__ = ["Expected", "ManifestFinding", "expected_files", "compare_with_manifest"]


@dataclass(frozen=True)
class Expected:
    """A file the manifest lists: its display name, where it is, its record, the manifest's display name."""

    name: str
    path: str
    record: FileDigest
    manifest: str


@dataclass(frozen=True)
class ManifestFinding:
    """A difference from the manifest: file (display name), tensor or None, message."""

    file: str
    tensor: str | None
    message: str


def expected_files(path: str, *, pipeline: bool) -> tuple[dict[str, Expected], list[str]]:
    """Every file the manifests covering ``path`` list, by display name, and the manifests used.

    Args:
        path: the verified path: a file, a checkpoint folder, an index file, a pipeline folder.
        pipeline: whether ``path`` is a pipeline folder.

    Returns:
        ``({display name: Expected}, [manifest display names])``; both empty without a manifest.

    Raises:
        ManifestError: a manifest exists but cannot be read.

    expected_files("out/", pipeline=False)[1]
    ['shardkit.manifest.json']
    """
    if os.path.isfile(path) and not path.endswith(".json"):
        folder, only = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    else:
        folder, only = (os.path.dirname(os.path.abspath(path)) if os.path.isfile(path) else path), None
    found = find_manifest(folder)
    if found is None and not pipeline:
        return {}, []
    expected: dict[str, Expected] = {}
    used: list[str] = []
    if found is not None:
        manifest, prefix = found
        used.append(_display(manifest, folder))
        expected.update(_entries(manifest, prefix, folder, "", used[-1]))
    if pipeline:
        for sub in sorted(os.listdir(folder)):
            own = read_manifest(os.path.join(folder, sub)) if _real_folder(os.path.join(folder, sub)) else None
            if own is not None:  # nearest wins: drop the top manifest's records of this component
                expected = {k: v for k, v in expected.items() if not k.startswith(f"{sub}/")}
                used.append(f"{sub}/{MANIFEST_NAME}")
                expected.update(_entries(own, "", os.path.join(folder, sub), f"{sub}/", used[-1]))
    if only is not None:
        expected = {k: v for k, v in expected.items() if k == only}
    return expected, used


def _real_folder(path: str) -> bool:
    """A subfolder itself, never a symlink to one (which could lead outside the checkpoint)."""
    return os.path.isdir(path) and not os.path.islink(path)


def _display(manifest: Manifest, folder: str) -> str:
    if os.path.abspath(manifest.folder) == os.path.abspath(folder):
        return MANIFEST_NAME
    return os.path.join("..", MANIFEST_NAME)


def _entries(manifest: Manifest, prefix: str, folder: str, shown: str, label: str) -> dict[str, Expected]:
    out = {}
    for full, record in manifest.files.items():
        if full.startswith(prefix):
            name = full[len(prefix):]
            out[shown + name] = Expected(shown + name, os.path.join(folder, name), record, label)
    return out


def compare_with_manifest(expected: Expected, *, size_bytes: int | None, sha256: str | None,
                          crc32s: list[str] | None = None) -> list[ManifestFinding]:
    """Findings for one listed file, given what the scan read (``size_bytes`` None: not on disk).

    A shard is checked with the crc32s of :func:`manifest_ranges` (``crc32s``, computed by the
    scan's single read); another file by its sha256. A file whose sha256 differs is read again to
    name the tensor (or the header region) that changed.
    """
    record = expected.record
    if size_bytes is None:
        return [ManifestFinding(expected.name, None, f"missing: {expected.manifest} lists it "
                                f"({record.size_bytes} bytes) but it is not on disk; restore it from the checkpoint's origin")]
    if size_bytes == record.size_bytes and record.sha256 is not None and sha256 == record.sha256:
        return []
    located = _locate(expected, crc32s) if record.data_start is not None and size_bytes == record.size_bytes else []
    if located or (record.sha256 is None and size_bytes == record.size_bytes):
        return located  # a shard is recorded by crc32s only: every range matched, so every byte did
    what = (f"is {size_bytes} bytes but {expected.manifest} records {record.size_bytes}"
            if size_bytes != record.size_bytes else f"sha256 {sha256} differs from {record.sha256} in {expected.manifest}")
    return [ManifestFinding(expected.name, None, f"changed since shardkit wrote it: {what}; restore it from the "
                            "checkpoint's origin (or re-run the split that made it)")]


def manifest_ranges(record: FileDigest) -> list[tuple[str, int, int]]:
    """A shard record's ranges in file order: ``("", 0, data_start)`` for the header region, then each tensor."""
    start = record.data_start or 0
    return [("", 0, start)] + sorted(((name, start + t.begin, start + t.end) for name, t in record.tensors.items()),
                                     key=lambda r: r[1])


def _locate(expected: Expected, crcs: list[str] | None) -> list[ManifestFinding]:
    """Which ranges (header region, tensors) differ from their crc32 in the manifest.

    ``crcs`` are the ranges' crc32s if the scan computed them while reading the file; else it is read again.
    """
    record = expected.record
    ranges = manifest_ranges(record)
    wanted: list[str | None] = [record.header_crc32 or "", *(record.tensors[name].crc32 for name, _, _ in ranges[1:])]
    if crcs is None:
        try:
            _, crcs, _ = read_digests(expected.path, ranges)
        except OSError:
            return []  # the scan already reported the read failure
    found = []
    for (name, begin, end), got, want in zip(ranges, crcs, wanted, strict=True):
        if got == want or want is None:  # None: recorded as not hashed (copied in an object store)
            continue
        if not name:
            found.append(ManifestFinding(expected.name, None, f"header bytes 0-{end} changed since shardkit wrote them "
                                         f"(crc32 {got}, {expected.manifest} records {want}); restore the file"))
        else:
            found.append(ManifestFinding(expected.name, name, f"data changed since shardkit wrote it (crc32 {got}, "
                                         f"{expected.manifest} records {want}; bytes {begin}-{end} of the file): bit rot "
                                         "or an edit; restore the file from the checkpoint's origin"))
    return found


def manifest_error_finding(error: ManifestError) -> ManifestFinding:
    """An unreadable manifest is a finding, not a crash: the files are still checked for structure."""
    return ManifestFinding(MANIFEST_NAME, None, str(error))
