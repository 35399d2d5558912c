"""The write options are defined once (the fields of ``WriteOptions``); everything else is checked against them.

A new option is one field: the typed keywords (``WriteKeywords``/``SaveKeywords``), the public
signatures, the CLI's flags and the table in docs/options.md fail here until they agree with it.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import get_args

import click
import pytest

import shardkit
from shardkit.api.options import (
    DEFAULT_MAX_SHARD_SIZE,
    ConvertTo,
    PushOptions,
    option_keyword,
    push_fields,
    write_fields,
)
from shardkit.cli import cli
from shardkit.sharding.options import Quantize, SaveKeywords, WriteKeywords, WriteOptions

REPO = Path(__file__).resolve().parents[1]
KEYWORDS = [option_keyword(f) for f in write_fields()]
NOT_SAVED = {"dry_run", "quantize"}  # an in-memory save is never a dry run and never quantizes


def _keys(typed: type) -> set[str]:
    return set(typed.__required_keys__ | typed.__optional_keys__)  # type: ignore[attr-defined]


def test_the_typed_keywords_are_the_fields() -> None:
    assert sorted(_keys(WriteKeywords)) == sorted(KEYWORDS)
    assert _keys(SaveKeywords) == set(KEYWORDS) - NOT_SAVED
    hints = {k: getattr(v, "__forward_arg__", v) for k, v in WriteKeywords.__annotations__.items()}
    for f in write_fields():
        if f.name == option_keyword(f):  # the same name has the same type (max_shard_size is the parsed size)
            assert hints[f.name] == f.type, (f.name, hints[f.name], f.type)


def test_the_docstring_documents_every_field() -> None:
    documented = re.findall(r"^        (\w+): ", WriteOptions.__doc__ or "", flags=re.M)
    assert documented == [f.name for f in write_fields()]


def test_quantize_choices_are_the_schemes_the_writers_know() -> None:
    from shardkit.formats.gguf import GGUF_QUANTIZE
    from shardkit.layouts.fp4_quantize import FP4_SCHEMES
    from shardkit.layouts.fp8 import QUANTIZE_SCHEMES

    assert set(get_args(Quantize)) == {*QUANTIZE_SCHEMES, *FP4_SCHEMES, *GGUF_QUANTIZE}


@pytest.mark.parametrize("function, typed", [(shardkit.split, WriteKeywords), (shardkit.convert, WriteKeywords),
                                             (shardkit.split_and_push, WriteKeywords),
                                             (shardkit.save_sharded, SaveKeywords)])
def test_public_signatures_take_the_options_and_restate_none(function: object, typed: type) -> None:
    params = inspect.signature(function).parameters  # type: ignore[arg-type]
    assert params["options"].annotation == "WriteOptions | None" and params["options"].default is None
    shorthands = params["shorthands"]
    assert shorthands.kind is inspect.Parameter.VAR_KEYWORD
    assert shorthands.annotation == f"Unpack[{typed.__name__}]"
    assert not set(params) & set(KEYWORDS), "a write option restated as a parameter"


@pytest.mark.parametrize("function, typed", [(shardkit.split, WriteKeywords), (shardkit.save_sharded, SaveKeywords)])
def test_a_keyword_outside_the_definition_is_refused(function, typed: type, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_shard_sise'"):
        function({}, tmp_path / "out", max_shard_sise="5GB")
    if typed is SaveKeywords:
        with pytest.raises(TypeError, match="unexpected keyword argument 'dry_run'"):
            function({}, tmp_path / "out", dry_run=True)


def _options(command: str) -> dict[str, click.Option]:
    return {p.name: p for p in cli.commands[command].params if isinstance(p, click.Option) and p.name}


@pytest.mark.parametrize("command", ["split", "convert"])
def test_the_cli_flags_are_made_from_the_fields(command: str) -> None:
    options = _options(command)
    for f in write_fields():
        if not f.metadata["cli"]:
            assert f.name not in options, f"{f.name} has no CLI flag by definition"
            continue
        option = options[f.name]  # stored under the field's name, so the command passes **write on
        flag = "--" + option_keyword(f).replace("_", "-")
        assert option.opts == [flag], (f.name, option.opts)
        assert option.help == f.metadata["help"]
        assert option.secondary_opts == ([f"--no-{flag[2:]}"] if f.metadata["negatable"] else [])
        choices = list(getattr(option.type, "choices", []))
        assert choices == list(f.metadata["choices"]), (f.name, choices)
        default = DEFAULT_MAX_SHARD_SIZE if f.name == "max_shard_bytes" else f.default
        assert option.default == default, (f.name, option.default)


def test_the_convert_command_and_function_take_the_same_options() -> None:
    params = set(inspect.signature(shardkit.convert).parameters) - {"source", "output", "options", "shorthands"}
    cli_only = {"as_json", "quiet", "plan_file", "resume"}  # how the CLI prints; the job as a plan (shardkit.write_plan)
    flags = {"cache" if n == "no_cache" else n for n in _options("convert")} - {f.name for f in write_fields()} - cli_only
    assert flags == params - {"collective"}, sorted(flags ^ (params - {"collective"}))  # collective: torchrun's env
    assert list(_options("convert")["to"].type.choices) == list(get_args(ConvertTo))  # type: ignore[attr-defined]


def test_one_flag_per_parameter_across_commands() -> None:
    """The table that turns library words into flags is unambiguous: a parameter has one flag everywhere."""
    from shardkit.cli.flags import _flags_of

    seen: dict[str, tuple[str, object]] = {}
    for name, command in cli.commands.items():
        for param in command.params:
            if isinstance(param, click.Option):
                for key, flag in _flags_of(param).items():
                    first = seen.setdefault(key, (name, flag))
                    assert first[1] == flag, f"{key}: {first[0]} has {first[1]}, {name} has {flag}"


def options_table() -> str:
    """The table docs/options.md holds, made from the fields."""
    rows = ["| Python | CLI | default | what it does |", "|---|---|---|---|"]
    for f in write_fields():
        keyword = option_keyword(f)
        flag = "--" + keyword.replace("_", "-")
        flag += f"/--no-{flag[2:]}" if f.metadata["negatable"] else ""
        shown = f"`{flag}`" if f.metadata["cli"] else "—"
        default = DEFAULT_MAX_SHARD_SIZE if keyword != f.name else f.default
        rows.append(f"| `{keyword}` | {shown} | `{default!r}` | {f.metadata['help']} |")
    return "\n".join(rows)


def test_the_docs_table_is_the_definition() -> None:
    page = (REPO / "docs" / "options.md").read_text()
    assert options_table() in page, "docs/options.md's table drifted; it should read:\n" + options_table()


def test_the_push_flags_are_made_from_the_fields() -> None:
    options = _options("push")
    assert set(options) - {f.name for f in push_fields()} == {"as_json", "quiet"}  # how the CLI prints
    for f in push_fields():
        if not f.metadata["cli"]:
            assert f.name not in options, f"{f.name} has no CLI flag by definition"
            continue
        option = options[f.name]
        flag = "--" + f.name.replace("_", "-")
        expected = [f"--no-{flag[2:]}"] if f.default is True else [flag, *([f.metadata["short"]] if f.metadata["short"] else [])]
        assert option.opts == expected, (f.name, option.opts)
        assert option.help == f.metadata["help"] and option.multiple == bool(f.metadata["repeatable"])
        assert list(getattr(option.type, "choices", [])) == list(f.metadata["choices"]), f.name
        if not option.multiple:  # a repeatable flag given no value is an empty tuple, as the field's default
            assert option.default == f.default, (f.name, option.default)


def test_the_push_docstring_documents_every_field() -> None:
    documented = re.findall(r"^        (\w+): ", PushOptions.__doc__ or "", flags=re.M)
    assert documented == [f.name for f in push_fields()]


def push_options_table() -> str:
    """The push table docs/options.md holds, made from the fields."""
    rows = ["| Python | CLI | default | what it does |", "|---|---|---|---|"]
    for f in push_fields():
        flag = "--" + ("no-" if f.default is True else "") + f.name.replace("_", "-")
        flag += f", {f.metadata['short']}" if f.metadata["short"] else ""
        shown = f"`{flag}`" if f.metadata["cli"] else "—"
        rows.append(f"| `{f.name}` | {shown} | `{f.default!r}` | {f.metadata['help']} |")
    return "\n".join(rows)


def test_the_docs_push_table_is_the_definition() -> None:
    page = (REPO / "docs" / "options.md").read_text()
    assert push_options_table() in page, "docs/options.md's push table drifted; it should read:\n" + push_options_table()
