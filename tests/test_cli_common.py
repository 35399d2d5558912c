"""What every command shares, through the real `shardkit` process: progress only on a terminal,
global flags anywhere on the line, a bare `shardkit`, and a reader that leaves a pipe early."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import SHARDKIT_BIN
from safetensors.torch import save_file

from shardkit.cli.common import hoist_global_flags


def _source(tmp_path: Path) -> Path:
    path = tmp_path / "src.safetensors"
    save_file({f"w{i}": torch.ones(64, 64) for i in range(8)}, str(path))
    return path


def _run(*args: object, **kwargs: object) -> subprocess.CompletedProcess:
    return subprocess.run([SHARDKIT_BIN, *map(str, args)], capture_output=True, text=True, timeout=300, **kwargs)


def test_no_progress_frames_when_stderr_is_not_a_terminal(tmp_path: Path) -> None:
    src = _source(tmp_path)
    for command in (["split", src, tmp_path / "a", "--max-shard-size", "40KB"],
                    ["convert", src, tmp_path / "b", "--max-shard-size", "40KB"],
                    ["merge", tmp_path / "a", tmp_path / "merged.safetensors"],
                    ["verify", tmp_path / "a"]):
        proc = _run(*command)
        assert proc.returncode == 0, proc.stderr
        assert "\r" not in proc.stderr and "%|" not in proc.stderr, (command, proc.stderr)


def test_progress_flag_forces_the_bar_anywhere_on_the_line(tmp_path: Path) -> None:
    proc = _run("split", _source(tmp_path), tmp_path / "out", "--max-shard-size", "40KB", "--progress")
    assert proc.returncode == 0, proc.stderr
    assert "split:" in proc.stderr and "%|" in proc.stderr


def test_debug_after_the_command_gives_the_traceback(tmp_path: Path) -> None:
    proc = _run("split", tmp_path / "missing.safetensors", tmp_path / "out", "--debug")
    assert proc.returncode == 2
    assert "Traceback (most recent call last)" in proc.stderr
    quiet = _run("split", tmp_path / "missing.safetensors", tmp_path / "out")
    assert quiet.returncode == 2 and "Traceback" not in quiet.stderr
    assert len(quiet.stderr.strip().splitlines()) == 1


def test_hoisting_stops_at_the_double_dash() -> None:
    assert hoist_global_flags(["info", "x", "--progress", "--debug"]) == ["--debug", "--progress", "info", "x"]
    assert hoist_global_flags(["info", "--", "--debug"]) == ["info", "--", "--debug"]


def test_bare_shardkit_prints_the_help_and_exits_0() -> None:
    proc = _run()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Usage: shardkit") and "split" in proc.stdout
    assert "error" not in proc.stderr


def test_a_reader_that_leaves_the_pipe_early_is_not_an_error(tmp_path: Path) -> None:
    src = _source(tmp_path)
    proc = subprocess.Popen([SHARDKIT_BIN, "info", str(src)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # like `| head -0`: closed before shardkit writes a byte
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()
    assert err.decode() == ""


def test_top_level_help_gives_each_command_a_whole_one_line_summary() -> None:
    """No '...' cut in the command list, and no summary wrapped onto a second line (issue 14, item 17)."""
    import subprocess

    from conftest import SHARDKIT_BIN

    out = subprocess.run([SHARDKIT_BIN, "--help"], capture_output=True, text=True, env={**os.environ, "COLUMNS": "80"},
                         check=True).stdout
    commands = out.split("Commands:\n", 1)[1].splitlines()
    assert commands and all(line.startswith("  ") and not line.startswith("   ") for line in commands), out
    assert "..." not in "\n".join(commands) and "…" not in "\n".join(commands)
    from shardkit.cli import cli

    assert len(commands) == len(cli.commands)


def test_max_shard_size_help_says_bytes() -> None:
    from click.testing import CliRunner

    from shardkit.cli import cli

    text = " ".join(CliRunner().invoke(cli, ["split", "--help"]).output.split())
    assert "5GB = 5×10^9 bytes" in text and "units" not in text


def test_a_bug_is_one_line_exit_2_and_its_traceback_with_debug(capsys: pytest.CaptureFixture[str]) -> None:
    import click

    from shardkit.cli.common import run_cli

    @click.group()
    @click.option("--debug", is_flag=True)  # as the real group has
    def group(debug: bool) -> None: ...

    @group.command()
    def broken() -> None:
        raise KeyError("not-a-real-key")

    assert run_cli(group, ["broken"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error KeyError" in err and "--debug" in err
    with pytest.raises(KeyError, match="not-a-real-key"):
        run_cli(group, ["broken", "--debug"])
