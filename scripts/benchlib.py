"""Shared helpers for the benchmarks: run a command in a fresh process, time it, read its peak RSS.

Each case runs as ``python benchlib.py --run CMD`` in a child process: getrusage(RUSAGE_CHILDREN)
there is the peak RSS of exactly that command's process tree.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class Case:
    name: str
    command: str                 # run with bash -c; include "&& sync" for honest write timings
    target: str = ""
    cleanup: list[str] = field(default_factory=list)  # paths removed before each run
    times: list[float] = field(default_factory=list)
    rss_mb: list[float] = field(default_factory=list)
    floor: str = ""              # name of this case's floor, when it is not the table's default


def measure(command: str) -> tuple[float, float]:
    """Wall seconds and peak RSS (MB) of ``bash -c command``, run from a fresh process."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--run", command],
                         check=True, capture_output=True, text=True)
    data = json.loads(out.stdout.strip().splitlines()[-1])
    return data["seconds"], data["rss_mb"]


def _run_and_report(command: str) -> None:
    start = time.perf_counter()
    proc = subprocess.run(["bash", "-c", command], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"benchmark command failed ({proc.returncode}): {command}")
    rss_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(json.dumps({"seconds": seconds, "rss_mb": rss_kb / 1024}))


def run_interleaved(cases: list[Case], *, runs: int, log=print) -> None:
    """Run every case ``runs`` times, interleaved (case order rotates each round)."""
    for r in range(runs):
        order = cases[r % len(cases):] + cases[: r % len(cases)]
        for case in order:
            for path in case.cleanup:
                shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else (
                    os.path.exists(path) and os.unlink(path))
            subprocess.run(["sync"], check=True)
            seconds, rss = measure(case.command)
            case.times.append(seconds)
            case.rss_mb.append(rss)
            log(f"  run {r + 1}/{runs} {case.name}: {seconds:.2f} s, {rss:.0f} MB peak RSS")
    for case in cases:
        for path in case.cleanup:
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else (
                os.path.exists(path) and os.unlink(path))


def publish_report(report: str, output: str | None) -> None:
    """Print the report, and write it to ``output`` too when one is given."""
    print("\n" + report)
    if output:
        with open(output, "w", encoding="utf-8") as f:
            f.write(report)


def machine_line() -> str:
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.machine()}, {os.cpu_count()} cores, {mem_gb:.0f} GiB RAM, Linux {platform.release()}, Python {platform.python_version()}"


def filesystem_line(path: str) -> str:
    """The filesystem ``path`` lies on, e.g. ``ext4 on /dev/vda``, for the report."""
    out = subprocess.run(["findmnt", "-n", "-o", "FSTYPE,SOURCE", "-T", path], capture_output=True, text=True)
    fstype, _, source = out.stdout.strip().partition(" ")
    return f"{fstype or 'unknown'} on {source.strip() or '?'}"


def table(cases: list[Case], *, floor: str, also: str | None = None) -> str:
    """A markdown table of medians; ``also`` adds a column of ratios to a second case."""
    medians = {c.name: statistics.median(c.times) for c in cases}
    extra_head, extra_rule = (f" × {also} |", "---:|") if also else ("", "")
    lines = [f"| case | median s | × floor |{extra_head} peak RSS MB | target |",
             f"|---|---:|---:|{extra_rule}---:|---|"]
    for c in cases:
        base = medians[c.floor or floor]
        extra = f" {medians[c.name] / medians[also]:.3f}× |" if also else ""
        lines.append(f"| {c.name} | {medians[c.name]:.2f} | {medians[c.name] / base:.2f}× |{extra} "
                     f"{max(c.rss_mb):.0f} | {c.target} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- loop-mounted filesystems

MKFS = {"xfs": (["mkfs.xfs", "-q", "-f", "-m", "reflink=1"], "xfsprogs"),
        "btrfs": (["mkfs.btrfs", "-q", "-f"], "btrfs-progs")}


def ensure_mkfs(fs: str) -> None:
    """Install the filesystem's tools with apt-get when ``mkfs.<fs>`` is missing (needs root)."""
    command, package = MKFS[fs]
    if shutil.which(command[0]):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.run(["apt-get", "install", "-y", "-q", package], env=env).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, check=True)
        subprocess.run(["apt-get", "install", "-y", "-q", package], env=env, check=True)


@contextlib.contextmanager
def loop_mount(fs: str, image: str, size_bytes: int) -> Iterator[str]:
    """A fresh ``fs`` filesystem in a sparse ``image`` file, loop-mounted beside it; unmounted after.

    The image is made anew each time (a stale one could hold another run's files).
    """
    ensure_mkfs(fs)
    mount = image + ".mnt"
    if os.path.ismount(mount):
        subprocess.run(["umount", mount], check=True)
    with open(image, "wb") as f:
        f.truncate(size_bytes)
    os.makedirs(mount, exist_ok=True)
    subprocess.run([*MKFS[fs][0], image], check=True)
    subprocess.run(["mount", "-o", "loop", image, mount], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", mount], check=False)
        os.unlink(image)


# ----------------------------------------------------------------------------- page cache and FUSE

def evict(path: str) -> float:
    """Drop ``path``'s pages from the page cache (fsync + POSIX_FADV_DONTNEED); the share still cached."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from shardkit.reading.residency import evict as evict_file

    return evict_file(path) or 0.0


@contextlib.contextmanager
def bindfs_mount(folder: str) -> Iterator[str]:
    """A bindfs (FUSE passthrough) mount of ``folder`` beside it; bindfs installed with apt-get if missing."""
    if not shutil.which("bindfs"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-q"], env=env, check=False)
        subprocess.run(["apt-get", "install", "-y", "-q", "bindfs"], env=env, check=True)
    mount = folder.rstrip("/") + ".fuse"
    os.makedirs(mount, exist_ok=True)
    if not os.path.ismount(mount):
        subprocess.run(["bindfs", "--no-allow-other", folder, mount], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["fusermount", "-u", mount], check=False)

# ----------------------------------------------------------------------------- inputs

# Child-process code writing sys.argv[1] (a safetensors file) as a torch.save zip pickle at sys.argv[2].
TORCH_SAVE = ("import sys, torch; from safetensors.torch import load_file; "
              "torch.save(load_file(sys.argv[1]), sys.argv[2])")


def build_unet_source(kind: str, work: str) -> str:
    """The ``kind`` UNet's safetensors file under ``work``, built once with random weights."""
    from build_checkpoint import build_unet

    src_dir = os.path.join(work, f"{kind}-unet")
    src = os.path.join(src_dir, "diffusion_pytorch_model.safetensors")
    if not os.path.exists(src):
        print(f"building {src} ...", flush=True)
        build_unet(kind, src_dir, overwrite=True)
    return src


def build_once(path: str, code: str, *args: str, note: str = "", hide_stderr: bool = False) -> str:
    """Build ``path`` unless it exists: run Python ``code`` in a child process with ``sys.argv[1:]``
    = ``[*args, tmp]``, then rename ``tmp`` onto ``path`` (an interrupted build leaves no input)."""
    if not os.path.exists(path):
        print(f"building {path}{note} ...", flush=True)
        tmp = path + ".tmp"
        subprocess.run([sys.executable, "-c", code, *args, tmp], check=True,
                       stderr=subprocess.DEVNULL if hide_stderr else None)
        os.replace(tmp, path)
    return path


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--run":
    _run_and_report(sys.argv[2])
