"""The library speaks Python, the CLI speaks flags: one table between them, made from the commands.

Library messages name an option as its parameter (``overwrite=True``, ``to='diffusers'``,
``cache=False``, ``config=...``); where the CLI prints a library error or warning it rewrites
each such mention as the flag a user of the command line types (``--overwrite``, ``--to
diffusers``, ``--no-cache``, ``--config``). The table is read from the registered click commands
themselves, whose write options are made from :class:`~shardkit.api.options.WriteOptions`, so a
flag renamed there is renamed in every message at once.

Written forms (``NAME`` a parameter the CLI has a flag for):

========================  ========================
library                   CLI
========================  ========================
``NAME=True``             ``--name``
``NAME=False``            ``--no-name``
``NAME='value'``          ``--name value``
``NAME=['a', 'b']``       ``--name a --name b``
``NAME=5`` / ``NAME=...`` ``--name 5`` / ``--name``
========================  ========================
"""

from __future__ import annotations

import ast
import functools
import re
import shlex
from dataclasses import dataclass

import click

__all__ = ["Flag", "cli_words", "flag_table"]


@dataclass(frozen=True)
class Flag:
    """How one library parameter is typed on the command line."""

    on: str | None  # the flag itself (``--overwrite``, ``--to``); None when only its negation exists
    off: str | None = None  # the flag that sets it False (``--no-manifest``, ``--no-cache``)


def _keyword(opt: str) -> str:
    return opt.lstrip("-").replace("-", "_")


def _flags_of(option: click.Option) -> dict[str, Flag]:
    longs = [o for o in option.opts if o.startswith("--")]
    if not longs or option.name is None:
        return {}
    flag = longs[0]
    off = next((o for o in option.secondary_opts if o.startswith("--no-")), None)
    if flag.startswith("--no-") and option.is_flag and off is None:  # --no-cache: the parameter is `cache`
        return {_keyword(flag)[3:]: Flag(None, flag)}
    names = {option.name, _keyword(flag)}
    if type(option.type).__name__ == "SizeParam":  # a size's Python parameter is its byte count, NAME_bytes
        names.add(f"{_keyword(flag)}_bytes")
    return {name: Flag(flag, off) for name in names}


def flag_table(group: click.Group) -> dict[str, Flag]:
    """Every parameter name of every command in ``group`` → its flag (one flag per name, checked by a test)."""
    table: dict[str, Flag] = {}
    for command in group.commands.values():
        for param in command.params:
            if isinstance(param, click.Option):
                for name, flag in _flags_of(param).items():
                    known = table.get(name)
                    table[name] = flag if known is None else Flag(known.on or flag.on, known.off or flag.off)
    return table


@functools.lru_cache(maxsize=1)
def _table() -> dict[str, Flag]:
    from . import cli

    return flag_table(cli)


_VALUE = r"True|False|\.\.\.|'[^']*'|\"[^\"]*\"|\[[^\]]*\]|-?[0-9][\w.]*"
_ALTERNATIVES = r"(?:,? (?:or )?'[^' ]*'(?=[ ,;)]|$))*"  # dtype='bf16', 'fp16' or 'fp32': the other choices


@functools.lru_cache(maxsize=1)
def _pattern() -> re.Pattern[str]:
    names = "|".join(sorted(map(re.escape, _table()), key=len, reverse=True))
    # not inside a word or a quoted name, and not a keyword of a Python call shown as such: f(device_map='auto')
    return re.compile(rf"(?<![\w.\-'\"])(?<!\w\()({names})=({_VALUE})?(?![\w(])({_ALTERNATIVES})")


def _render(flag: Flag, value: str | None) -> str | None:
    if value in (None, "...", "True"):
        return flag.on
    if value == "False":
        return flag.off
    if flag.on is None:
        return None
    try:
        parsed = ast.literal_eval(value) if value[0] in "'\"[" else value
    except (ValueError, SyntaxError):
        return None
    items = parsed if isinstance(parsed, list) else [parsed]
    return " ".join(f"{flag.on} {shlex.quote(str(item))}" for item in items) or flag.on


def cli_words(message: str) -> str:
    """``message`` with every ``name=value`` of a CLI parameter written as its flag.

    >>> cli_words("out/ is not empty; pass overwrite=True, or drop to='diffusers' and cache=False")
    'out/ is not empty; pass --overwrite, or drop --to diffusers and --no-cache'
    >>> cli_words("give dtype='bf16', 'fp16' or 'fp32'; see shardkit.load_model(device_map='auto')")
    "give --dtype bf16, fp16 or fp32; see shardkit.load_model(device_map='auto')"
    """
    def flag_of(match: re.Match[str]) -> str:
        rendered = _render(_table()[match.group(1)], match.group(2))
        if rendered is None:
            return match.group(0)
        return rendered + match.group(3).replace("'", "")

    return _pattern().sub(flag_of, message)
