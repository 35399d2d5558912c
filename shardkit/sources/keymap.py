"""Select, filter and rename the tensors of another source, without touching their bytes.

A :class:`KeyMap` is a pure name function, applied in this order:

1. ``include`` / ``exclude`` globs (``fnmatch``), matched against the names *as stored in the
   source*; a name is kept when it matches some include (or there are none) and no exclude;
2. ``strip_prefix``: only names that start with it are kept, and it is removed;
3. ``rename`` ``(OLD, NEW)`` pairs: a name that starts with OLD has that start replaced by NEW
   (an exact name is the special case); the first matching pair applies, pairs do not chain;
4. ``add_prefix`` is prepended.

:class:`KeyMapSource` wraps any :class:`Source`: entries keep their file offsets, so the writer
still copies bytes kernel-side. Mistakes are errors, never silent: a prefix or rename that
matches nothing, filters that leave nothing, and two tensors mapped to one name.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from ..errors import InvalidInputError, Option
from ..formats.header import TensorEntry
from .base import Source


@dataclass(frozen=True)
class KeyMap:
    """How tensor names change on their way to the output. See the module docstring."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    strip_prefix: str | None = None
    add_prefix: str | None = None
    rename: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        # "--strip-prefix model.diffusion_model" (no trailing dot) means the whole component: left
        # as typed it would strip to names starting with "." that no loader matches.
        if self.strip_prefix and not self.strip_prefix.endswith("."):
            object.__setattr__(self, "strip_prefix", self.strip_prefix + ".")

    def is_identity(self) -> bool:
        return not (self.include or self.exclude or self.strip_prefix or self.add_prefix or self.rename)

    def map(self, name: str) -> str | None:
        """The output name of ``name``, or None when it is filtered out.

        >>> KeyMap(strip_prefix="model.", add_prefix="unet.").map("model.conv.weight")
        'unet.conv.weight'
        >>> KeyMap(exclude=("model_ema.*",)).map("model_ema.decay") is None
        True
        >>> KeyMap(strip_prefix="model.diffusion_model").map("model.diffusion_model.out.weight")
        'out.weight'
        """
        if self.include and not any(fnmatch.fnmatchcase(name, g) for g in self.include):
            return None
        if any(fnmatch.fnmatchcase(name, g) for g in self.exclude):
            return None
        if self.strip_prefix:
            if not name.startswith(self.strip_prefix):
                return None
            name = name[len(self.strip_prefix):]
        for old, new in self.rename:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        return (self.add_prefix or "") + name


def parse_renames(pairs: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """``["old.=new."]`` → ``(("old.", "new."),)``; refuses pairs without ``=`` or an empty OLD."""
    out = []
    for pair in pairs:
        old, sep, new = pair.partition("=")
        if not sep or not old:
            raise InvalidInputError(Option("rename", pair), ": expected OLD=NEW, e.g. ", Option("rename",
                                                                                                ["text_model.=model."]))
        out.append((old, new))
    return tuple(out)


class KeyMapSource(Source):
    """A view of ``inner`` with names selected and renamed by ``keymap``."""

    def __init__(self, inner: Source, keymap: KeyMap) -> None:
        self.inner = inner
        self.keymap = keymap
        self.description = inner.description
        self.naming = inner.naming
        self.paths = inner.paths
        self.kernel_copy = inner.kernel_copy
        inner_entries = inner.entries()
        self._entries, self._by_name = _map_entries(inner_entries, keymap, where=inner.description)
        self.dropped = len(inner_entries) - len(self._entries)

    def entries(self) -> list[TensorEntry]:
        return list(self._entries)

    def read(self, entry: TensorEntry, begin: int, end: int) -> bytes | memoryview:
        return self.inner.read(self._by_name[entry.name], begin, end)

    def chunks(self, entry: TensorEntry, chunk_bytes: int) -> Iterator[bytes | memoryview]:
        return self.inner.chunks(self._by_name[entry.name], chunk_bytes)

    def aliases(self) -> dict[str, str]:
        return _map_pairs(self.inner.aliases(), self.keymap)

    def metadata(self) -> dict[str, str]:
        # Alias records (tensor name → kept name) follow the renames; other keys pass through.
        inner_meta = self.inner.metadata()
        names = {e.name for e in self.inner.entries()}
        records = {k: v for k, v in inner_meta.items() if v in names}
        plain = {k: v for k, v in inner_meta.items() if k not in records}
        return {**plain, **_map_pairs(records, self.keymap)}

    def held_fd(self, path: str) -> int | None:
        return self.inner.held_fd(path)

    def close(self) -> None:
        self.inner.close()


def _map_pairs(pairs: dict[str, str], keymap: KeyMap) -> dict[str, str]:
    out = {}
    for alias, kept in pairs.items():
        new_alias, new_kept = keymap.map(alias), keymap.map(kept)
        if new_alias is not None and new_kept is not None:
            out[new_alias] = new_kept
    return out


def _map_entries(entries: list[TensorEntry], keymap: KeyMap, *, where: str
                 ) -> tuple[list[TensorEntry], dict[str, TensorEntry]]:
    _check_matches(entries, keymap, where=where)
    mapped: list[TensorEntry] = []
    by_name: dict[str, TensorEntry] = {}
    for entry in entries:
        new = keymap.map(entry.name)
        if new is None:
            continue
        if new in by_name:
            raise InvalidInputError(
                f"{where}: tensors {by_name[new].name!r} and {entry.name!r} would both be named {new!r}; "
                "adjust ", Option("rename"), "/", Option("strip_prefix"), "/", Option("add_prefix"), " or ",
                                    Option("exclude"), " one of them"
            )
        by_name[new] = entry
        mapped.append(dataclasses.replace(entry, name=new))
    if not mapped:
        raise InvalidInputError(
            f"{where}: the ", Option("include"), "/", Option("exclude"),
                                f" filters leave no tensors (source has {len(entries)}, "
            f"e.g. {_examples(entries)}); filters match the names as stored in the source"
        )
    return mapped, by_name


def _check_matches(entries: list[TensorEntry], keymap: KeyMap, *, where: str) -> None:
    """A strip prefix or rename that matches no tensor is a typo: say so, with example names."""
    filters = KeyMap(include=keymap.include, exclude=keymap.exclude)
    kept = [e.name for e in entries if filters.map(e.name) is not None]
    if keymap.strip_prefix and kept and not any(n.startswith(keymap.strip_prefix) for n in kept):
        raise InvalidInputError(
            f"{where}: ", Option("strip_prefix", keymap.strip_prefix), " matches no tensor name "
            f"(names look like {_examples(entries)})"
        )
    stripped = [n[len(keymap.strip_prefix):] if keymap.strip_prefix else n for n in kept
                if not keymap.strip_prefix or n.startswith(keymap.strip_prefix)]
    for old, new in keymap.rename:
        if stripped and not any(n.startswith(old) for n in stripped):
            raise InvalidInputError(
                f"{where}: ", Option("rename", [f"{old}={new}"]), " matches no tensor name (after ",
                                    Option("strip_prefix"), "; names look "
                f"like {', '.join(repr(n) for n in stripped[:3])})"
            )


def _examples(entries: list[TensorEntry], count: int = 3) -> str:
    return ", ".join(repr(e.name) for e in entries[:count]) + (" ..." if len(entries) > count else "")
