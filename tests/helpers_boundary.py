"""Hostile folders for the boundary tests: a bounded run of the real CLI, and what changed outside.

Every case must end in one stderr line with exit 1 or 2 within seconds and under 1 GiB, with
nothing outside the folder opened, created, changed or uploaded: :func:`run_bounded` runs the CLI
under a wall-clock limit (a hang fails the test instead of blocking it) and measures the child's
peak RSS; :func:`outside_state` snapshots everything outside the folder to compare before/after.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helpers_reliability import SHARDKIT_BIN, clean_env

MAX_RSS_BYTES = 1 << 30
LIMIT_S = 120.0  # a hang, not a slow run: a refusal takes seconds, a blocked open() forever

# Runs the CLI as a grandchild with a timeout and reports its peak RSS (ru_maxrss, KiB) on the fd argv[1].
# The child is killed (exit 125) as soon as its RSS passes 1.5 GiB: a regression must fail the test,
# never exhaust the machine's memory (before this work, config.json -> /dev/zero grew past 6 GB).
_WRAP = """
import os, resource, subprocess, sys, time
limit_kib = 3 << 19
proc = subprocess.Popen(sys.argv[3:])
deadline = time.monotonic() + float(sys.argv[2])
code = None
while code is None:
    try:
        code = proc.wait(timeout=0.05)
    except subprocess.TimeoutExpired:
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                rss = next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
        except OSError:
            rss = 0
        if rss > limit_kib or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            code = 125 if rss > limit_kib else 124
os.write(int(sys.argv[1]), str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss).encode())
sys.exit(code)
"""


@dataclass
class Bounded:
    """A finished CLI run: exit code, output and the peak RSS of the shardkit process."""

    returncode: int
    stdout: str
    stderr: str
    peak_rss_bytes: int

    @property
    def lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]


def run_bounded(*args: Any, limit_s: float = LIMIT_S, env: dict[str, str] | None = None) -> Bounded:
    """Run ``shardkit ARGS``; a run past ``limit_s`` is killed and returns 124."""
    read, write = os.pipe()
    try:
        proc = subprocess.run([sys.executable, "-c", _WRAP, str(write), str(limit_s), SHARDKIT_BIN, *map(str, args)],
                              capture_output=True, text=True, timeout=limit_s + 30, pass_fds=(write,),
                              env=env or clean_env())
    finally:
        os.close(write)
    with os.fdopen(read, "rb") as f:
        rss = f.read()
    return Bounded(proc.returncode, proc.stdout, proc.stderr, int(rss or 0) * 1024)


def assert_refused(run: Bounded, *, code: int | tuple[int, ...] = 2, contains: str | None = None) -> str:
    """One line, the expected exit code, no traceback, no hang, under 1 GiB; returns the line."""
    codes = (code,) if isinstance(code, int) else code
    assert run.returncode != 124, f"hung past the run's limit: {run.stderr[-500:]}"
    assert run.returncode != 125, f"killed past 1.5 GiB of memory: {run.stderr[-500:]}"
    assert run.returncode in codes, (run.returncode, run.stderr[-2000:], run.stdout[-2000:])
    assert "Traceback" not in run.stderr, run.stderr[-2000:]
    assert run.peak_rss_bytes < MAX_RSS_BYTES, f"peak RSS {run.peak_rss_bytes} bytes"
    if run.returncode == 2 or run.lines:
        assert len(run.lines) == 1, run.stderr
    line = run.lines[0] if run.lines else run.stdout
    if contains is not None:
        assert contains.lower() in (run.stderr + run.stdout).lower(), run.stderr + run.stdout
    return line


def outside_state(root: Path, *, skip: Path) -> dict[str, tuple[str, str]]:
    """Every entry under ``root`` except the folder ``skip``: kind and content hash (or link target)."""
    state: dict[str, tuple[str, str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if here / d != skip]
        for name in dirnames + filenames:
            path = here / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                state[rel] = ("link", os.readlink(path))
            elif path.is_file():
                state[rel] = ("file", hashlib.sha256(path.read_bytes()).hexdigest())
            elif path.is_dir():
                state[rel] = ("dir", "")
            else:
                state[rel] = ("special", "")
    return state


def tree(folder: Path) -> dict[str, tuple[str, str]]:
    """The same snapshot of ``folder`` itself (links not followed)."""
    return outside_state(folder, skip=folder / "\0none")
