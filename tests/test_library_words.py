"""Library errors speak the library's words (``overwrite=True``); the CLI shows the same message with its flags.

The library never tells a Python caller to "pass --overwrite": no string outside ``shardkit/cli/``
names a ``--flag`` (docstrings aside, which may describe the command that calls a function, and
the few other tools' command lines a message quotes). ``shardkit/cli/flags.py`` turns each
``name=value`` of a CLI parameter back into its flag where the CLI prints.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import shardkit
from shardkit.cli.flags import cli_words

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


@pytest.mark.parametrize("library, cli", [
    ("out/ exists and is not empty; pass overwrite=True to replace its checkpoint",
     "out/ exists and is not empty; pass --overwrite to replace its checkpoint"),
    ("to='diffusers' maps the file into memory (drop cache=False)", "--to diffusers maps the file into memory (drop --no-cache)"),
    ("drop them with exclude=['model_ema.*']", "drop them with --exclude 'model_ema.*'"),
    ("copy it as is or use manifest=False", "copy it as is or use --no-manifest"),
    ("give a budget (max_memory=..., or gpu_bytes=... and cpu_bytes=...), strategies=True, or both",
     "give a budget (--max-memory, or --gpu and --cpu), --strategies, or both"),
    ("the smallest budget that would fit is gpu='1.31GB' cpu='4.41MB' (offload)",
     "the smallest budget that would fit is --gpu 1.31GB --cpu 4.41MB (offload)"),
    ("casting to fp8 loses precision; pass allow_lossy=True", "casting to fp8 loses precision; pass --allow-lossy"),
    ("dtype='bf16', 'fp16' or 'fp32'", "--dtype bf16, fp16 or fp32"),
    ("weights_only=True and a_name='x' stay; so does load_model(device_map='auto')",
     "weights_only=True and a_name='x' stay; so does load_model(device_map='auto')"),
])
def test_the_cli_shows_flags_for_the_library_words(library: str, cli: str) -> None:
    assert cli_words(library) == cli


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
