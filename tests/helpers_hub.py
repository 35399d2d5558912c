"""Fixtures and helpers for tests that talk to the offline Hub (``tests/hub_server.py``).

huggingface_hub reads ``HF_ENDPOINT``, ``HF_HUB_DISABLE_XET`` and the cache locations when it is
imported, so everything that uses the client runs in a subprocess with :func:`hub_env`; the
server itself runs in the test process, where a test can inspect and steer it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hub_server import HubServer, HubState

TOKEN = "hf_test_token"
SHARDKIT_BIN = str(Path(sys.executable).with_name("shardkit"))


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[HubServer]:
    """A fresh offline Hub on a free loopback port; user ``alice`` with token :data:`TOKEN`."""
    with HubServer(tmp_path / "hub", multipart_threshold=300_000, multipart_chunk=128 * 1024) as server:
        yield server


def hub_env(hub: HubServer, home: Path, *, xet: bool = False, token: str | None = TOKEN) -> dict[str, str]:
    """Environment for a client subprocess: our endpoint, a private HF_HOME, Xet on or off."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE"))}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(home), HF_HUB_CACHE=str(home / "hub"),
               HF_XET_CACHE=str(home / "xet"), HF_HUB_DISABLE_TELEMETRY="1",
               HF_HUB_DISABLE_PROGRESS_BARS="1", HF_HUB_DISABLE_XET="0" if xet else "1")
    if token is not None:
        env["HF_TOKEN"] = token
    home.mkdir(parents=True, exist_ok=True)
    return env


def run_python(code: str, env: dict[str, str], *args: Any, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -c code args...`` with ``env``; raises with the output when it fails."""
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def run_shardkit(env: dict[str, str], *args: Any, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([SHARDKIT_BIN, *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=timeout)


_DOWNLOAD = """
import sys
from huggingface_hub import snapshot_download
print(snapshot_download(sys.argv[1], revision=sys.argv[2], repo_type=sys.argv[3], local_dir=sys.argv[4]))
"""


def download(env: dict[str, str], repo_id: str, dest: Path, *, revision: str = "main",
             repo_type: str = "model") -> Path:
    """``snapshot_download`` into ``dest`` through the real client."""
    run_python(_DOWNLOAD, env, repo_id, revision, repo_type, dest)
    return dest


def index_problems(state: HubState, repo_id: str, repo_type: str = "model") -> list[str]:
    """Every commit in the repo's history whose index files name shards that commit lacks."""
    problems = []
    repo = state.repo(repo_id, repo_type)
    for oid in repo.history:
        files = repo.commits[oid].files
        for path, entry in files.items():
            if not path.endswith(".index.json") or entry.content is None:
                continue
            folder = path.rpartition("/")[0]
            for shard in set(json.loads(entry.content)["weight_map"].values()):
                if (f"{folder}/{shard}" if folder else shard) not in files:
                    problems.append(f"commit {oid[:8]}: {path} names missing {shard}")
    return problems


def lazy_safetensors(tensors: dict[str, tuple[str, tuple[int, ...]]], *, header_total_bytes: int | None = None,
                     metadata: dict[str, str] | None = None) -> Any:
    """A :class:`hub_state.LazyBlob` with a real safetensors header and generated zeros as data.

    ``tensors`` maps names to ``(dtype, shape)``; ``header_total_bytes`` pads the header (with
    trailing spaces, as writers do) so that the length prefix plus the JSON is exactly that long.
    """
    import math

    from hub_state import LazyBlob

    from shardkit.formats.header import TensorEntry, build_header
    from shardkit.units import DTYPE_BITS

    entries = [TensorEntry(n, d, s, math.prod(s) * DTYPE_BITS[d] // 8) for n, (d, s) in tensors.items()]
    head, _ = build_header(entries, metadata=metadata)
    if header_total_bytes is not None:
        pad = header_total_bytes - len(head)
        assert pad >= 0, f"header is {len(head)} bytes, over {header_total_bytes}"
        raw = head[8:] + b" " * pad
        head = len(raw).to_bytes(8, "little") + raw
    return LazyBlob(head, len(head) + sum(e.nbytes for e in entries))


def hub_files(folder: Path) -> dict[str, bytes]:
    """:func:`folder_files` of ``folder`` as a Hub repository holds them: with the ``.gitattributes`` every Hub
    repository has (written into ``folder`` too, so that a local split of it copies the same file as a
    split of the repository)."""
    from hub_state import GITATTRIBUTES

    if not (folder / ".gitattributes").exists():
        (folder / ".gitattributes").write_bytes(GITATTRIBUTES)
    return folder_files(folder)


def folder_files(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` by its repo-relative path (for :meth:`HubState.add_repo`)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# Runs argv and reports its wall time and its own peak RSS. A child's ru_maxrss includes the RSS of
# the process it was forked from (kept across exec), so the measured command is started from this
# small interpreter rather than from a test or benchmark process that holds torch or a repository.
_MEASURE = """
import os, subprocess, sys, time
start = time.perf_counter()
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
_, status, usage = os.wait4(proc.pid, 0)
print(os.waitstatus_to_exitcode(status), time.perf_counter() - start, usage.ru_maxrss * 1024)
"""


def run_measured(argv: list[Any], env: dict[str, str], *, timeout: float = 600) -> tuple[int, float, int, str]:
    """Exit code, wall seconds, peak RSS bytes of ``argv`` alone, and its stderr."""
    proc = subprocess.run([sys.executable, "-S", "-c", _MEASURE, *map(str, argv)], env=env, capture_output=True,
                          text=True, timeout=timeout)
    code, seconds, peak = proc.stdout.split()
    return int(code), float(seconds), int(peak), proc.stderr
