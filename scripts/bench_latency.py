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

import argparse
import os
import shutil
import statistics
import subprocess
import time
from typing import Any

from bench_load import load
from benchlib import evict, filesystem_line, machine_line, markdown, rotated, set_cache, shard_files
from build_checkpoint import sharded_unet

CASES = {  # label: (bench_load loader, options); every case touches one byte of every page of every weight
    "floor: 16 threads × 4 MiB O_DIRECT reads, no tensors": ("odirect", {}),
    "safetensors load_file (per shard)": ("floor", {}),
    "fastsafetensors (nogds, cpu)": ("fastsafetensors", {}),
    "diffusers from_pretrained": ("diffusers", {}),
    "shardkit.open, ck[k] for every key": ("open", {}),
    # read="direct": what ``auto`` chose on every FUSE/network mount before issue 34
    "shardkit.open(read='direct'), ck[k] for every key": ("open", {"read": "direct"}),
    # read="mmap": zero-copy views of private maps, as safetensors gives, no read-ahead of shardkit's
    "shardkit.open(read='mmap'), ck[k] for every key": ("open", {"read": "mmap"}),
    "shardkit to_state_dict": ("state_dict", {}),
    "shardkit.load_model(device_map='cpu')": ("shardkit", {}),
}
LOCAL_CASES = ["shardkit.open, ck[k] for every key", "shardkit.load_model(device_map='cpu')"]
Runs = dict[str, list[dict[str, Any]]]


def run_case(label: str, folder: str) -> dict[str, Any]:
    """One case in a fresh process; its time ``s`` is the load with every page touched (imports excluded)."""
    name, options = CASES[label]
    result = load(name, folder, {**options, "touch": "pages"}, check=False)
    return {**result, "s": result["touch_s"]} if "error" not in result else result


def run_mounted(folder: str, mnt: str, runs: int, cases: list[str], prepare: Any, note: Any) -> Runs:
    """Every case ``runs`` times through ``mnt``, interleaved; ``prepare()`` before each, ``note(result)`` after."""
    results: Runs = {c: [] for c in cases}
    for r in range(runs):
        for label in rotated(cases, r):
            prepare()
            result = run_case(label, mnt)
            note(result)
            results[label].append(result)
            print(f"  {os.path.basename(mnt)} run {r + 1}/{runs} {label}: {result.get('s', result.get('error'))} "
                  f"{result.get('requests', '')}, load average {os.getloadavg()[0]:.1f}", flush=True)
    return results


def run_latency(folder: str, latency_ms: float, runs: int, cases: list[str]) -> Runs:
    """Through a latency mount at ``latency_ms`` (requests and peak in flight counted); backing files warm."""
    from latency_mount import LatencyMount

    with LatencyMount(folder, folder + f"-mnt-{latency_ms}", latency_ms=latency_ms) as mount:
        results = run_mounted(folder, mount.mountpoint, runs, cases,
                              prepare=lambda: (set_cache(shard_files(folder), cold=False), mount.reset()),
                              note=lambda result: result.update({k: v for k, v in mount.stats().items() if k != "files"}))
        results["_limit"] = [{"bytes_per_s": mount.limit_bytes_per_s() if latency_ms else float("inf")}]
    return results


def run_bindfs(folder: str, runs: int, cases: list[str]) -> Runs:
    """Through a bindfs mount of ``folder`` (FUSE passthrough, no latency), backing files evicted."""
    from benchlib import bindfs_mount

    with bindfs_mount(folder) as mnt:
        return run_mounted(folder, mnt, runs, cases, prepare=lambda: [evict(p) for p in shard_files(folder)],
                           note=lambda result: None)


def run_local_cold(folder: str, runs: int) -> Runs:
    results: Runs = {"dd bs=16M (cold)": [], **{c: [] for c in LOCAL_CASES}}
    for _ in range(runs):
        for path in shard_files(folder):
            evict(path)
        start = time.perf_counter()
        for path in shard_files(folder):
            subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M"], capture_output=True, check=True)
        results["dd bs=16M (cold)"].append({"s": time.perf_counter() - start})
        for label in LOCAL_CASES:
            for path in shard_files(folder):
                evict(path)
            results[label].append(run_case(label, folder))
            print(f"  local cold {label}: {results[label][-1].get('s')}", flush=True)
    return results


def _cpu(runs: list[dict[str, Any]]) -> str:
    """The case's median CPU seconds (every thread of its process; the mount server's not included)."""
    cpu = [r["cpu_s"] for r in runs if "cpu_s" in r]
    return f"{statistics.median(cpu):.2f}" if cpu else "–"


def _median(runs: list[dict[str, Any]]) -> float | None:
    times = [r["s"] for r in runs if "s" in r]
    return statistics.median(times) if times else None


def _failed(runs: list[dict[str, Any]]) -> str:
    return f"failed: {runs[0].get('error', '')[:60]}" if runs else "failed"


def bindfs_table(results: Runs, nbytes: int) -> str:
    base = _median(results.get("safetensors load_file (per shard)", [])) or 0.0
    rows = []
    for label, runs in results.items():
        t = _median(runs)
        each = ", ".join(f"{r['s']:.2f}" for r in runs if "s" in r)
        rows.append([label, f"{t:.2f} ({nbytes / t / 1e9:.2f})", f"{base / t:.2f}×", _cpu(runs), each] if t else
                    [label, _failed(runs), "", "", ""])
    return markdown(["bindfs (no latency), backing evicted", "s (GB/s)", "× safetensors", "CPU s", "runs s"], rows,
                    align="lrrrl")


def table(by_latency: dict[float, Runs], local: Runs, nbytes: int) -> str:
    lat = sorted(by_latency)
    rows = []
    for label in [k for k in by_latency[lat[0]] if not k.startswith("_")]:
        cells = []
        for x in lat:
            runs = by_latency[x][label]
            t = _median(runs)
            cells.append(f"{t:.2f} ({nbytes / t / 1e9:.2f}), {statistics.median(r['requests'] for r in runs):.0f}, "
                         f"{max(r['peak_in_flight'] for r in runs)}, {_cpu(runs)}" if t else _failed(runs))
        rows.append([label, *cells])
    for request_bytes, how in ((128 << 10, "128 KiB (page-cache reads)"), (1 << 20, "1 MiB (O_DIRECT reads)")):
        limits = [by_latency[x]["_limit"][0]["bytes_per_s"] * request_bytes / (128 << 10) for x in lat]
        rows.append([f"mount limit: 16 in flight × {how} ÷ latency",
                     *(f"{nbytes / limit:.2f} ({limit * 1e-9:.2f})" if limit != float("inf") else "none" for limit in limits)])
    text = markdown(["reader", *(f"{x:g} ms: s (GB/s), requests, peak in flight, CPU s" for x in lat)], rows)
    if local:
        dd = _median(local["dd bs=16M (cold)"]) or 0.0
        rows = [[label, f"{t:.2f} ({nbytes / t / 1e9:.2f})", f"{dd / t:.2f}×"] if (t := _median(runs)) else
                [label, "failed", ""] for label, runs in local.items()]
        text += "\n\n" + markdown(["local disk, page cache evicted", "s (GB/s)", "× dd"], rows)
    return text


def main_latency(args: argparse.Namespace) -> int:
    """``bench_load.py --latency-ms MS... [--bindfs] [--no-local]``: the UNet in fp16, 4 shards."""
    from latency_mount import fuse_unavailable

    reason = fuse_unavailable()
    if reason:
        raise SystemExit(f"cannot run the latency benchmark: {reason}")
    os.makedirs(args.work, exist_ok=True)
    folder, nbytes = sharded_unet(args.latency_model, args.work, dtype="F16", shards=4)
    cases = [c for c in CASES if not args.only or any(word in c for word in args.only)]
    try:
        import fastsafetensors  # noqa: F401
    except ImportError:
        cases = [c for c in cases if not c.startswith("fastsafetensors")]
        print("fastsafetensors is not installed (pip install fastsafetensors): its row is left out")
    what = f"{args.latency_model} UNet fp16, {nbytes / 1e9:.2f} GB, {len(shard_files(folder))} shards"
    print(f"{what}, {folder} ({filesystem_line(folder)}); {machine_line()}", flush=True)
    before = os.getloadavg()
    by_latency = {x: run_latency(folder, x, args.runs, cases) for x in args.latency_ms}
    passthrough = run_bindfs(folder, args.runs, [c for c in cases if not c.startswith("floor")]) if args.bindfs else {}
    cold = run_local_cold(folder, args.runs) if not args.no_local else {}
    after = os.getloadavg()
    print("\nload average (1, 5, 15 min) before: " + ", ".join(f"{x:.1f}" for x in before)
          + "; after: " + ", ".join(f"{x:.1f}" for x in after))
    print(f"{what}; load + touch every page of every weight, median of {args.runs} runs in fresh processes, "
          f"imports excluded; {machine_line()}:\n")
    if by_latency:
        print(table(by_latency, cold, nbytes))
    if passthrough:
        print("\n" + bindfs_table(passthrough, nbytes))
    if not args.keep:
        shutil.rmtree(args.work, ignore_errors=True)
    return 0
