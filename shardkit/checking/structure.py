"""Structural checks of one safetensors checkpoint, collecting every problem instead of raising.

Used by :mod:`shardkit.checking.verify`: a file, or a sharded folder with its index. Each header
is parsed on its own, so one corrupt shard does not hide the problems of the others, and a
truncated shard still yields its tensor list (one problem counts the tensors past the end and names the first).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..errors import (
    HeaderError,
    InvalidInputError,
    SourceNotFoundError,
)
from ..formats.header import Header, TensorEntry, parse_header, read_header_bytes
from ..formats.index import MAX_INDEX_BYTES, find_checkpoint, index_contents
from ..formats.links import (
    LINK_RULE,
    OutsideFolderError,
    UntrustedFileError,
    leads_outside,
    link_target,
    open_inside,
    parse_json,
    read_inside,
)
from ..formats.names import family_files, named_file_kind, parse_weight_name

_SHOWN_LOST = 3  # tensor names a truncation problem shows (the count says how many in all)


@dataclass
class Problem:
    """One finding, before it is given its display path: ``file`` is relative to the root."""

    file: str
    tensor: str | None
    message: str


@dataclass
class Layout:
    """What to check: the files of one checkpoint, relative to ``root``."""

    root: str
    index: str | None            # index file name, if the checkpoint has (or should have) one
    files: list[str]             # weight files to read, in order
    folder_mode: bool            # a folder was given: look for orphans and stale files
    problems: list[Problem] = field(default_factory=list)
    all_present: bool = True     # every file the index names exists and has a readable header


@dataclass
class HeaderRead:
    """A shard's parsed header (None when unreadable) and its size on disk."""

    header: Header | None
    file_bytes: int
    complete: list[TensorEntry] = field(default_factory=list)  # tensors whose bytes are all present


def resolve_layout(path: str) -> Layout:
    """Find the checkpoint files behind a file, index or folder path; raise for unusable input.

    A folder is resolved leniently (:func:`~shardkit.formats.index.find_checkpoint` with
    ``strict=False``): shards without their index and hostile names become problems.
    """
    if not os.path.exists(path):
        raise SourceNotFoundError(f"{path}: no such file or folder")
    if os.path.isdir(path):
        found = find_checkpoint(path, strict=False)
        name = os.path.basename(found.path)
        layout = Layout(path, name if found.kind == "index" else None,
                        list(found.shards) if found.kind == "shards" else [] if found.kind == "index" else [name],
                        folder_mode=found.kind != "shards")
        layout.problems += [Problem(p.file, None, p.message) for p in found.problems]
        return layout
    root, name = os.path.split(os.path.abspath(path))
    kind = named_file_kind(name)
    if kind is not None:
        return Layout(root, name if kind == "index" else None, [name] if kind == "file" else [], folder_mode=False)
    raise InvalidInputError(
        f"{path}: not a safetensors checkpoint (expected a .safetensors file, an index .json or a folder); "
        "verify checks safetensors output; convert pickles first with 'shardkit convert'"
    )


def read_index(layout: Layout) -> tuple[dict[str, str], dict[str, object]] | None:
    """Parse the index, recording unsafe shard names and malformed JSON as problems."""
    assert layout.index is not None
    name = layout.index
    path = os.path.join(layout.root, name)
    try:
        doc = parse_json(read_inside(layout.root, name, where=layout.root, max_bytes=MAX_INDEX_BYTES), path=path,
                         what="JSON index")
    except (OSError, UntrustedFileError) as e:
        why = str(e).removeprefix(f"{layout.root}: ").removeprefix(f"{path}: ")
        layout.problems.append(Problem(name, None, f"unreadable index: {why}"))
        return None
    contents = index_contents(doc)  # the loaders' rules, every problem recorded instead of the first raised
    layout.problems += [Problem(name, p.tensor, p.message) for p in contents.problems]
    return (contents.weight_map, contents.metadata) if contents.usable else None


def read_shard_header(path: str, name: str, problems: list[Problem]) -> HeaderRead:
    """Parse one file's header; truncation and trailing bytes become problems, not errors.

    A file that is a symlink leading outside its folder (the one rule of
    :mod:`shardkit.formats.links`) is a problem too, and nothing behind it is read.
    """
    target = link_target(path)
    if target is not None and leads_outside(target, os.path.dirname(path)):
        problems.append(Problem(name, None, f"is a symlink leading outside the checkpoint folder (to {target}); "
                                f"{LINK_RULE}; nothing behind it was read"))
        return HeaderRead(None, 0)
    folder = os.path.dirname(path)
    try:  # one checked descriptor: a FIFO, a device or a folder is refused before any read
        fd = open_inside(folder, os.path.basename(path), where=folder)
    except OutsideFolderError as e:
        problems.append(Problem(name, None, str(e).removeprefix(f"{folder}: ").removeprefix(f"{path} ")))
        return HeaderRead(None, 0)
    except OSError as e:
        problems.append(Problem(name, None, f"cannot read: {e.strerror or e}"))
        return HeaderRead(None, 0)
    with os.fdopen(fd, "rb") as f:
        try:
            raw, file_bytes = read_header_bytes(f, path)
            header = parse_header(raw, path=path)
        except HeaderError as e:
            problems.append(Problem(name, None, str(e).removeprefix(f"{path}: ")))
            return HeaderRead(None, os.fstat(fd).st_size)
        except OSError as e:
            problems.append(Problem(name, None, f"cannot read: {e.strerror or e}"))
            return HeaderRead(None, os.fstat(fd).st_size)
    end = header.file_bytes  # where the tensors end, from the header alone
    if file_bytes < end:
        lost = [e.name for e in header.entries if e.offset + e.nbytes > file_bytes]  # one cause: one problem
        shown = ", ".join(lost[:_SHOWN_LOST]) + (f" and {len(lost) - _SHOWN_LOST} more" if len(lost) > _SHOWN_LOST else "")
        problems.append(Problem(name, None, f"truncated: the file has {file_bytes} bytes but its tensors end "
                                f"at byte {end} ({end - file_bytes} bytes missing); {len(lost)} of its "
                                f"{len(header.entries)} tensor(s) lie past the end: {shown}"))
    elif file_bytes > end:
        problems.append(Problem(name, None, f"{file_bytes - end} bytes of trailing data after the last tensor"))
    complete = [e for e in header.entries if e.offset + e.nbytes <= file_bytes]
    return HeaderRead(header, file_bytes, complete)


def check_index(layout: Layout, weight_map: dict[str, str], metadata: dict[str, object],
                headers: dict[str, HeaderRead]) -> None:
    """Index ↔ files ↔ headers: placement, duplicates, orphans, total_size (a layout with an index)."""
    assert layout.index is not None
    index, problems = layout.index, layout.problems
    stored: dict[str, list[str]] = {}
    for shard in sorted(headers):
        header = headers[shard].header
        for entry in header.entries if header else []:
            stored.setdefault(entry.name, []).append(shard)
    for name, shards in stored.items():
        if name not in weight_map:
            problems += [Problem(s, name, "orphan tensor: in this shard but not in the index") for s in shards]
            continue
        home = weight_map[name] if weight_map[name] in shards else shards[0]
        problems += [Problem(s, name, f"duplicate: also stored in {home}") for s in shards if s != home]
        if home != weight_map[name]:
            problems.append(Problem(index, name, f"the index places it in {weight_map[name]} "
                                    f"but it is stored in {home}"))
    for tensor, shard in weight_map.items():
        read = headers.get(shard)
        if read is not None and read.header is not None and tensor not in stored:
            problems.append(Problem(index, tensor, f"the index places it in {shard}, which does not hold it"))
    _check_total_size(layout, index, weight_map, metadata, headers)


def _check_total_size(layout: Layout, index: str, weight_map: dict[str, str], metadata: dict[str, object],
                      headers: dict[str, HeaderRead]) -> None:
    """total_size is the sum of the bytes of the tensors the index names, each counted once."""
    if "total_size" not in metadata or not layout.all_present:
        return
    sizes: dict[str, int] = {}
    for read in headers.values():
        for entry in read.header.entries if read.header else []:
            sizes.setdefault(entry.name, entry.nbytes)
    if any(t not in sizes for t in weight_map):
        return  # already reported as misplaced; the sum would be meaningless
    actual = sum(sizes[t] for t in weight_map)
    declared = metadata["total_size"]
    if not isinstance(declared, (int, float)) or isinstance(declared, bool) or declared != actual:
        layout.problems.append(Problem(index, None, f"metadata.total_size is {declared!r} but the "
                                       f"tensors it indexes hold {actual} bytes"))


def check_missing_shards(layout: Layout, weight_map: dict[str, str]) -> list[str]:
    """Report shards the index names that are not on disk; return the ones that are."""
    present = []
    for shard in sorted(set(weight_map.values())):
        if os.path.isfile(os.path.join(layout.root, shard)):
            present.append(shard)
            continue
        layout.all_present = False
        lost = [t for t, s in weight_map.items() if s == shard]
        shown = ", ".join(repr(t) for t in lost[:3]) + (", ..." if len(lost) > 3 else "")
        layout.problems.append(Problem(shard, None, f"missing: the index places {len(lost)} tensor(s) in this "
                                       f"file ({shown}) but it does not exist"))
    return present


def check_stray_files(layout: Layout, referenced: set[str]) -> None:
    """Shard files of the same naming that the index does not name, and a stale single file."""
    if not layout.folder_mode:
        return
    stem, single = _naming_of(layout)
    for name in family_files(os.listdir(layout.root), stem):
        if name not in referenced:
            owner = "the index" if layout.index else single
            layout.problems.append(Problem(name, None, f"orphan shard file: not referenced by {owner} "
                                           "(left over from an earlier split?); delete it"))
    if layout.index and os.path.isfile(os.path.join(layout.root, single)):
        layout.problems.append(Problem(single, None, f"a single-file checkpoint sits next to {layout.index}: "
                                       "transformers loads the single file, diffusers the shards; delete the stale one"))


def naming_shards(layout: Layout) -> list[str]:
    """Shard files in the folder that follow the checkpoint's naming (for an unreadable index)."""
    stem, _ = _naming_of(layout)
    return [n for n in family_files(os.listdir(layout.root), stem) if os.path.isfile(os.path.join(layout.root, n))]


def _naming_of(layout: Layout) -> tuple[str, str]:
    """(family stem, single-file name) of the checkpoint, e.g. ('model.fp16', 'model.fp16.safetensors')."""
    weight = parse_weight_name(layout.index or layout.files[0])
    stem = weight.stem if weight is not None else (layout.index or layout.files[0]).removesuffix(".json")
    return stem, f"{stem}.safetensors"


def check_structure(layout: Layout) -> dict[str, HeaderRead]:
    """Headers of every file on disk, with index/orphan/total_size problems added to the layout."""
    weight_map: dict[str, str] = {}
    metadata: dict[str, object] = {}
    files = list(layout.files)
    if layout.index:
        parsed = read_index(layout)
        if parsed is not None:
            weight_map, metadata = parsed
            files = check_missing_shards(layout, weight_map)
        else:  # still read the shards the index should have named
            files = naming_shards(layout)
    headers = {name: read_shard_header(os.path.join(layout.root, name), name, layout.problems) for name in files}
    if any(read.header is None for read in headers.values()) or (layout.index and not weight_map):
        layout.all_present = False
    if layout.index and weight_map:
        check_index(layout, weight_map, metadata, headers)
    check_stray_files(layout, set(files))
    return headers
