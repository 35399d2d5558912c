"""What every benchmark shares: cases (shell commands, :class:`Case`, or Python cases, :func:`child`) run interleaved
in fresh processes by :func:`rounds`, timed, with their peak RSS.
Method: docs/benchmarks.md, "How each benchmark measures".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TESTS = os.path.join(ROOT, "tests")  # the test servers (s3_server, hub_server) and the latency mount live there
for _path in (ROOT, TESTS):  # appended: shardkit from this checkout when it is not installed, then tests/
    if _path not in sys.path:
        sys.path.append(_path)
SK = shlex.quote(os.path.join(os.path.dirname(sys.executable), "shardkit"))  # this interpreter's CLI, for shell cases
K = TypeVar("K")


@dataclass(eq=False)
class Case:
    name: str
    command: str                 # run with bash -c; include "&& sync" for honest write timings
    target: str = ""
    cleanup: list[str] = field(default_factory=list)  # paths removed before each run
    times: list[float] = field(default_factory=list)
    rss_mb: list[float] = field(default_factory=list)
    floor: str = ""              # name of this case's floor, when it is not the table's default
    cpu_s: list[float] = field(default_factory=list)  # user + sys CPU seconds of each run


@dataclass(frozen=True)
class Usage:
    """One run of a shell command: wall seconds, peak RSS (MB) and user + sys CPU seconds of its process tree."""
    seconds: float
    rss_mb: float
    cpu_s: float


# ----------------------------------------------------------------------------- running cases

def measure(command: str, *, env: dict[str, str] | None = None) -> Usage:
    """Wall seconds, peak RSS (MB) and user + sys CPU seconds (getrusage of the children) of ``bash -c command``,
    run from a fresh process (``env`` added to ours)."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--run", command], capture_output=True, text=True,
                         env={**os.environ, **(env or {})})
    if out.returncode != 0:
        raise SystemExit(out.stderr.strip()[-3000:])
    data = json.loads(out.stdout.strip().splitlines()[-1])
    return Usage(data["seconds"], data["rss_mb"], data["cpu_s"])


def _run_and_report(command: str) -> None:
    start = time.perf_counter()
    proc = subprocess.run(["bash", "-c", command], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"benchmark command failed ({proc.returncode}): {command}")
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(json.dumps({"seconds": seconds, "rss_mb": usage.ru_maxrss / 1024, "cpu_s": usage.ru_utime + usage.ru_stime}))


def run_shardkit_recording_peak(argv: list[str]) -> None:
    """``shardkit ARGV`` in this process (``python benchlib.py --shardkit ARGV``, under torchrun too); at exit its
    own peak RSS in kB (VmHWM) goes to ``$BENCH_RSS_DIR/rank-$RANK``, for the parent to read."""
    import atexit
    import runpy

    path = os.path.join(os.environ["BENCH_RSS_DIR"], "rank-" + os.environ.get("RANK", "0"))
    atexit.register(lambda: open(path, "w").write(str(status_bytes("VmHWM") // 1024)))
    sys.argv = ["shardkit", *argv]
    runpy.run_module("shardkit", run_name="__main__")


def rank_peaks_mb(folder: str) -> list[float]:
    """The peaks that :func:`run_shardkit_recording_peak` left in ``folder``, rank by rank (MB)."""
    names = sorted(n for n in os.listdir(folder) if n.startswith("rank-"))
    return [int(open(os.path.join(folder, n)).read()) / 1024 for n in names]


def rotated(items: list[K], round_index: int) -> list[K]:
    """``items`` starting at ``round_index`` (mod its length): the case order of one round."""
    k = round_index % len(items) if items else 0
    return items[k:] + items[:k]


def rounds(keys: list[K], runs: int, run_one: Callable[[K, int], dict[str, Any] | None], *,
           loads: list[tuple[float, float]] | None = None,
           line: Callable[[dict[str, Any]], str] | None = None) -> dict[K, list[dict[str, Any]]]:
    """``run_one(key, round)`` for every key, ``runs`` rounds, order rotating; its results by key (None: dropped).
    ``loads`` gets the load average (1 min) at the start and end of each round; ``line(result)`` is printed after
    each run, with the round, the key and the load average (a failed run, ``{"error": ...}``, says so instead)."""
    results: dict[K, list[dict[str, Any]]] = {key: [] for key in keys}
    for r in range(runs):
        load = os.getloadavg()[0]
        for key in rotated(keys, r):
            result = run_one(key, r)
            if result is not None:
                results[key].append(result)
            if line is not None:
                shown = line(result) if result and "error" not in result else f"FAILED {(result or {}).get('error')}"
                name = " ".join(map(str, key)) if isinstance(key, tuple) else key
                print(f"  run {r + 1}/{runs} {name}: {shown}, load {os.getloadavg()[0]:.1f}", flush=True)
        if loads is not None:
            loads.append((load, os.getloadavg()[0]))
    return results


def remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def run_interleaved(cases: list[Case], *, runs: int, log: Callable[[str], None] = print,
                    loads: list[tuple[float, float]] | None = None) -> None:
    """Run every shell case ``runs`` times, interleaved, after ``sync``; times and RSS into the cases (the load
    averages of each round into ``loads``)."""
    def one(case: Case, r: int) -> None:
        for path in case.cleanup:
            remove(path)
        subprocess.run(["sync"], check=True)
        usage = measure(case.command)
        case.times.append(usage.seconds)
        case.rss_mb.append(usage.rss_mb)
        case.cpu_s.append(usage.cpu_s)
        log(f"  run {r + 1}/{runs} {case.name}: {usage.seconds:.2f} s, {usage.cpu_s:.2f} CPU-s, "
            f"{usage.rss_mb:.0f} MB peak RSS")

    rounds(cases, runs, one, loads=loads)
    for case in cases:
        for path in case.cleanup:
            remove(path)


def child(script: str, *args: str, env: dict[str, str] | None = None, check: bool = True,
          timeout: float = 1800) -> dict[str, Any]:
    """Run ``python script args...`` and return the last JSON line it printed.

    A failure raises SystemExit with its stderr's tail, or with ``check=False`` gives ``{"error": last line}``.
    """
    done = subprocess.run([sys.executable, script, *args], env={**os.environ, **(env or {})}, capture_output=True,
                          text=True, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode == 0 and lines:
        return dict(json.loads(lines[-1]))
    if check:
        raise SystemExit(f"{' '.join(args[:2])} failed ({done.returncode}): {done.stderr.strip()[-3000:]}")
    return {"error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1][:200]}


def serve_child(children: dict[str, Callable[..., object]]) -> None:
    """In a Python case's own process (``python SCRIPT --child NAME ARGS...``, started by :func:`child`): print what
    ``children[NAME](*ARGS)`` returns as one JSON line (unless None: it printed its own lines), then exit."""
    if len(sys.argv) >= 3 and sys.argv[1] == "--child":
        result = children[sys.argv[2]](*sys.argv[3:])
        if result is not None:
            print(json.dumps(result))
        sys.exit(0)


def status_bytes(name: str) -> int:
    """A field of /proc/self/status in bytes: VmHWM (peak RSS since exec), VmRSS..."""
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(name + ":"))


def peak_rss_mb() -> float:
    """This process's own peak RSS (VmHWM); ru_maxrss would start from the forking parent's peak."""
    return status_bytes("VmHWM") / 2**20


def med(results: list[dict[str, Any]], key: str) -> float | None:
    """The median of ``key`` over the results that have it (failed runs do not); None when none has it."""
    values = [r[key] for r in results if key in r]
    return statistics.median(values) if values else None


@contextlib.contextmanager
def timed(row: dict[str, Any], key: str, nbytes: int = 0) -> Iterator[None]:
    """Time the block into ``row[key]``: its seconds, or the GB/s it moved when given its ``nbytes``."""
    start = time.perf_counter()
    yield
    seconds = time.perf_counter() - start
    row[key] = nbytes / seconds / 1e9 if nbytes else seconds


def pinned_copy_gbps(device: str = "cuda:0") -> float:
    """The PCIe floor: GB/s of a 1 GiB pinned host → ``device`` copy, median of 5 after a warm-up."""
    import torch

    src = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    dst = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    times = []
    for _ in range(6):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return (1 << 30) / statistics.median(times[1:]) / 1e9


# ----------------------------------------------------------------------------- reports

def parser(doc: str | None, *, runs: int | None = 3, work: str | None = None, output: bool = True,
           only: bool = False) -> argparse.ArgumentParser:
    """The options benchmarks share: ``--runs`` (unless None), ``--work``, ``--output`` and ``--only`` where they
    have them."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if runs is not None:
        p.add_argument("--runs", type=int, default=runs, help=f"rounds of every case (default {runs})")
    if work is not None:
        p.add_argument("--work", default=work, help=f"scratch folder (default {work})")
    if output:
        p.add_argument("--output", help="also write the report (markdown) here")
    if only:
        p.add_argument("--only", action="append", default=[], metavar="WORDS",
                       help="only the cases whose label contains WORDS (repeatable)")
    return p


def picked(labels: Iterable[str], only: list[str]) -> list[str]:
    """The labels that contain one of ``only``'s words (all of them when ``only`` is empty)."""
    return [label for label in labels if not only or any(word in label for word in only)]


def report_head(what: str, *, runs: int, loads: list[tuple[float, float]] | None = None,
                notes: Iterable[str] = ()) -> str:
    """The lines above a report's tables: what was measured and how, the machine, the load of each round."""
    lines = [f"{what}; median of {runs} run(s), cases interleaved", f"machine: {machine_line()}"]
    if loads:
        lines.append("load average (1 min) at the start/end of each round: " +
                     ", ".join(f"{a:.1f}/{b:.1f}" for a, b in loads))
    return "\n".join([*lines, *notes, "", ""])


def publish_report(report: str, output: str | None) -> None:
    """Print the report, and write it to ``output`` too when one is given."""
    print("\n" + report)
    if output:
        with open(output, "w", encoding="utf-8") as f:
            f.write(report if report.endswith("\n") else report + "\n")


def machine_line() -> str:
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{platform.machine()}, {os.cpu_count()} cores, {mem_gb:.0f} GiB RAM, Linux {platform.release()}, "
            f"Python {platform.python_version()}")


def filesystem_line(path: str) -> str:
    """The filesystem ``path`` lies on, e.g. ``ext4 on /dev/vda``, for the report."""
    out = subprocess.run(["findmnt", "-n", "-o", "FSTYPE,SOURCE", "-T", path], capture_output=True, text=True)
    fstype, _, source = out.stdout.strip().partition(" ")
    return f"{fstype or 'unknown'} on {source.strip() or '?'}"


def markdown(head: list[str], rows: Iterable[list[str]], *, align: str = "") -> str:
    """A markdown table; ``align`` has one letter a column (l: text, r: numbers), default text then numbers."""
    align = align or "l" + "r" * (len(head) - 1)
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(cells) + " |" for cells in [head, *rows]]
    return "\n".join([lines[0], "|" + "|".join(rule) + "|", *lines[1:]])


def table(cases: list[Case], *, floor: str = "", also: str | None = None) -> str:
    """The medians of shell cases against their floor (default the first case); ``also`` adds a column of ratios
    to a second case."""
    floor = floor or cases[0].name
    medians = {c.name: statistics.median(c.times) for c in cases}
    head = ["case", "median s", "× floor", *([f"× {also}"] if also else []), "peak RSS MB", "target"]
    rows = [[c.name, f"{medians[c.name]:.2f}", f"{medians[c.name] / medians[c.floor or floor]:.2f}×",
             *([f"{medians[c.name] / medians[also]:.3f}×"] if also else []), f"{max(c.rss_mb):.0f}", c.target]
            for c in cases]
    return markdown(head, rows, align="l" + "r" * (len(head) - 2) + "l")


def shell_bench(title: str, tables: dict[str, list[Case]], *, runs: int, output: str | None, note: str = "",
                also: str | None = None) -> None:
    """Every table's shell cases run interleaved in one pool of rounds; the report gives each table (named unless
    its name is empty) against its floor, its first case unless a case names its own."""
    loads: list[tuple[float, float]] = []
    run_interleaved([case for cases in tables.values() for case in cases], runs=runs, loads=loads)
    head = report_head(f"{title}; each write followed by sync", runs=runs, loads=loads, notes=[note] if note else [])
    body = [(f"{name}:\n" if name else "") + table(cases, also=also) for name, cases in tables.items()]
    publish_report(head + "\n\n".join(body) + "\n", output)


# ----------------------------------------------------------------------------- page cache, mounts

def tree_bytes(path: str) -> int:
    """The bytes of the file ``path``, or of every regular file under the folder ``path`` (links not followed)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(p) for d, _, names in os.walk(path) for n in names
               if not os.path.islink(p := os.path.join(d, n)))


def shard_files(folder: str) -> list[str]:
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors"))


def evict(path: str) -> float:
    """Drop ``path``'s pages from the page cache (fsync + POSIX_FADV_DONTNEED); the share still cached (mincore)."""
    from shardkit.reading.residency import evict as evict_file

    return evict_file(path) or 0.0


def set_cache(files: list[str], *, cold: bool) -> float:
    """Evict every file (cold) or read it once (warm); the smallest fraction resident afterwards (mincore)."""
    from shardkit.reading.residency import cached_fraction

    for path in files:
        if cold:
            evict(path)
        else:
            subprocess.run(["cat", path], stdout=subprocess.DEVNULL, check=True)
    return min((cached_fraction(path) or 0.0 for path in files), default=0.0)


def apt_install(command: str, package: str) -> None:
    """Install ``package`` with apt-get when ``command`` is missing (needs root)."""
    if shutil.which(command):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.run(["apt-get", "install", "-y", "-q", package], env=env).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, check=True)
        subprocess.run(["apt-get", "install", "-y", "-q", package], env=env, check=True)


MKFS = {"xfs": (["mkfs.xfs", "-q", "-f", "-m", "reflink=1"], "xfsprogs"),
        "btrfs": (["mkfs.btrfs", "-q", "-f"], "btrfs-progs")}


@contextlib.contextmanager
def loop_mount(fs: str, image: str, size_bytes: int) -> Iterator[str]:
    """A fresh ``fs`` filesystem in a sparse ``image`` file, loop-mounted beside it; unmounted after.

    The image is made anew each time (a stale one could hold another run's files).
    """
    command, package = MKFS[fs]
    apt_install(command[0], package)
    mount = image + ".mnt"
    if os.path.ismount(mount):
        subprocess.run(["umount", mount], check=True)
    with open(image, "wb") as f:
        f.truncate(size_bytes)
    os.makedirs(mount, exist_ok=True)
    subprocess.run([*command, image], check=True)
    subprocess.run(["mount", "-o", "loop", image, mount], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", mount], check=False)
        os.unlink(image)


@contextlib.contextmanager
def bindfs_mount(folder: str) -> Iterator[str]:
    """A bindfs (FUSE passthrough) mount of ``folder`` beside it; bindfs installed with apt-get if missing."""
    apt_install("bindfs", "bindfs")
    mount = folder.rstrip("/") + ".fuse"
    os.makedirs(mount, exist_ok=True)
    if not os.path.ismount(mount):
        subprocess.run(["bindfs", "--no-allow-other", folder, mount], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["fusermount", "-u", mount], check=False)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--run":
    _run_and_report(sys.argv[2])
elif __name__ == "__main__" and len(sys.argv) >= 2 and sys.argv[1] == "--shardkit":
    run_shardkit_recording_peak(sys.argv[2:])
