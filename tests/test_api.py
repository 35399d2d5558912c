"""The application layer (shardkit/api/): every CLI command calls the function a Python caller gets.

The CLI tests exercise these functions through the commands; here each command is shown to reach
its application-layer function (a spy stands in for it), and the composite jobs that once existed
only behind the CLI (recover, split then push, plan with strategies) are run from Python.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import shardkit
from shardkit.errors import InvalidInputError


class Called(InvalidInputError):
    """Raised by a spy: the command reached the application-layer function."""


def _spy(name: str):
    def spy(*args, **kwargs):
        raise Called(f"{name} was called")

    return spy


@pytest.mark.parametrize("module, function, argv", [
    ("maintenance", "recover", ["recover", "{tmp}"]),
    ("maintenance", "merge", ["merge", "{tmp}", "{tmp}/merged.safetensors"]),
    ("checkpoints", "info", ["info", "{tmp}"]),
    ("checkpoints", "verify", ["verify", "{tmp}"]),
    ("checkpoints", "split_and_push", ["split", "{tmp}", "{tmp}/out"]),
    ("checkpoints", "convert", ["convert", "{tmp}", "{tmp}/out"]),
    ("jobs", "push", ["push", "{tmp}", "alice/tiny"]),
    ("planning", "plan_model", ["plan", "--model", "diffusers:UNet2DConditionModel", "--gpu", "1GB"]),
    ("planning", "fit", ["fit", "{tmp}", "--gpu", "1GB"]),
])
def test_each_command_calls_its_application_layer_function(run_cli, monkeypatch, tmp_path: Path, module: str,
                                                            function: str, argv: list[str]) -> None:
    import importlib

    monkeypatch.setattr(importlib.import_module(f"shardkit.api.{module}"), function, _spy(function))
    result = run_cli(*[a.format(tmp=tmp_path) for a in argv])
    assert result.exit_code == 2 and f"{function} was called" in result.stderr, (result.stdout, result.stderr)


def test_public_functions_are_the_application_layers() -> None:
    from shardkit.api import checkpoints, jobs, maintenance, planning

    for module, names in ((checkpoints, ("split", "convert", "info", "verify", "split_and_push")), (jobs, ("push",)),
                          (maintenance, ("recover", "merge")), (planning, ("fit", "plan_model"))):
        for name in names:
            assert getattr(shardkit, name) is getattr(module, name), name


def test_recover_from_python_finishes_a_journal_and_removes_dead_temporaries(tmp_path: Path) -> None:
    from shardkit.atomic.commit import JOURNAL

    dead = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    (tmp_path / f".shardkit-tmp-{dead}-ffff-orphan.safetensors").write_bytes(b"j" * 2000)
    (tmp_path / f".shardkit-tmp-{dead}-abcd-model.safetensors").write_bytes(b"new")
    (tmp_path / JOURNAL).write_text(json.dumps({
        "remove_first": [], "renames": [[f".shardkit-tmp-{dead}-abcd-model.safetensors", "model.safetensors"]],
        "delete": [],
    }))
    report = shardkit.recover(tmp_path)
    assert report.rolled_forward == ["model.safetensors"] and report.removed_bytes == 2000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert not shardkit.recover(tmp_path).changed


_PLANS = """
import json, sys
import accelerate
import shardkit
from diffusers import UNet2DConditionModel

plan = shardkit.plan_model("diffusers:UNet2DConditionModel", sys.argv[1], gpu_bytes=[10**6], cpu_bytes=10**9,
                           strategies=True)
placement = shardkit.plan_device_map("diffusers:UNet2DConditionModel", checkpoint=sys.argv[1],
                                     max_memory={0: 10**6, "cpu": 10**9})
with accelerate.init_empty_weights():
    unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(sys.argv[2]))
estimate = shardkit.estimate_memory(unet, gpu_bytes=10**6, checkpoint=sys.argv[1])
print(json.dumps({"plan": plan.to_dict(), "placement": placement.to_dict(), "estimate": estimate.to_dict()}))
"""


@pytest.mark.hub
def test_plan_model_plan_device_map_and_estimate_memory_take_a_hub_repo(hub, tmp_path: Path) -> None:
    """hf:// for plan_model, plan_device_map and estimate_memory from Python (as for fit): a header-only
    mirror gives the local folder's placement and strategies. One process a location: the three share it."""
    from conftest import tiny_unet
    from helpers_hub import folder_files, hub_env, run_python
    from helpers_load import save_model

    folder = save_model(tiny_unet(), tmp_path / "unet")
    hub.state.add_repo("alice/unet", folder_files(folder))
    env = hub_env(hub, tmp_path / "home")
    got = json.loads(run_python(_PLANS, env, "hf://alice/unet", folder).stdout)
    want = json.loads(run_python(_PLANS, env, folder, folder).stdout)
    assert got["plan"].pop("checkpoint") == "hf://alice/unet" and want["plan"].pop("checkpoint") == str(folder)
    got["placement"].pop("checkpoint", None), want["placement"].pop("checkpoint", None)
    assert got == want and want["plan"]["strategies"]["strategies"] and want["plan"]["device_map"]
    assert want["placement"]["device_map"] and want["estimate"]["strategies"]


_SPLIT_AND_PUSH = """
import sys
import shardkit
from shardkit.api.options import WriteOptions

done = shardkit.split_and_push(sys.argv[1], sys.argv[2], "alice/tiny", options=WriteOptions(max_shard_bytes=40_000))
print(done.split.plan.total_bytes, done.push.commit_url)
"""


def _make_source(path: Path) -> Path:
    """8 float32 tensors of 16 KiB."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({f"layer.{i}.weight": torch.randn(64, 64, generator=gen) for i in range(8)}, str(path))
    return path


@pytest.mark.hub
def test_split_and_push_from_python(hub, tmp_path: Path) -> None:
    from helpers_hub import hub_env, index_problems, run_python

    source = _make_source(tmp_path / "src" / "model.safetensors")
    proc = run_python(_SPLIT_AND_PUSH, hub_env(hub, tmp_path / "home"), source, tmp_path / "out")
    total, url = proc.stdout.split()
    assert int(total) == 8 * 64 * 64 * 4 and url.startswith(f"{hub.url}/alice/tiny/commit/")
    assert "model-00004-of-00004.safetensors" in hub.state.files_at("alice/tiny")
    assert index_problems(hub.state, "alice/tiny") == []


@pytest.mark.hub
def test_split_and_push_checks_the_token_before_splitting(hub, tmp_path: Path) -> None:
    from helpers_hub import hub_env

    source = _make_source(tmp_path / "src" / "model.safetensors")
    env = hub_env(hub, tmp_path / "home", token=None)
    code = _SPLIT_AND_PUSH.replace("print(", "# print(") + "\n"
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", code, str(source), str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "HubError" in proc.stderr and "no Hugging Face token" in proc.stderr
    assert not (tmp_path / "out").exists(), "the split must not run when the push cannot"


def test_every_public_name_comes_through_the_application_layer() -> None:
    outside = {name: module for name, module in shardkit._LAZY.items() if not module.startswith("api.")}
    assert not outside, f"exported from a stage, not from shardkit/api/: {outside}"


_LOCAL_JOBS = """
import sys
import shardkit
from shardkit.cli import main

src, out = sys.argv[1], sys.argv[2]
shardkit.split(src, out + "/a", max_shard_size="20KB")
shardkit.convert(src, out + "/b", strip_prefix="layer.")
shardkit.split_and_push(src, out + "/c")
try:
    main(["split", src, out + "/d", "--max-shard-size", "40KB"])
except SystemExit as e:
    assert e.code == 0, e.code
# hub/options.py is the push options' definition (the CLI builds `push`'s flags from it): no Hub code
print(sorted(m for m in sys.modules if m.startswith("shardkit.hub") and m not in ("shardkit.hub", "shardkit.hub.options")))
"""


def test_a_local_split_from_python_or_the_cli_never_enters_hub(tmp_path: Path) -> None:
    """A split of a local path goes from the front door to the writer with no detour through hub/."""
    import subprocess
    import sys

    source = _make_source(tmp_path / "src" / "model.safetensors")
    proc = subprocess.run([sys.executable, "-c", _LOCAL_JOBS, str(source), str(tmp_path)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "[]", proc.stdout
    assert (tmp_path / "d" / "model.safetensors.index.json").is_file()


