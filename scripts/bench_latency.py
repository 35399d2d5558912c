#!/usr/bin/env python3
"""Loading at the latency limit (issue 22): readers through a FUSE mount that costs a round trip per request.

``scripts/bench_load.py --latency-ms 2 [0.5 5]`` runs this. The SD 1.5 UNet in fp16 (~1.7 GB, 4
shards; ``--latency-model tiny`` for a ~0.2 GB stand-in) is served by
:mod:`latency_mount` (``latency_ms`` slept in every read request, 16 requests served at once,
backing files kept in the page cache, the mount's own page cache dropped at each open: every
fresh process reads cold through it). Cases, each in a fresh process, timed after imports, every
weight's pages touched: safetensors ``load_file`` per shard, fastsafetensors on CPU (when
installed: a benchmark-only dependency), diffusers ``from_pretrained``, ``shardkit.open`` then
``ck[k]`` for every key in order, ``to_state_dict`` and ``load_model``; plus, on the local disk
with the page cache evicted, ``dd bs=16M`` and shardkit's two paths. The mount's limit is
requests in flight × request size ÷ latency; each row also gives the requests the mount saw and
the peak in flight. Median of ``--runs``.

``--bindfs`` adds the zero-latency FUSE case (issue 34): the same cases through a bindfs
(FUSE passthrough, C) mount of the same folder, backing files evicted before each run (a cold
read, as a local FUSE or container volume over a local disk sees it), beside the local disk.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


# ------------------------------------------------------------------------- cases (child side)

def _shards(folder: str) -> list[str]:
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors"))


def _touch(tensors) -> None:
    import torch

    for t in tensors:
        if t.numel():
            t.reshape(-1).view(torch.uint8)[::4096].sum().item()


def case_floor(folder: str) -> None:
    """The mount's practical ceiling here: 16 threads of 4 MiB O_DIRECT reads into reused buffers,
    no tensors (requests as large as the mount takes, nothing done with the bytes)."""
    import mmap
    import threading
    from concurrent.futures import ThreadPoolExecutor

    chunk = 4 << 20
    fds = {p: os.open(p, os.O_RDONLY | os.O_DIRECT) for p in _shards(folder)}
    local = threading.local()

    def read(job: tuple[str, int]) -> None:
        if not hasattr(local, "buf"):
            local.buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs; one per thread
        os.preadv(fds[job[0]], [local.buf], job[1])

    jobs = [(p, off) for p in fds for off in range(0, os.path.getsize(p), chunk)]
    try:
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(read, jobs))
    finally:
        for fd in fds.values():
            os.close(fd)


def case_safetensors(folder: str) -> None:
    from safetensors.torch import load_file

    for path in _shards(folder):
        _touch(load_file(path).values())


def case_fastsafetensors(folder: str) -> None:
    from fastsafetensors import fastsafe_open

    with fastsafe_open(filenames=_shards(folder), nogds=True, device="cpu") as f:
        _touch(f.get_tensor(k) for k in f.keys())


def case_diffusers(folder: str) -> None:
    from diffusers import UNet2DConditionModel

    _touch(UNet2DConditionModel.from_pretrained(folder).state_dict().values())


def case_lazy(folder: str) -> None:
    import shardkit

    with shardkit.open(folder) as ckpt:
        _touch(ckpt[k] for k in ckpt)


def case_lazy_direct(folder: str) -> None:
    """``read="direct"``: what ``auto`` chose on every FUSE/network mount before issue 34."""
    import shardkit

    with shardkit.open(folder, read="direct") as ckpt:
        _touch(ckpt[k] for k in ckpt)


def case_lazy_mmap(folder: str) -> None:
    """``read="mmap"``: zero-copy views of private maps, as safetensors gives, no read-ahead of shardkit's."""
    import shardkit

    with shardkit.open(folder, read="mmap") as ckpt:
        _touch(ckpt[k] for k in ckpt)


def case_state_dict(folder: str) -> None:
    import shardkit

    with shardkit.open(folder) as ckpt:
        _touch(ckpt.to_state_dict().values())


def case_load_model(folder: str) -> None:
    from diffusers import UNet2DConditionModel

    import shardkit

    model = shardkit.load_model(UNet2DConditionModel, folder, config=folder, device_map="cpu")
    _touch(model.state_dict().values())


CASES = {
    "floor: 16 threads × 4 MiB O_DIRECT reads, no tensors": case_floor,
    "safetensors load_file (per shard)": case_safetensors,
    "fastsafetensors (nogds, cpu)": case_fastsafetensors,
    "diffusers from_pretrained": case_diffusers,
    "shardkit.open, ck[k] for every key": case_lazy,
    "shardkit.open(read='direct'), ck[k] for every key": case_lazy_direct,
    "shardkit.open(read='mmap'), ck[k] for every key": case_lazy_mmap,
    "shardkit to_state_dict": case_state_dict,
    "shardkit.load_model(device_map='cpu')": case_load_model,
}
LOCAL_CASES = ["shardkit.open, ck[k] for every key", "shardkit.load_model(device_map='cpu')"]


def run_child(label: str, folder: str) -> None:
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401  (imports are not part of the time)
    from diffusers import UNet2DConditionModel  # noqa: F401

    import shardkit.loading.load  # noqa: F401

    cpu = time.process_time()  # every thread's CPU: on a shared machine it moves less than the wall time
    start = time.perf_counter()
    CASES[label](folder)
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    print(json.dumps({"s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu, "hwm": hwm}))


# ------------------------------------------------------------------------- parent side

def prepare(work: str, model: str) -> tuple[str, int]:
    """The UNet in fp16, 4 shards (diffusers naming), built once."""
    from bench_load import prepare as build

    folder, _ = build(model, work, dtype="F16", shards=4)
    return folder, sum(os.path.getsize(p) for p in _shards(folder))


def _child(label: str, folder: str) -> dict:
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--case", label, folder],
                          capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])


def _evict(folder: str) -> None:
    sys.path.insert(0, os.path.dirname(HERE))
    from shardkit.reading.residency import evict

    for path in _shards(folder):
        evict(path)


def _warm(folder: str) -> None:
    for path in _shards(folder):
        subprocess.run(["cat", path], stdout=subprocess.DEVNULL, check=True)


def run_latency(folder: str, latency_ms: float, runs: int, cases: list[str]) -> dict[str, list[dict]]:
    """Every case ``runs`` times through a mount at ``latency_ms``, interleaved; backing files warm."""
    from latency_mount import LatencyMount

    mnt = folder + f"-mnt-{latency_ms}"
    results: dict[str, list[dict]] = {c: [] for c in cases}
    with LatencyMount(folder, mnt, latency_ms=latency_ms) as mount:
        results["_limit"] = [{"bytes_per_s": mount.limit_bytes_per_s() if latency_ms else float("inf")}]
        for r in range(runs):
            for label in cases[r % len(cases):] + cases[: r % len(cases)]:
                _warm(folder)
                mount.reset()
                result = _child(label, mnt)
                result.update({k: v for k, v in mount.stats().items() if k != "files"})
                results[label].append(result)
                print(f"  {latency_ms} ms run {r + 1}/{runs} {label}: {result.get('s', result.get('error'))} "
                      f"requests {result['requests']}, peak in flight {result['peak_in_flight']}, "
                      f"load average {os.getloadavg()[0]:.1f}", flush=True)
    return results


def run_local_cold(folder: str, runs: int) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {"dd bs=16M (cold)": [], **{c: [] for c in LOCAL_CASES}}
    for _ in range(runs):
        _evict(folder)
        start = time.perf_counter()
        for path in _shards(folder):
            subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M"], capture_output=True, check=True)
        results["dd bs=16M (cold)"].append({"s": time.perf_counter() - start})
        for label in LOCAL_CASES:
            _evict(folder)
            results[label].append(_child(label, folder))
            print(f"  local cold {label}: {results[label][-1].get('s')}", flush=True)
    return results


def run_bindfs(folder: str, runs: int, cases: list[str]) -> dict[str, list[dict]]:
    """Every case ``runs`` times through a bindfs mount of ``folder``, interleaved, backing files evicted."""
    from benchlib import bindfs_mount

    results: dict[str, list[dict]] = {c: [] for c in cases}
    with bindfs_mount(folder) as mnt:
        for r in range(runs):
            for label in cases[r % len(cases):] + cases[: r % len(cases)]:
                _evict(folder)
                result = _child(label, mnt)
                results[label].append(result)
                print(f"  bindfs cold run {r + 1}/{runs} {label}: {result.get('s', result.get('error'))}, "
                      f"load average {os.getloadavg()[0]:.1f}", flush=True)
    return results


def bindfs_table(results: dict[str, list[dict]], nbytes: int) -> str:
    base = _median(results.get("safetensors load_file (per shard)", [])) or 0.0
    lines = ["| bindfs (no latency), backing evicted | s (GB/s) | × safetensors | CPU s | runs s |", "|---|---:|---:|---:|---|"]
    for label, runs in results.items():
        t = _median(runs)
        each = ", ".join(f"{r['s']:.2f}" for r in runs if "s" in r)
        lines.append(f"| {label} | {t:.2f} ({nbytes / t / 1e9:.2f}) | {base / t:.2f}× | {_cpu(runs)} | {each} |" if t else
                     f"| {label} | failed: {runs[0].get('error', '')[:60]} | | | |")
    return "\n".join(lines)


def _cpu(runs: list[dict]) -> str:
    """The case's median CPU seconds (every thread of its process; the mount server's not included)."""
    cpu = [r["cpu_s"] for r in runs if "cpu_s" in r]
    return f"{statistics.median(cpu):.2f}" if cpu else "–"


def _median(runs: list[dict]) -> float | None:
    times = [r["s"] for r in runs if "s" in r]
    return statistics.median(times) if times else None


def table(by_latency: dict[float, dict[str, list[dict]]], local: dict[str, list[dict]], nbytes: int) -> str:
    lat = sorted(by_latency)
    head = " | ".join(f"{x:g} ms: s (GB/s), requests, peak in flight, CPU s" for x in lat)
    lines = [f"| reader | {head} |", "|---|" + "---:|" * len(lat)]
    labels = [k for k in next(iter(by_latency.values())) if not k.startswith("_")]
    for label in labels:
        cells = []
        for x in lat:
            runs = by_latency[x][label]
            t = _median(runs)
            if t is None:
                cells.append(f"failed: {runs[0].get('error', '')[:60]}")
                continue
            req = statistics.median(r["requests"] for r in runs)
            peak = max(r["peak_in_flight"] for r in runs)
            cells.append(f"{t:.2f} ({nbytes / t / 1e9:.2f}), {req:.0f}, {peak}, {_cpu(runs)}")
        lines.append(f"| {label} | {' | '.join(cells)} |")
    for request_bytes, how in ((128 << 10, "128 KiB (page-cache reads)"), (1 << 20, "1 MiB (O_DIRECT reads)")):
        limits = [by_latency[x]["_limit"][0]["bytes_per_s"] * request_bytes / (128 << 10) for x in lat]
        cells = " | ".join(f"{nbytes / limit:.2f} ({limit * 1e-9:.2f})" if limit != float("inf") else "none"
                           for limit in limits)
        lines.append(f"| mount limit: 16 in flight × {how} ÷ latency | {cells} |")
    if local:
        dd = _median(local["dd bs=16M (cold)"]) or 0.0
        lines += ["", "| local disk, page cache evicted | s (GB/s) | × dd |", "|---|---:|---:|"]
        for label, runs in local.items():
            t = _median(runs)
            lines.append(f"| {label} | {t:.2f} ({nbytes / t / 1e9:.2f}) | {dd / t:.2f}× |" if t else f"| {label} | failed | |")
    return "\n".join(lines)


def main_latency(latencies: list[float], *, runs: int, work: str, model: str, keep: bool, local: bool,
                 only: list[str] | None = None, bindfs: bool = False) -> int:
    sys.path.insert(0, HERE)
    from benchlib import filesystem_line, machine_line
    from latency_mount import fuse_unavailable

    reason = fuse_unavailable()
    if reason:
        raise SystemExit(f"cannot run the latency benchmark: {reason}")
    os.makedirs(work, exist_ok=True)
    folder, nbytes = prepare(work, model)
    cases = [c for c in CASES if not only or any(word in c for word in only)]
    try:
        import fastsafetensors  # noqa: F401
    except ImportError:
        cases = [c for c in cases if not c.startswith("fastsafetensors")]
        print("fastsafetensors is not installed (pip install fastsafetensors): its row is left out")
    print(f"{model} UNet fp16: {nbytes / 1e9:.2f} GB in {len(_shards(folder))} shards, {folder} "
          f"({filesystem_line(folder)}); {machine_line()}", flush=True)
    before = os.getloadavg()
    by_latency = {x: run_latency(folder, x, runs, cases) for x in latencies}
    passthrough = run_bindfs(folder, runs, [c for c in cases if not c.startswith("floor")]) if bindfs else {}
    cold = run_local_cold(folder, runs) if local else {}
    after = os.getloadavg()
    print()
    print("load average (1, 5, 15 min) before: " + ", ".join(f"{x:.1f}" for x in before)
          + "; after: " + ", ".join(f"{x:.1f}" for x in after))
    print(f"{model} UNet fp16, {nbytes / 1e9:.2f} GB, {len(_shards(folder))} shards; load + touch every page of "
          f"every weight, median of {runs} runs in fresh processes, imports excluded; {machine_line()}:")
    print()
    if by_latency:
        print(table(by_latency, cold, nbytes))
    if passthrough:
        print()
        print(bindfs_table(passthrough, nbytes))
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "--case":
        sys.path.insert(0, os.path.dirname(HERE))
        run_child(sys.argv[2], sys.argv[3])
