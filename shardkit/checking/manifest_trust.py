"""Is a manifest's record of a safetensors file consistent with the file's own header?

Checked before ``verify`` reads a byte of tensor data. The manifest is a record, not an
authority: a record whose ``data_start``, tensor names or ``data_offsets`` disagree with the
header (or are negative, or reach past the end of the file) would make ``verify`` crc the wrong
bytes, so that ``[0, 10**18]`` "matches byte for byte" and ``[-100, end]`` blames bit rot on
header bytes. Such a record is reported as not trustworthy, naming the tensor, and is not used:
that file is checked by its header alone (the manifest's other records, each checked the same
way, still vouch for their files).
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Collection, Mapping

from ..errors import HeaderError
from ..formats.header import Header, parse_header, read_header_bytes
from ..formats.links import UntrustedFileError, open_inside
from ..formats.manifest import FileDigest
from .integrity import Expected, ManifestFinding

__all__ = ["trusted_entries"]

_FIX = "delete the manifest to verify by the headers only, or restore it from the checkpoint's origin"


def trusted_entries(expected: Mapping[str, Expected], *,
                    reported: Collection[str] = ()) -> tuple[dict[str, Expected], list[ManifestFinding]]:
    """The entries whose shard records agree with their files' headers, and one finding per record that does not.

    Args:
        expected: every listed file, by display name (:func:`~shardkit.checking.integrity.expected_files`).
        reported: files the structural checks already reported: a disagreeing record of one is
            dropped without a second finding (one cause, one line).

    Returns:
        ``(the entries to check files against, the disagreements)``; only the header of each file is read.

    kept, untrusted = trusted_entries(expected_files("out/", pipeline=False)[0])
    [f.message for f in untrusted]
    []
    """
    kept: dict[str, Expected] = {}
    findings: list[ManifestFinding] = []
    for name, entry in expected.items():
        if entry.record.data_start is None or not os.path.lexists(entry.path):
            kept[name] = entry  # a sha256 record, or a missing file (which the manifest check reports)
            continue
        read = _read_header(entry.path)
        if read is None and entry.path.endswith(".safetensors"):
            continue  # the structural checks report the header; offsets nothing vouches for are never used
        found = _check_record(entry, read)
        if found is None:
            kept[name] = entry
        elif name not in reported:
            findings.append(found)
    return kept, findings


def _check_record(expected: Expected, read: tuple[Header, str] | None) -> ManifestFinding | None:
    """The first disagreement between one record and its file's header (and how many more), or None."""
    if read is None:
        return ManifestFinding(expected.name, None, f"{expected.manifest} is not trustworthy: it records tensor "
                               f"offsets for this file, which has no safetensors header; {_FIX}")
    header, header_crc32 = read
    problems = _disagreements(expected.record, header)
    if not problems:
        return None
    tensor, what = problems[0]
    more = f" (and {len(problems) - 1} more disagreement(s))" if len(problems) > 1 else ""
    edited = ("; the header's bytes differ from its header_crc32 too: the file may have been edited since"
              if header_crc32 != expected.record.header_crc32 else "")
    return ManifestFinding(expected.name, tensor, f"{expected.manifest} is not trustworthy: {what}{more}{edited}; "
                           f"this file was checked by its header only; {_FIX}")


def _read_header(path: str) -> tuple[Header, str] | None:
    """The file's parsed header and the crc32 of its header region, or None when it has none."""
    folder, name = os.path.split(path)
    try:  # a checked descriptor: a FIFO, a device or a link leaving the folder is never read
        fd = open_inside(folder, name, where=folder)
    except (OSError, UntrustedFileError):
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            raw, _ = read_header_bytes(f, path)
        header = parse_header(raw, path=path)
    except (HeaderError, OSError):
        return None
    return header, f"{zlib.crc32(raw, zlib.crc32(len(raw).to_bytes(8, 'little'))):08x}"


def _disagreements(record: FileDigest, header: Header) -> list[tuple[str | None, str]]:
    """``(tensor or None, what)`` for each way ``record`` differs from ``header``."""
    start = record.data_start or 0
    if start != header.data_start:
        return [(None, f"it gives data_start {start} but the file's header ends at byte {header.data_start}")]
    found: list[tuple[str | None, str]] = []
    actual = {e.name: (e.offset - header.data_start, e.offset - header.data_start + e.nbytes) for e in header.entries}
    for name, digest in record.tensors.items():
        given = [digest.begin, digest.end]
        if name not in actual:
            found.append((name, "it lists this tensor, which the file's header does not have"))
        elif digest.begin < 0 or digest.end < digest.begin:
            found.append((name, f"it gives data_offsets {given}, not a byte range"))
        elif start + digest.end > header.file_bytes:  # the header's own end: a truncated file is not the manifest's fault
            found.append((name, (f"it gives data_offsets {given}, past the end of the file's "
                                 f"{header.file_bytes - start}-byte data buffer")))
        elif (digest.begin, digest.end) != actual[name]:
            found.append((name, f"it gives data_offsets {given} but the file's header says {list(actual[name])}"))
    found += [(name, "the file's header has this tensor but the manifest does not list it")
              for name in actual if name not in record.tensors]
    return found
