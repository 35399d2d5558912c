"""``verify`` of a remote location: its structure from the header-only mirror and the listing, and a local
folder compared with a store that lists digests (a Hub repository) file by file.

Against such a store, every file is first decided from metadata: a file by the digest its store
lists (the Hub's LFS sha256, or the git blob id of a small file), a tensor's name, dtype and
shape by the two headers. Only the tensors of a weight file whose digest differs (or that sits in
a file of another name, e.g. after a reshard) are compared byte for byte, by range reads of just
those tensors: nothing that metadata decides is downloaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from dataclasses import dataclass, field

from ..checking.verify import FileReport, Finding, VerifyReport, verify
from ..errors import Option, SourceNotFoundError
from ..formats.header import Header, TensorEntry, read_header
from ..formats.links import open_inside
from ..formats.manifest import MANIFEST_NAME
from ..formats.names import is_config_file
from ..formats.side_files import SKIPPED_DIRS
from ..stores import ObjectInfo, ObjectStore
from ..stores.mirror import HeaderMirror
from .stores import mirrored

__all__ = ["RemoteVerifyReport", "describe", "verify_against_listing", "verify_structure"]

logger = logging.getLogger("shardkit")

HASH_CHUNK_BYTES = 8 << 20
COMPARE_CHUNK_BYTES = 8 << 20
_SHOWN = 8  # file names a summary line shows (--json lists all)


@dataclass
class RemoteVerifyReport(VerifyReport):
    """A :class:`VerifyReport` decided from a store's listing: a remote folder's structure, or a local folder
    compared with the digests a store lists; ``not_compared`` gives every other file (here or there) and why."""

    not_compared: dict[str, str] = field(default_factory=dict)


def verify_structure(path: str, *, token: str | None = None) -> RemoteVerifyReport:
    """Check a remote folder's structure without reading tensor data.

    The index against the headers and the listed sizes: every tensor where the index says, no
    missing or orphan shards, no truncated or overlong files. Where the store lists digests,
    ``report.files`` lists each weight file with its sha256.

    verify_structure("hf://org/model").ok
    True
    """
    with mirrored(path, token=token) as (mirror, store):
        checked = verify(mirror.root, read_data=False)
        report = RemoteVerifyReport(**{f.name: getattr(checked, f.name) for f in dataclasses.fields(checked) if f.init})
        report.path = str(store.url)
        weights = [o for name, o in sorted(mirror.objects.items()) if name.endswith(".safetensors")]
        if weights and all(o.digest for o in weights):  # the digests the store lists (the Hub's LFS sha256s)
            report.files = [FileReport(o.name, o.size_bytes, _sha256(o), "hub-listing") for o in weights]
        return report


def verify_against_listing(path: str, against: str, *, token: str | None = None) -> RemoteVerifyReport:
    """Compare a local folder with a remote folder whose store lists digests: files by digest, tensors by headers.

    Returns:
        A :class:`RemoteVerifyReport` whose findings name every missing, extra or differing file and
        tensor; ``tensors_compared`` counts the tensors found identical; ``not_compared`` says which
        files were left out and why.

    verify_against_listing("out/", "hf://org/model").ok
    True
    """
    if not os.path.isdir(path):
        raise SourceNotFoundError(f"{path}: no such folder (", Option("against", "hf://..."),
                                  " compares a local folder)")
    with mirrored(against, token=token) as (mirror, store):
        shown = str(store.url)
        report = RemoteVerifyReport(path, against=shown)
        local = _local_files(path)
        remote = {rel: o for rel, o in mirror.objects.items() if _relevant(rel)}
        report.not_compared = _not_compared(_every_local_file(path), set(mirror.objects))
        for rel in sorted(set(remote) - set(local)):
            report.findings.append(Finding(rel, None, f"missing: {shown} has it"))
        for rel in sorted(set(local) - set(remote)):
            report.findings.append(Finding(rel, None, f"extra file: not in {shown}"))
        matched = {rel for rel in sorted(set(local) & set(remote)) if _same_file(path, rel, remote[rel], report)}
        _compare_tensors(path, mirror, store, matched, report)
        return report


def _relevant(rel: str) -> bool:
    """Weight files and the configs/indexes that go with them (not READMEs, tokenizers, .gitattributes)."""
    return rel.endswith(".safetensors") or is_config_file(rel)


def _not_compared(local: set[str], remote: set[str]) -> dict[str, str]:
    """Every file of either side that is not compared, with the reason."""
    out = {}
    for rel in sorted(local | remote):
        if _relevant(rel):
            continue
        name = rel.rpartition("/")[2]
        if name == MANIFEST_NAME:
            out[rel] = "shardkit's integrity record of this folder ('shardkit verify PATH' checks it)"
        else:
            out[rel] = "not a weight, index or config file: against='hf://...' compares those"
        if rel not in remote:
            out[rel] += "; only here"
        elif rel not in local:
            out[rel] += "; only on the Hub"
    return out


def _every_local_file(folder: str) -> set[str]:
    found = set()
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and ".shardkit-" not in d]
        found |= {os.path.relpath(os.path.join(root, n), folder).replace(os.sep, "/") for n in names
                  if ".shardkit-" not in n}
    return found


def _local_files(folder: str) -> dict[str, str]:
    out = {}
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")
            if not name.startswith(".") and name != MANIFEST_NAME and _relevant(rel):
                out[rel] = os.path.join(root, name)
    return out


def _sha256(info: ObjectInfo) -> str:
    return info.digest[1] if info.digest is not None and info.digest[0] == "sha256" else ""


def _same_file(folder: str, rel: str, remote: ObjectInfo, report: VerifyReport) -> bool:
    """Size, then the digest the store lists: a sha256 (the LFS oid), or the git blob id of a small file."""
    fd = open_inside(folder, rel, where=folder)
    size = os.fstat(fd).st_size
    sha256, blob = hashlib.sha256(), hashlib.sha1(b"blob %d\0" % size)
    with os.fdopen(fd, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            sha256.update(chunk)
            blob.update(chunk)
    report.bytes_read += size
    report.files.append(FileReport(rel, size, sha256.hexdigest(), "hub-oid"))
    if size != remote.size_bytes:
        report.findings.append(Finding(rel, None, f"{size} bytes, but {report.against} has {remote.size_bytes}"))
        return False
    kind, expected = remote.digest or ("", "")
    same = (sha256 if kind == "sha256" else blob).hexdigest() == expected
    if not same and not rel.endswith(".safetensors"):  # tensors of a differing weight file are compared below
        report.findings.append(Finding(rel, None, f"content differs from {report.against} (same size)"))
    return same


def _headers(folder: str, names: list[str]) -> dict[str, tuple[str, TensorEntry]]:
    """``component/tensor`` → (file, entry) over the safetensors files ``names`` (relative to ``folder``)."""
    out: dict[str, tuple[str, TensorEntry]] = {}
    for rel in names:
        header: Header = read_header(os.path.join(folder, *rel.split("/")))
        prefix = rel.rpartition("/")[0]
        for entry in header.entries:
            out.setdefault(f"{prefix}/{entry.name}" if prefix else entry.name, (rel, entry))
    return out


def _compare_tensors(folder: str, mirror: HeaderMirror, store: ObjectStore, matched: set[str],
                     report: VerifyReport) -> None:
    shown = str(store.url)
    local_names = [rel for rel in _local_files(folder) if rel.endswith(".safetensors")]
    remote_names = [rel for rel in mirror.objects if rel.endswith(".safetensors")]
    ours, theirs = _headers(folder, local_names), _headers(mirror.root, remote_names)
    for key in sorted(set(theirs) - set(ours)):
        report.findings.append(Finding(theirs[key][0], key, f"missing: in {shown} but not here"))
    for key in sorted(set(ours) - set(theirs)):
        report.findings.append(Finding(ours[key][0], key, f"extra tensor: not in {shown}"))
    for key in sorted(set(ours) & set(theirs)):
        (file, mine), (their_file, other) = ours[key], theirs[key]
        report.tensors_checked += 1
        if (mine.dtype, tuple(mine.shape)) != (other.dtype, tuple(other.shape)):
            report.findings.append(Finding(file, key, f"{mine.dtype} {list(mine.shape)} but {shown} has "
                                           f"{other.dtype} {list(other.shape)}"))
        elif file == their_file and file in matched:
            report.tensors_compared += 1  # decided by the file's sha256: same bytes
        else:
            difference = _first_difference(folder, file, mine, store, their_file, other)
            if difference is None:
                report.tensors_compared += 1
            else:
                report.findings.append(Finding(file, key, difference))


def _first_difference(folder: str, file: str, mine: TensorEntry, store: ObjectStore, name: str,
                      other: TensorEntry) -> str | None:
    """Compare one tensor's bytes with the remote ones (range reads, bounded memory)."""
    if mine.offset is None or other.offset is None:
        return "has no byte offset (a header without data offsets)"
    with os.fdopen(open_inside(folder, file, where=folder), "rb") as f:
        for pos in range(0, mine.nbytes, COMPARE_CHUNK_BYTES):
            n = min(COMPARE_CHUNK_BYTES, mine.nbytes - pos)
            f.seek(mine.offset + pos)
            here = f.read(n)
            there = bytearray(n)
            store.read_into(name, other.offset + pos, memoryview(there))
            if here != there:
                at = pos + next(i for i, (a, b) in enumerate(zip(here, there, strict=False)) if a != b)
                return f"differs from {store.url} at byte {at} of the tensor"
    return None


def describe(report: VerifyReport) -> str | None:
    """The summary line the CLI prints for a check decided from a listing; None for any other report."""
    if not isinstance(report, RemoteVerifyReport):
        return None
    if report.against:
        lines = [f"compared: {_names([f.name for f in report.files])}"]
        skipped = report.not_compared
        if skipped:
            records = [rel for rel in skipped if rel.rpartition("/")[2] == MANIFEST_NAME]
            others = [rel for rel in skipped if rel not in records]
            parts = [f"{_names(others)} (not weights, indexes or configs)"] if others else []
            parts += [f"{_names(records)} (shardkit's own record; 'shardkit verify PATH' checks it)"] if records else []
            lines.append("not compared: " + "; ".join(parts))
        lines.append(f"ok: {len(report.files)} file(s) compared with {report.against} by sha256 (weights, indexes "
                     f"and configs), {report.tensors_compared} tensor(s) identical"
                     + (f"; {len(skipped)} other file(s) not compared" if skipped else ""))
        return "\n".join(lines)
    listing = "the Hub's file listing" if any(f.checked == "hub-listing" for f in report.files) else "the object listing"
    return (f"ok: structure of {report.path}: {len(report.files)} weight file(s), {report.tensors_checked} "
            f"tensor(s), checked from headers and {listing} (no tensor data read)")


def _names(names: list[str]) -> str:
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more
