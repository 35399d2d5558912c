"""llama.cpp's gguf-split layout: one model in ``NAME-00001-of-0000N.gguf`` ... ``NAME-0000N-of-0000N.gguf``.

Each part is a GGUF file of its own (:mod:`shardkit.formats.gguf`) holding a run of the tensors and the keys
``split.no`` (u16, from 0), ``split.count`` (u16, N) and ``split.tensors.count`` (i32, the tensors of every part);
the first part also holds every other key. llama.cpp loads the model from the first part and finds the others by
their names. Standard library only.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from ..errors import HeaderError, SourceNotFoundError
from .gguf import GgufFile, read_gguf

__all__ = ["MAX_SPLITS", "SPLIT_NAME", "SplitCheck", "check_split_parts", "first_part", "later_part_message", "part_name",
           "read_split_gguf", "split_count"]

MAX_SPLITS = 9999
SPLIT_NAME = re.compile(r"(.+)-(\d{5})-of-(\d{5})\.gguf")


def split_count(gguf: GgufFile) -> int:
    """``split.count`` of ``gguf`` when it says the file is one of several parts, else 1."""
    count = gguf.metadata.get("split.count", 1)
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 1 else 1


def part_name(prefix: str, number: int, count: int) -> str:
    """The file name of part ``number`` (from 1) of ``count``, as gguf-split names it.

    >>> part_name("model", 2, 3)
    'model-00002-of-00003.gguf'
    """
    return f"{prefix}-{number:05d}-of-{count:05d}.gguf"


def first_part(gguf: GgufFile) -> str | None:
    """When ``gguf`` is a later part of a split (``split.no`` ≥ 1, named as gguf-split names it), the first part's
    path, which names the others; else None."""
    count, number = split_count(gguf), gguf.metadata.get("split.no")
    match = SPLIT_NAME.fullmatch(os.path.basename(gguf.path))
    if count == 1 or not isinstance(number, int) or isinstance(number, bool) or not 0 < number < count or (
            match is None or int(match.group(2)) != number + 1 or int(match.group(3)) != count):
        return None
    return os.path.join(os.path.dirname(gguf.path), part_name(match.group(1), 1, count))


def later_part_message(gguf: GgufFile, first_path: str) -> str:
    """The one line for a later part given where the first is needed."""
    number = gguf.metadata.get("split.no")
    return (f"{gguf.path}: part {number + 1 if isinstance(number, int) else number} of a {split_count(gguf)}-part "
            f"split GGUF; give the first part, {os.path.basename(first_path)} (it names the others)")


@dataclass
class SplitCheck:
    """What :func:`check_split_parts` found.

    Attributes:
        paths: every part's path, the first one first (just the first when the others cannot be named).
        parts: the parts whose headers were read and fit the split, in order.
        problems: ``(path of the part, what is wrong with it)`` pairs; empty when every part is there and fits.
    """

    paths: list[str] = field(default_factory=list)
    parts: list[GgufFile] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)


def check_split_parts(first: GgufFile) -> SplitCheck:
    """Every part of the split GGUF whose first part is ``first``, each header read and checked against the split:
    a part missing, truncated or damaged, numbered wrongly, holding a tensor of another part, or the tensors of
    all parts other than ``split.tensors.count``; every problem collected (none raised). A whole file (no
    ``split.count`` above 1) is its own only part.
    """
    count = split_count(first)
    check = SplitCheck([first.path], [first])
    if count == 1:
        return check
    number, match = first.metadata.get("split.no"), SPLIT_NAME.fullmatch(os.path.basename(first.path))
    if number != 0 or count > MAX_SPLITS or match is None or int(match.group(2)) != 1 or int(match.group(3)) != count:
        check.problems.append((first.path, f"split.no {number!r} and split.count {count} (at most {MAX_SPLITS}) do not "
                                           f"make it the first part NAME-00001-of-{count:05d}.gguf, so its other parts "
                                           "cannot be found; give the first part under the name gguf-split gave it"))
        return check
    check.paths = [os.path.join(os.path.dirname(first.path), part_name(match.group(1), i, count))
                   for i in range(1, count + 1)]
    seen = {t.name: 1 for t in first.tensors}
    for index, path in enumerate(check.paths[1:], start=1):
        part, problem = _read_part(path, index, count, seen)
        if problem is not None:
            check.problems.append((path, problem))
        elif part is not None:
            check.parts.append(part)
    expected = first.metadata.get("split.tensors.count")
    if not check.problems and expected != len(seen):
        check.problems.append((first.path, f"the {count} parts hold {len(seen)} tensors; split.tensors.count says "
                                           f"{expected!r}"))
    return check


def _read_part(path: str, index: int, count: int, seen: dict[str, int]) -> tuple[GgufFile | None, str | None]:
    """Part ``index`` (from 0) at ``path``: ``(its header, None)``, or ``(None, what is wrong with it)``; ``seen``
    (tensor name → its part, from 1) gains its tensors."""
    try:
        part = read_gguf(path)
    except SourceNotFoundError:
        return None, f"missing: part {index + 1} of this {count}-part split GGUF; every part must be beside the first"
    except HeaderError as e:
        return None, str(e).removeprefix(f"{path}: ")
    if part.metadata.get("split.no") != index or part.metadata.get("split.count") != count:
        return None, (f"split.no/split.count say {part.metadata.get('split.no')!r}/"
                      f"{part.metadata.get('split.count')!r}, not {index}/{count}")
    twice = sorted(t.name for t in part.tensors if t.name in seen)
    if twice:
        return None, f"tensor {twice[0]!r} is also in part {seen[twice[0]]}"
    seen.update({t.name: index + 1 for t in part.tensors})
    return part, None


def read_split_gguf(path: str | os.PathLike[str]) -> tuple[GgufFile, list[GgufFile]]:
    """A GGUF file and, when it is the first of llama.cpp's gguf-split layout (``NAME-00001-of-0000N.gguf`` with
    ``split.count`` N > 1), every part of it: ``(first, parts)``; ``parts`` is ``[first]`` for a whole file.

    Raises:
        HeaderError: a later part given instead of the first, a part missing or numbered wrongly, a tensor in two
            parts, or a tensor count other than ``split.tensors.count``.
    """
    first = read_gguf(path)
    first_path = first_part(first)
    if first_path is not None:
        raise HeaderError(later_part_message(first, first_path))
    check = check_split_parts(first)
    if check.problems:
        where, problem = check.problems[0]
        raise HeaderError(f"{where}: {problem}")
    return first, check.parts
