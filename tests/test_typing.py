"""The user's view: editors and type checkers see shardkit's public signatures (issue 26).

mypy runs on a small file of user code: correct calls give no error, and a misspelt keyword on each
public function is an error naming it, so a change that hides the signatures again (a lazy
``__getattr__`` without ``TYPE_CHECKING`` imports, a wrapper taking ``**options: Any``) fails here.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import shardkit

ROOT = Path(shardkit.__file__).resolve().parents[1]

GOOD = """\
import shardkit

shardkit.split("model.safetensors", "out", max_shard_size="5GB", dtype="bf16", quantize="fp8-block")
shardkit.convert("model.ckpt", "out", strip_prefix="model.", config="cfg/", to="single-file", cache=False)
shardkit.verify("out", read_data=False, token=None)
shardkit.info("out", token=None)
shardkit.load_model("diffusers:UNet2DConditionModel", "out", device_map="cpu", read="pread")
shardkit.open("out", read="auto", variant=None)
shardkit.push("out", "org/model", dry_run=True, follow_symlinks=False)
shardkit.fit("pipe/", gpu=["24GB"], height=1024)
shardkit.save_sharded({}, "out", max_shard_size="2GB", manifest=False)
result: shardkit.SplitResult = shardkit.split("m.safetensors", "o")
shardkit.load_model("diffusers:UNet2DConditionModel", "out", max_memory={0: "16GB", "cpu": "64GB"}, dtype="bf16")
"""

# (function, misspelt keyword): each line must be an error naming that keyword
BAD = [
    ("split", 'shardkit.split("m.safetensors", "out", max_shard_sise="5GB")'),
    ("convert", 'shardkit.convert("m.ckpt", "out", strip_prefx="model.")'),
    ("verify", 'shardkit.verify("out", readdata=False)'),
    ("info", 'shardkit.info("out", tokn=None)'),
    ("load_model", 'shardkit.load_model("diffusers:UNet2DConditionModel", "out", devicemap="cpu")'),
    ("open", 'shardkit.open("out", raed="auto")'),
    ("push", 'shardkit.push("out", "org/model", dryrun=True)'),
    ("fit", 'shardkit.fit("pipe/", gpus=["24GB"])'),
    ("save_sharded", 'shardkit.save_sharded({}, "out", max_shard_sise="2GB")'),
]

# (function, call): a value of the wrong kind is an error too, not only a misspelt keyword
WRONG = [
    ("load_model", 'shardkit.load_model("diffusers:UNet2DConditionModel", "out", read="fast")'),
    ("convert", 'shardkit.convert("m.ckpt", "out", to="comfy")'),
]


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache for the module's mypy runs: analysing shardkit and torch's stubs is most of the time, so
    it starts as a copy of the project's own cache (``scripts/test`` runs mypy, with the same settings,
    just before the tests: about 3 s here instead of minutes; without it, the same check from scratch)."""
    cache = tmp_path_factory.mktemp("mypy") / "cache"
    if (ROOT / ".mypy_cache").is_dir():
        with contextlib.suppress(shutil.Error, OSError):  # a file mypy replaced meanwhile: mypy redoes its module
            shutil.copytree(ROOT / ".mypy_cache", cache)
    return cache


def _mypy(tmp_path: Path, code: str, cache: Path) -> list[str]:
    """mypy's errors on ``code`` as a user's file, with the project's settings (strict: a superset of the
    default checks); only the errors in that file."""
    user = tmp_path / "user_code.py"
    user.write_text(code)
    proc = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary", "--cache-dir", str(cache),
                           "--config-file", str(ROOT / "pyproject.toml"), str(user)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode in (0, 1), proc.stderr
    return [line for line in proc.stdout.splitlines() if ": error: " in line and line.startswith(str(user))]


def test_user_code_is_checked_against_the_public_signatures(tmp_path: Path, mypy_cache: Path) -> None:
    code = GOOD + "".join(call + "\n" for _, call in BAD)
    errors = _mypy(tmp_path, code, mypy_cache)
    good_lines = GOOD.count("\n")
    assert not [e for e in errors if int(e.split(":")[1]) <= good_lines], errors
    for n, (function, call) in enumerate(BAD, start=good_lines + 1):
        keyword = re.search(r"(\w+)=", call.split(",", 2)[-1]).group(1)  # type: ignore[union-attr]
        found = [e for e in errors if int(e.split(":")[1]) == n]
        assert len(found) == 1 and f'"{keyword}"' in found[0] and f'for "{function}"' in found[0], (call, errors)


def test_closed_choices_are_literals(tmp_path: Path, mypy_cache: Path) -> None:
    code = "import shardkit\n" + "".join(call + "\n" for _, call in WRONG)
    errors = _mypy(tmp_path, code, mypy_cache)
    for n, (function, _) in enumerate(WRONG, start=2):
        found = [e for e in errors if int(e.split(":")[1]) == n]
        assert len(found) == 1 and "incompatible type" in found[0] and f'"{function}"' in found[0], errors
