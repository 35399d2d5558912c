"""Library errors speak the library's words (``overwrite=True``); the CLI shows the same message with its flags.

The library never tells a Python caller to "pass --overwrite": no string outside ``shardkit/cli/``
names a ``--flag`` (docstrings aside, which may describe the command that calls a function, and
the few other tools' command lines a message quotes). A message names each option as an
:class:`~shardkit.errors.Option` part, never as ``name=value`` text (checked here too), and
``shardkit/cli/flags.py`` writes each such part as its flag where the CLI prints.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import shardkit
from shardkit.cli.flags import _table, cli_words
from shardkit.errors import Option, Part

PACKAGE = Path(shardkit.__file__).resolve().parent
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# Other tools' flags in a command line a message quotes (module, flag): not shardkit's words.
OTHER_TOOLS = {("distributed/group.py", "--nnodes"), ("distributed/group.py", "--nproc-per-node"),  # torchrun
               ("stores/hf.py", "--repo-type")}  # `hf download`


def _docstrings(tree: ast.AST) -> set[int]:
    kinds = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, kinds) and node.body and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)}


def flags_outside_cli(package: Path = PACKAGE) -> list[str]:
    """Every ``--flag`` in a string literal (f-string parts included) of a module outside ``cli/``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        module = path.relative_to(package).as_posix()
        if module.startswith("cli/"):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        docstrings = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                found += [f"{module}:{node.lineno}: {flag}" for flag in FLAG.findall(node.value)
                          if (module, flag) not in OTHER_TOOLS]
    return found


def test_no_library_string_names_a_cli_flag() -> None:
    found = flags_outside_cli()
    assert not found, "library messages name CLI flags (write name=value; the CLI maps it):\n" + "\n".join(found)


def test_the_check_finds_a_flag(tmp_path: Path) -> None:
    """The check can fail: a message naming --overwrite (in an f-string part too) is found, a docstring is not."""
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "x.py").write_text('HELP = "--overwrite"\n')
    (tmp_path / "job.py").write_text('"""Module doc: `shardkit split --overwrite`."""\n\n\n'
                                     'def f(out):\n    raise ValueError(f"{out} exists; pass --overwrite")\n')
    assert flags_outside_cli(tmp_path) == ["job.py:5: --overwrite"]


MENTION = r"(?<![\w.\-'\",{{])({names})=(?!=)"
# Report text a command prints as a table or a JSON field, never as an error or warning (module, parameter).
REPORTS = {("api/store_verify.py", "against"),  # why a file is not compared, in verify's report
           ("fitting/estimate.py", "dtype"),  # where fit's report took the dtypes from
           ("loading/device_map.py", "device_map")}  # the heading of a placement table


def _message_texts(tree: ast.AST) -> list[tuple[int, str]]:
    """Every string expression (an f-string as its constant parts, each value as ``{}``) outside docstrings."""
    docstrings, inner = _docstrings(tree), set()
    texts = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            inner.update(id(v) for v in node.values)
            texts.append((node.lineno, "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
              and id(node) not in inner):
            texts.append((node.lineno, node.value))
    return texts


def _in_python_call(text: str) -> bool:
    """Whether ``text`` ends inside the parentheses of a Python call it quotes (``shardkit.fit(path, ``)."""
    opened: list[bool] = []
    for i, char in enumerate(text):
        if char == "(":
            opened.append(i > 0 and (text[i - 1].isalnum() or text[i - 1] == "_"))
        elif char == ")" and opened:
            opened.pop()
    return any(opened)


def option_text_in_messages(package: Path = PACKAGE, names: set[str] | None = None) -> list[str]:
    """Every ``NAME=`` of a CLI parameter written as text in a string of a module outside ``cli/``: a message
    names an option as an :class:`Option` part, so that the CLI can write it as a flag."""
    names = set(_table()) if names is None else names
    mention = re.compile(MENTION.format(names="|".join(sorted(map(re.escape, names), key=len, reverse=True))))
    found = []
    for path in sorted(package.rglob("*.py")):
        module = path.relative_to(package).as_posix()
        if module.startswith("cli/"):
            continue
        for line, text in sorted(_message_texts(ast.parse(path.read_text(), filename=str(path)))):
            found += [f"{module}:{line}: {text[max(0, m.start() - 30):m.end() + 20]!r}" for m in mention.finditer(text)
                      if not _in_python_call(text[:m.start()]) and (module, m.group(1)) not in REPORTS]
    return found


def test_no_message_writes_an_option_as_text() -> None:
    found = option_text_in_messages()
    assert not found, ("messages name options as text (write Option(name, value) as a part of the error or "
                       "warning; the CLI writes it as a flag):\n" + "\n".join(found))


def test_the_check_finds_an_option_written_as_text(tmp_path: Path) -> None:
    """The check can fail: ``overwrite=True`` in a message (an f-string too) and in a string built for one are
    found; an Option part, a docstring, a quoted Python call and the CLI's own modules are not."""
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "x.py").write_text('HELP = "overwrite=True"\n')
    (tmp_path / "job.py").write_text(
        '"""Module doc: pass overwrite=True."""\n\n\n'
        'def f(out):\n'
        '    raise ValueError(f"{out} exists; pass overwrite=True")\n\n\n'
        'FIX = "drop to=\'gguf\'"\n'
        'OK = ("pass ", Option("overwrite", True), "; see shardkit.fit(path, to=...)")\n')
    assert option_text_in_messages(tmp_path, {"overwrite", "to"}) == [
        "job.py:5: '{} exists; pass overwrite=True'", "job.py:8: \"drop to='gguf'\""]


@pytest.mark.parametrize("parts, python, cli", [
    (("out/ exists and is not empty; pass ", Option("overwrite", True), " to replace its checkpoint"),
     "out/ exists and is not empty; pass overwrite=True to replace its checkpoint",
     "out/ exists and is not empty; pass --overwrite to replace its checkpoint"),
    ((Option("to", "diffusers"), " maps the file into memory (drop ", Option("cache", False), ")"),
     "to='diffusers' maps the file into memory (drop cache=False)", "--to diffusers maps the file into memory (drop --no-cache)"),
    (("drop them with ", Option("exclude", ["model_ema.*"])), "drop them with exclude=['model_ema.*']",
     "drop them with --exclude 'model_ema.*'"),
    (("copy it as is or use ", Option("manifest", False)), "copy it as is or use manifest=False",
     "copy it as is or use --no-manifest"),
    (("give a budget (", Option("max_memory"), ", or ", Option("gpu_bytes"), " and ", Option("cpu_bytes"), "), ",
      Option("strategies", True), ", or both"),
     "give a budget (max_memory=..., or gpu_bytes=... and cpu_bytes=...), strategies=True, or both",
     "give a budget (--max-memory, or --gpu and --cpu), --strategies, or both"),
    (("the smallest budget that would fit is ", Option("gpu", "1.31GB"), " ", Option("cpu", "4.41MB"), " (offload)"),
     "the smallest budget that would fit is gpu='1.31GB' cpu='4.41MB' (offload)",
     "the smallest budget that would fit is --gpu 1.31GB --cpu 4.41MB (offload)"),
    ((Option("dtype", "bf16", choices=("fp16", "fp32")),), "dtype='bf16', 'fp16' or 'fp32'", "--dtype bf16, fp16 or fp32"),
    ((Option("task", 3), " of ", Option("max_shard_size", "5GB")), "task=3 of max_shard_size='5GB'",
     "--task 3 of --max-shard-size 5GB"),
    ((Option("weights_only", True), " and ", Option("a_name", "x"), " stay; so does load_model(device_map='auto')"),
     "weights_only=True and a_name='x' stay; so does load_model(device_map='auto')",
     "weights_only=True and a_name='x' stay; so does load_model(device_map='auto')"),
])
def test_the_cli_shows_flags_for_the_library_words(parts: tuple[Part, ...], python: str, cli: str) -> None:
    error = shardkit.InvalidInputError(*parts)
    assert str(error) == python and cli_words(error.parts) == cli


def test_a_library_error_names_the_parameter_and_the_cli_the_flag(tmp_path: Path, run_cli) -> None:  # type: ignore[no-untyped-def]
    import torch

    src = tmp_path / "src"
    shardkit.save_sharded({"w": torch.zeros(8)}, src)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("x")
    with pytest.raises(shardkit.OutputExistsError) as error:
        shardkit.split(src, tmp_path / "out")
    assert "overwrite=True" in str(error.value) and "--" not in str(error.value).replace(str(tmp_path), "")
    result = run_cli("split", str(src), str(tmp_path / "out"))
    assert result.exit_code == 2 and "pass --overwrite to replace" in result.stderr, result.stderr
    assert "overwrite=True" not in result.stderr
