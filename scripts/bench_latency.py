#!/usr/bin/env python3
"""Loading through mounts: at the latency limit (issue 22), through FUSE (issue 34), each read backend (issue 13);
``scripts/bench_load.py --latency-ms``, ``--bindfs`` and ``--read-backends`` run it.
Method: docs/benchmarks.md, "How each benchmark measures".
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from collections.abc import Callable
from shlex import quote
from typing import Any

import benchlib
from bench_load import load, outside
from benchlib import markdown, med, set_cache, shard_files
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
READ_CASES = {  # label: (bench_load loader, options)
    "dd bs=16M (floor)": ("dd", {}),
    "safetensors load_file (mmap)": ("floor", {}),
    "safetensors load_file(backend='pread')": ("floor", {"backend": "pread"}),
    "accelerate load_checkpoint_and_dispatch": ("accelerate", {}),
    "diffusers from_pretrained": ("diffusers", {}),
    **{f"shardkit.load_model read={r}": ("shardkit", {"read": r}) for r in ("mmap", "pread", "direct", "auto")},
}
Runs = dict[str, list[dict[str, Any]]]
DD = "dd bs=16M (cold)"


def run_case(name: str, options: dict[str, Any], folder: str) -> dict[str, Any]:
    """One case in a fresh process; its time ``s`` is the load with every page touched (imports excluded)."""
    if name == "dd":
        return {"s": outside(" && ".join(f"dd if={quote(p)} of=/dev/null bs=16M" for p in shard_files(folder)))["load_s"]}
    result = load(name, folder, {**options, "touch": "pages"}, check=False)
    return {**result, "s": result["touch_s"]} if "error" not in result else result


def run_cases(folder: str, runs: int, cases: list[str], prepare: Callable[[], object],
              note: Callable[[dict[str, Any]], object] = dict) -> Runs:
    """Every case ``runs`` times on ``folder``, interleaved; ``prepare()`` before each, ``note(result)`` after."""
    def one(label: str, r: int) -> dict[str, Any]:
        prepare()
        result = run_case(*CASES.get(label, ("dd", {})), folder)  # DD: dd of every shard
        note(result)
        return result

    return benchlib.rounds(cases, runs, one, line=lambda d: f"{os.path.basename(folder)}: {d['s']:.2f} s "
                                                            f"{d.get('requests', '')}")


def run_latency(folder: str, latency_ms: float, runs: int, cases: list[str]) -> Runs:
    """Through a latency mount at ``latency_ms`` (requests and peak in flight counted); backing files warm."""
    from latency_mount import LatencyMount

    with LatencyMount(folder, folder + f"-mnt-{latency_ms}", latency_ms=latency_ms) as mount:
        results = run_cases(mount.mountpoint, runs, cases,
                            prepare=lambda: (set_cache(shard_files(folder), cold=False), mount.reset()),
                            note=lambda result: result.update({k: v for k, v in mount.stats().items() if k != "files"}))
        results["_limit"] = [{"bytes_per_s": mount.limit_bytes_per_s() if latency_ms else float("inf")}]
    return results


def failed(runs: list[dict[str, Any]]) -> str:
    return f"failed: {runs[0].get('error', '')[:60]}" if runs else "failed"


def cpu(runs: list[dict[str, Any]]) -> str:
    """The case's median CPU seconds (every thread of its process; the mount server's not included)."""
    seconds = med(runs, "cpu_s")
    return "–" if seconds is None else f"{seconds:.2f}"


def latency_table(by_latency: dict[float, Runs], nbytes: int) -> str:
    lat = sorted(by_latency)
    rows = []
    for label in [k for k in by_latency[lat[0]] if not k.startswith("_")]:
        cells = []
        for x in lat:
            runs = by_latency[x][label]
            t = med(runs, "s")
            cells.append(f"{t:.2f} ({nbytes / t / 1e9:.2f}), {med(runs, 'requests'):.0f}, "
                         f"{max(r['peak_in_flight'] for r in runs)}, {cpu(runs)}" if t else failed(runs))
        rows.append([label, *cells])
    for request_bytes, how in ((128 << 10, "128 KiB (page-cache reads)"), (1 << 20, "1 MiB (O_DIRECT reads)")):
        limits = [by_latency[x]["_limit"][0]["bytes_per_s"] * request_bytes / (128 << 10) for x in lat]
        rows.append([f"mount limit: 16 in flight × {how} ÷ latency",
                     *(f"{nbytes / limit:.2f} ({limit * 1e-9:.2f})" if limit != float("inf") else "none" for limit in limits)])
    return markdown(["reader", *(f"{x:g} ms: s (GB/s), requests, peak in flight, CPU s" for x in lat)], rows)


def main_latency(args: argparse.Namespace) -> None:
    """``bench_load.py --latency-ms MS... [--bindfs] [--no-local]``: the UNet in fp16, 4 shards."""
    from latency_mount import fuse_unavailable

    if reason := fuse_unavailable():
        raise SystemExit(f"cannot run the latency benchmark: {reason}")
    folder, nbytes = sharded_unet(args.latency_model, args.work, dtype="F16", shards=4)
    cases = benchlib.picked(CASES, args.only)
    if importlib.util.find_spec("fastsafetensors") is None:
        cases = [c for c in cases if not c.startswith("fastsafetensors")]
        print("fastsafetensors is not installed (pip install fastsafetensors): its row is left out")
    what = f"{args.latency_model} UNet fp16, {nbytes / 1e9:.2f} GB, {len(shard_files(folder))} shards"
    print(f"{what}, {folder} ({benchlib.filesystem_line(folder)}); {benchlib.machine_line()}", flush=True)
    before = os.getloadavg()
    by_latency = {x: run_latency(folder, x, args.runs, cases) for x in args.latency_ms}
    passthrough: Runs = {}
    if args.bindfs:  # through a bindfs mount of ``folder`` (FUSE passthrough, no latency), backing files evicted
        with benchlib.bindfs_mount(folder) as mnt:
            passthrough = run_cases(mnt, args.runs, [c for c in cases if not c.startswith("floor")],
                                    prepare=lambda: set_cache(shard_files(folder), cold=True))
    cold = {} if args.no_local else run_cases(folder, args.runs, [DD, *LOCAL_CASES],
                                              prepare=lambda: set_cache(shard_files(folder), cold=True))
    print("\nload average (1, 5, 15 min) before: " + ", ".join(f"{x:.1f}" for x in before)
          + "; after: " + ", ".join(f"{x:.1f}" for x in os.getloadavg()))
    print(f"{what}; load + touch every page of every weight, median of {args.runs} runs in fresh processes, "
          f"imports excluded; {benchlib.machine_line()}:\n")
    if by_latency:
        print(latency_table(by_latency, nbytes))
    if cold:
        dd = med(cold[DD], "s") or 0.0
        rows = [[label, f"{t:.2f} ({nbytes / t / 1e9:.2f})", f"{dd / t:.2f}×"] if (t := med(runs, "s")) else
                [label, failed(runs), ""] for label, runs in cold.items()]
        print("\n" + markdown(["local disk, page cache evicted", "s (GB/s)", "× dd"], rows))
    if passthrough:
        base = med(passthrough.get("safetensors load_file (per shard)", []), "s") or 0.0
        rows = [[label, f"{t:.2f} ({nbytes / t / 1e9:.2f})", f"{base / t:.2f}×", cpu(runs),
                 ", ".join(f"{r['s']:.2f}" for r in runs if "s" in r)] if (t := med(runs, "s")) else
                [label, failed(runs), "", "", ""] for label, runs in passthrough.items()]
        print("\n" + markdown(["bindfs (no latency), backing evicted", "s (GB/s)", "× safetensors", "CPU s", "runs s"],
                              rows, align="lrrrl"))


def main_read(args: argparse.Namespace) -> None:
    """``--read-backends``: the SD 1.5 UNet fp16 (one file) on the local disk and a bindfs mount, cold and warm."""
    weights = unet_source("tiny" if args.tiny else "sd15", args.work, dtype="F16")
    folder, nbytes = os.path.dirname(weights), os.path.getsize(weights)
    labels = ["dd bs=16M (floor)", *benchlib.picked(list(READ_CASES)[1:], args.only)]
    with benchlib.bindfs_mount(folder) as mount:
        print(f"SD 1.5 UNet fp16: {nbytes / 1e9:.2f} GB in {folder} ({benchlib.filesystem_line(folder)}), FUSE: "
              f"{mount}; {benchlib.machine_line()}", flush=True)

        def one(cell: tuple[str, str, str], r: int) -> dict[str, Any]:
            label, where, cache = cell  # cold runs evict first (and check)
            root = folder if where == "local" else mount
            path = os.path.join(root, os.path.basename(weights))
            left = max(benchlib.evict(weights), benchlib.evict(path)) if cache == "cold" else \
                set_cache([path], cold=False)
            name, options = READ_CASES[label]
            result = outside(f"dd if={path} of=/dev/null bs=16M") if name == "dd" else \
                load(name, root, {**options, "touch": "pages"})
            return {**result, "left": left}

        results = benchlib.rounds([(label, where, cache) for cache in ("cold", "warm") for where in ("local", "fuse")
                                   for label in labels], args.runs, one,
                                  line=lambda d: f"{d['touch_s']:.2f} s (cached before: {d['left']:.0%}), "
                                                 f"peak {(d['hwm'] - d['base']) / 2**20:.0f} MB")
    cols = [("local", "cold"), ("local", "warm"), ("fuse", "cold"), ("fuse", "warm")]
    rows = []
    for label in labels:
        cells = []
        for where, cache in cols:
            t, dd = med(results[(label, where, cache)], "touch_s"), med(results[(labels[0], where, "cold")], "touch_s")
            cells.append(f"{t:.2f} ({nbytes / t / 1e9:.2f}, {dd / t:.2f}×)")
        rss = max(r["hwm"] - r["base"] for (lb, _, _), v in results.items() if lb == label for r in v)
        rows.append([label, *cells, f"{rss / 2**20:.0f}"])
    print(f"\nSD 1.5 UNet fp16, {nbytes / 1e9:.2f} GB, one file; load + touch every page of every weight, "
          f"median of {args.runs} interleaved runs in fresh processes, imports excluded; {benchlib.machine_line()}:\n")
    print(markdown(["case", *(f"{w} {c} s (GB/s, × dd cold)" for w, c in cols), "peak RSS above imports MB"], rows))
