"""Errors on the command line speak in flags and name the file (issue 14, item 9)."""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import TINY_UNET_CONFIG, assert_one_line_error, leftovers, make_state_dict


def _checkpoint(folder: Path) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.safetensors"
    save_file(make_state_dict(["F32", "I64"], shapes=[(40,)]), str(path))
    return path


@pytest.fixture
def read_only_mount(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs holding a checkpoint and a sharded copy, then remounted read-only."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root (this project's machines and CI run as root)")
    try:
        from shardkit import split

        split(_checkpoint(mnt), mnt / "sharded", max_shard_size="200B")
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("args", [
    ["merge", "{m}/sharded", "{m}/merged.safetensors"],
    ["split", "{m}/model.safetensors", "{m}/out"],
    ["split", "{m}/sharded", "{m}/sharded", "--overwrite", "--max-shard-size", "1KB"],
    ["convert", "{m}/model.safetensors", "{m}/one.safetensors"],
])
def test_read_only_filesystem_is_one_line_naming_it(run_cli, read_only_mount: Path, args: list[str]) -> None:
    result = run_cli(*[a.format(m=read_only_mount) for a in args])
    line = assert_one_line_error(result, contains="read-only filesystem")
    assert "Errno" not in line and "OSError" not in line


@contextlib.contextmanager
def _empty_tmpfs(path: Path, options: str) -> Iterator[Path]:
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root (this project's machines and CI run as root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_read_only_mount_point_as_output_says_not_writable(run_cli, tmp_path: Path) -> None:
    src = _checkpoint(tmp_path / "src")
    with _empty_tmpfs(tmp_path / "empty-ro", "size=1m,ro") as mnt:
        line = assert_one_line_error(run_cli("split", src, mnt), contains="not writable")
        assert "another process" not in line


def test_writable_mount_point_as_output_is_written_into(run_cli, tmp_path: Path) -> None:
    src = _checkpoint(tmp_path / "src")
    with _empty_tmpfs(tmp_path / "empty-rw", "size=4m") as mnt:
        result = run_cli("split", src, mnt, "--max-shard-size", "200B")
        assert result.exit_code == 0, result.stderr
        assert (mnt / "model.safetensors.index.json").is_file() and not leftovers(mnt)


@pytest.mark.parametrize("command", ["info", "split", "merge", "verify"])
def test_unreadable_shard_is_named_without_a_python_exception(run_cli, tmp_path: Path, monkeypatch,
                                                              command: str) -> None:
    from shardkit import split

    split(_checkpoint(tmp_path / "src"), tmp_path / "sharded", max_shard_size="200B")
    denied = str(tmp_path / "sharded" / "model-00002-of-00002.safetensors")
    real_open = builtins.open

    def open_denied(file, *args, **kwargs):  # root reads every file, so deny it here
        if isinstance(file, (str, os.PathLike)) and os.fspath(file) == denied:
            raise PermissionError(13, "Permission denied", denied)
        return real_open(file, *args, **kwargs)

    real_os_open = os.open

    def os_open_denied(file, flags, *args, dir_fd=None, **kwargs):  # checked descriptors (formats/links.py)
        name = os.fspath(file) if isinstance(file, (str, os.PathLike)) else file
        if name == denied or (dir_fd is not None and name == os.path.basename(denied)):
            raise PermissionError(13, "Permission denied", denied)
        return real_os_open(file, flags, *args, dir_fd=dir_fd, **kwargs)

    monkeypatch.setattr(builtins, "open", open_denied)
    monkeypatch.setattr(os, "open", os_open_denied)
    extra = {"split": [tmp_path / "out"], "merge": [tmp_path / "m.safetensors"]}.get(command, [])
    result = run_cli(command, tmp_path / "sharded", *extra)
    assert result.exit_code in (1, 2), result.stderr
    assert "PermissionError" not in result.stderr and "Errno" not in result.stderr
    assert "model-00002-of-00002.safetensors" in result.stderr + result.stdout
    assert "permission denied" in (result.stderr + result.stdout).lower()


def test_config_of_another_class_names_the_flags_to_fix(run_cli, tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({**TINY_UNET_CONFIG, "_class_name": "UNet2DConditionModel", "cross_attention_dim": None,
                               "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
                               "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"]}))
    result = run_cli("plan", "--model", "diffusers:UNet2DConditionModel", "--config", bad, "--max-memory", "0=1GB")
    line = assert_one_line_error(result, contains="--model")
    assert "--config" in line and "config=" not in line  # the library says config=...; the CLI shows its flag


def test_config_with_another_class_name_warns(run_cli, tmp_path: Path) -> None:
    vae = tmp_path / "config.json"
    vae.write_text(json.dumps({"_class_name": "AutoencoderKL", "block_out_channels": [8, 16], "norm_num_groups": 8}))
    result = run_cli("plan", "--model", "diffusers:UNet2DConditionModel", "--config", vae, "--max-memory", "0=1GB")
    assert "the config is for AutoencoderKL, not UNet2DConditionModel" in result.stderr


def test_missing_config_names_the_flag(run_cli, tmp_path: Path) -> None:
    result = run_cli("plan", "--model", "diffusers:UNet2DConditionModel", "--max-memory", "0=1GB")
    assert_one_line_error(result, contains="--config")
