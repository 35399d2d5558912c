#!/usr/bin/env python3
"""Loading through mounts: at the latency limit (issue 22), through FUSE (issue 34), each read backend (issue 13).

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
read, as a local FUSE or container volume over a local disk sees it), beside the local disk;
``--latency-ms 0`` is the latency mount adding nothing (a Python FUSE server).

``scripts/bench_load.py --read-backends`` runs the read-backend matrix (issue 13): an SD 1.5 UNet in
fp16 (~1.7 GB, one file), on the local disk and on a bindfs mount of the same folder, page cache
cold (evicted with POSIX_FADV_DONTNEED, checked with mincore) and warm; floor ``dd bs=16M``; cases
safetensors ``load_file`` (mmap and pread), accelerate, diffusers and ``shardkit.load_model`` with
each ``read=`` backend, every page of every weight touched, timed inside the fresh child process.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
from shlex import quote
from typing import Any

from bench_load import load, outside
from benchlib import (
    bindfs_mount,
    evict,
    filesystem_line,
    machine_line,
    markdown,
    med,
    median_of,
    rounds,
    set_cache,
    shard_files,
)
from build_checkpoint import sharded_unet, unet_source

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
DD = "dd bs=16M (cold)"


def run_case(label: str, folder: str) -> dict[str, Any]:
    """One case in a fresh process; its time ``s`` is the load with every page touched (imports excluded)."""
    if label == DD:
        return {"s": outside(" && ".join(f"dd if={quote(p)} of=/dev/null bs=16M" for p in shard_files(folder)))["load_s"]}
    name, options = CASES[label]
    result = load(name, folder, {**options, "touch": "pages"}, check=False)
    return {**result, "s": result["touch_s"]} if "error" not in result else result


def run_cases(folder: str, runs: int, cases: list[str], prepare: Any, note: Any = dict) -> Runs:
    """Every case ``runs`` times on ``folder``, interleaved; ``prepare()`` before each, ``note(result)`` after."""
    def one(label: str, r: int) -> dict[str, Any]:
        prepare()
        result = run_case(label, folder)
        note(result)
        print(f"  {os.path.basename(folder)} run {r + 1}/{runs} {label}: {result.get('s', result.get('error'))} "
              f"{result.get('requests', '')}, load average {os.getloadavg()[0]:.1f}", flush=True)
        return result

    return rounds(cases, runs, one)


def run_latency(folder: str, latency_ms: float, runs: int, cases: list[str]) -> Runs:
    """Through a latency mount at ``latency_ms`` (requests and peak in flight counted); backing files warm."""
    from latency_mount import LatencyMount

    with LatencyMount(folder, folder + f"-mnt-{latency_ms}", latency_ms=latency_ms) as mount:
        results = run_cases(mount.mountpoint, runs, cases,
                            prepare=lambda: (set_cache(shard_files(folder), cold=False), mount.reset()),
                            note=lambda result: result.update({k: v for k, v in mount.stats().items() if k != "files"}))
        results["_limit"] = [{"bytes_per_s": mount.limit_bytes_per_s() if latency_ms else float("inf")}]
    return results


def run_bindfs(folder: str, runs: int, cases: list[str]) -> Runs:
    """Through a bindfs mount of ``folder`` (FUSE passthrough, no latency), backing files evicted."""
    with bindfs_mount(folder) as mnt:
        return run_cases(mnt, runs, cases, prepare=lambda: set_cache(shard_files(folder), cold=True))


def run_local_cold(folder: str, runs: int) -> Runs:
    return run_cases(folder, runs, [DD, *LOCAL_CASES], prepare=lambda: set_cache(shard_files(folder), cold=True))


def _cpu(runs: list[dict[str, Any]]) -> str:
    """The case's median CPU seconds (every thread of its process; the mount server's not included)."""
    cpu = median_of(runs, "cpu_s")
    return "–" if cpu is None else f"{cpu:.2f}"


def _failed(runs: list[dict[str, Any]]) -> str:
    return f"failed: {runs[0].get('error', '')[:60]}" if runs else "failed"


def bindfs_table(results: Runs, nbytes: int) -> str:
    base = median_of(results.get("safetensors load_file (per shard)", []), "s") or 0.0
    rows = []
    for label, runs in results.items():
        t = median_of(runs, "s")
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
            t = median_of(runs, "s")
            cells.append(f"{t:.2f} ({nbytes / t / 1e9:.2f}), {statistics.median(r['requests'] for r in runs):.0f}, "
                         f"{max(r['peak_in_flight'] for r in runs)}, {_cpu(runs)}" if t else _failed(runs))
        rows.append([label, *cells])
    for request_bytes, how in ((128 << 10, "128 KiB (page-cache reads)"), (1 << 20, "1 MiB (O_DIRECT reads)")):
        limits = [by_latency[x]["_limit"][0]["bytes_per_s"] * request_bytes / (128 << 10) for x in lat]
        rows.append([f"mount limit: 16 in flight × {how} ÷ latency",
                     *(f"{nbytes / limit:.2f} ({limit * 1e-9:.2f})" if limit != float("inf") else "none" for limit in limits)])
    text = markdown(["reader", *(f"{x:g} ms: s (GB/s), requests, peak in flight, CPU s" for x in lat)], rows)
    if local:
        dd = median_of(local[DD], "s") or 0.0
        rows = [[label, f"{t:.2f} ({nbytes / t / 1e9:.2f})", f"{dd / t:.2f}×"] if (t := median_of(runs, "s")) else
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


READ_CASES = [  # (label, loader, options)
    ("safetensors load_file (mmap)", "floor", {}),
    ("safetensors load_file(backend='pread')", "floor", {"backend": "pread"}),
    ("accelerate load_checkpoint_and_dispatch", "accelerate", {}),
    ("diffusers from_pretrained", "diffusers", {}),
    *[(f"shardkit.load_model read={r}", "shardkit", {"read": r}) for r in ("mmap", "pread", "direct", "auto")],
]


def main_read(args: Any) -> int:
    """``--read-backends``: the SD 1.5 UNet fp16 (one file) on the local disk and a bindfs mount, cold and warm."""

    os.makedirs(args.work, exist_ok=True)
    weights = unet_source("tiny" if args.tiny else "sd15", args.work, dtype="F16")
    folder, nbytes = os.path.dirname(weights), os.path.getsize(weights)
    cases = [(label, name, opts) for label, name, opts in READ_CASES
             if not args.only or any(word in label for word in args.only)]
    with bindfs_mount(folder) as mount:
        print(f"SD 1.5 UNet fp16: {nbytes / 1e9:.2f} GB in {folder} ({filesystem_line(folder)}), FUSE: {mount}; "
              f"{machine_line()}", flush=True)
        specs = {label: (name, opts) for label, name, opts in [("dd bs=16M (floor)", "dd", {}), *cases]}

        def one(cell: tuple[str, str, str], r: int) -> dict[str, Any]:
            label, where, cache = cell  # cold runs evict first (and check)
            (name, opts), root = specs[label], folder if where == "local" else mount
            path = os.path.join(root, os.path.basename(weights))
            left = max(evict(weights), evict(path)) if cache == "cold" else set_cache([path], cold=False)
            result = outside(f"dd if={path} of=/dev/null bs=16M") if name == "dd" else \
                load(name, root, {**opts, "touch": "pages"})
            print(f"  run {r + 1}/{args.runs} {cache} {where} {label}: {result['touch_s']:.2f} s "
                  f"(cached before: {left:.0%}), peak {(result['hwm'] - result['base']) / 2**20:.0f} MB", flush=True)
            return result

        results = rounds([(label, where, cache) for cache in ("cold", "warm") for where in ("local", "fuse")
                          for label in specs], args.runs, one)
    cols = [("local", "cold"), ("local", "warm"), ("fuse", "cold"), ("fuse", "warm")]
    rows = []
    for label in dict.fromkeys(label for label, _, _ in results):
        cells = []
        for where, cache in cols:
            t, dd = med(results[(label, where, cache)], "touch_s"), med(results[("dd bs=16M (floor)", where, "cold")], "touch_s")
            cells.append(f"{t:.2f} ({nbytes / t / 1e9:.2f}, {dd / t:.2f}×)")
        rss = max(r["hwm"] - r["base"] for (lb, _, _), v in results.items() if lb == label for r in v)
        rows.append([label, *cells, f"{rss / 2**20:.0f}"])
    print(f"\nSD 1.5 UNet fp16, {nbytes / 1e9:.2f} GB, one file; load + touch every page of every weight, "
          f"median of {args.runs} interleaved runs in fresh processes, imports excluded; {machine_line()}:\n")
    print(markdown(["case", *(f"{w} {c} s (GB/s, × dd cold)" for w, c in cols), "peak RSS above imports MB"], rows))
    if not args.keep:
        shutil.rmtree(args.work, ignore_errors=True)
    return 0
