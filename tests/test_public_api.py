"""``import shardkit`` names: every public name resolves, stays what it is after submodules load, and is light."""

from __future__ import annotations

import subprocess
import sys

import shardkit


def test_every_public_name_resolves() -> None:
    for name in shardkit.__all__:
        assert getattr(shardkit, name) is not None, name


def test_functions_stay_functions_after_their_folders_are_imported() -> None:
    """A stage folder named like a public function would replace it on import (shardkit.fit once did)."""
    code = ("import importlib, pkgutil, shardkit\n"
            "for m in pkgutil.walk_packages(shardkit.__path__, 'shardkit.'):\n"
            "    if not m.name.startswith('shardkit.cli'): importlib.import_module(m.name)\n"
            "import inspect\n"
            "bad = [n for n in shardkit._LAZY if inspect.ismodule(getattr(shardkit, n))]\n"
            "assert not bad, bad\n"
            "assert callable(shardkit.fit) and shardkit.fit.__module__ == 'shardkit.api.planning'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_import_shardkit_loads_no_heavy_library() -> None:
    code = "import shardkit, sys; print([m for m in ('torch', 'diffusers', 'huggingface_hub') if m in sys.modules])"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "[]", proc.stderr


def test_type_checkers_see_the_names_imported_at_run_time() -> None:
    """The ``if TYPE_CHECKING:`` imports (what editors see) name the same modules as the lazy table."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(shardkit))
    block = next(node for node in tree.body if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING")
    seen = {alias.name: node.module for node in block.body if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert seen == shardkit._LAZY
    assert set(shardkit._LAZY) <= set(shardkit.__all__)
    assert sorted(shardkit.__all__) == sorted(set(shardkit.__all__))


def test_docstring_examples_either_run_or_are_plain_text() -> None:
    """scripts/test runs the package's doctests; an example that needs files is plain text, never a
    skipped doctest that nobody runs (one had gone stale that way)."""
    from pathlib import Path

    package = Path(shardkit.__file__).parent
    skipped = [str(p.relative_to(package)) for p in package.rglob("*.py") if "doctest: +SKIP" in p.read_text()]
    assert skipped == []


def test_every_public_error_is_defined_in_errors_and_exported() -> None:
    """One error hierarchy: each public exception class lives in ``shardkit.errors``, derives from
    ``ShardkitError`` and is importable as ``shardkit.NAME``."""
    import importlib
    import inspect
    import pkgutil

    from shardkit import errors

    elsewhere = []
    for info in pkgutil.walk_packages(shardkit.__path__, "shardkit."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, Exception) and obj.__module__ == info.name \
                    and not name.startswith("_") and info.name != "shardkit.errors":
                elsewhere.append(f"{info.name}.{name}")
    assert not elsewhere, f"define these in shardkit/errors.py: {elsewhere}"
    public = [n for n, obj in vars(errors).items() if inspect.isclass(obj) and issubclass(obj, Exception)]
    assert all(issubclass(getattr(errors, n), (errors.ShardkitError, errors.ShardkitWarning)) for n in public)
    assert [n for n in public if getattr(shardkit, n, None) is not getattr(errors, n)] == []
    assert "StoreError" in shardkit.__all__ and "FitError" in shardkit.__all__


def test_a_folder_named_shardkit_in_the_working_directory_does_not_shadow_the_package(tmp_path) -> None:
    """From the folder holding a clone named ``shardkit``, ``import shardkit`` is still the package
    (scripts/_env.sh installs it as a path entry, not an import hook that a namespace folder beats)."""
    (tmp_path / "shardkit").mkdir()
    code = "import shardkit; print(shardkit.__file__, hasattr(shardkit, 'load_model'))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.split()[-1] == "True", proc.stdout + proc.stderr
