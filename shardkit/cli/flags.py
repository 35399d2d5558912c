"""The library speaks Python, the CLI speaks flags: one table between them, made from the commands.

Library messages name each option as an :class:`~shardkit.errors.Option` part of the error or
warning (``Option("overwrite", True)``, whose Python text is ``overwrite=True``); where the CLI
prints a library error, warning or option help it writes each such part as the flag a user of the
command line types (``--overwrite``, ``--to diffusers``, ``--no-cache``, ``--config``). No text is
parsed: a part is an option or it is plain text. The table is read from the registered click
commands themselves, whose write options are made from :class:`~shardkit.api.options.WriteOptions`,
so a flag renamed there is renamed in every message at once.

Written forms (``NAME`` a parameter the CLI has a flag for; any other option keeps its Python form):

=================================  ========================
library                            CLI
=================================  ========================
``NAME=True``                      ``--name``
``NAME=False``                     ``--no-name``
``NAME='value'``                   ``--name value``
``NAME=['a', 'b']``                ``--name a --name b``
``NAME=5`` / ``NAME=...``          ``--name 5`` / ``--name``
``NAME='a', 'b' or 'c'``           ``--name a, b or c``
=================================  ========================
"""

from __future__ import annotations

import functools
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import click

from ..errors import Option, Part, parts_of, with_choices

__all__ = ["Flag", "cli_words", "flag_table", "message_words", "option_words"]


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


def _flag_form(flag: Flag, option: Option) -> str | None:
    value = option.value
    if value is ... or value is True:
        return flag.on
    if value is False:
        return flag.off
    if flag.on is None:
        return None
    if isinstance(value, dict):  # a budget: the CLI's DEVICE=SIZE,... form
        value = ",".join(f"{device}={size}" for device, size in value.items())
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    text = " ".join(f"{flag.on} {shlex.quote(str(item))}" for item in items) or flag.on
    return with_choices(text, list(option.choices))


def option_words(option: Option, table: Mapping[str, Flag] | None = None) -> str:
    """How the CLI writes one option a message names: its flag, or its Python form when no command has one.

    >>> option_words(Option("to", "diffusers")), option_words(Option("weights_only", True))
    ('--to diffusers', 'weights_only=True')
    """
    flag = (_table() if table is None else table).get(option.name)
    rendered = None if flag is None else _flag_form(flag, option)
    return str(option) if rendered is None else rendered


def cli_words(parts: Iterable[Part], table: Mapping[str, Flag] | None = None) -> str:
    """A message's parts as the CLI prints them: every option a flag where a command has one.

    >>> cli_words(["out/ is not empty; pass ", Option("overwrite", True), ", or drop ", Option("to", "diffusers"),
    ...            " and ", Option("cache", False)])
    'out/ is not empty; pass --overwrite, or drop --to diffusers and --no-cache'
    >>> cli_words(["give ", Option("dtype", "bf16", choices=("fp16", "fp32")), "; see load_model(device_map='auto')"])
    "give --dtype bf16, fp16 or fp32; see load_model(device_map='auto')"
    >>> cli_words([Option("exclude", ["model_ema.*", "x y"]), " or ", Option("max_memory", {0: "8GB", "cpu": "1GB"})])
    "--exclude 'model_ema.*' --exclude 'x y' or --max-memory 0=8GB,cpu=1GB"
    """
    return "".join(part if isinstance(part, str) else option_words(part, table) for part in parts)


def message_words(message: BaseException | str) -> str:
    """An error's or warning's message as the CLI prints it (:func:`cli_words` of its parts; plain text as is)."""
    return message if isinstance(message, str) else cli_words(parts_of(message))
