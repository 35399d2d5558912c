#!/usr/bin/env python3
"""Loading through mounts: at the latency limit (issue 22), through FUSE (issue 34), each read backend (issue 13);
``scripts/bench_load.py --latency-ms``, ``--bindfs`` and ``--read-backends`` run it.
Method: docs/benchmarks.md, "How each benchmark measures".
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
from collections.abc import Callable
from shlex import quote
from typing import Any

import benchlib
from bench_load import load, outside
from benchlib import markdown, med, set_cache, shard_files
from build_checkpoint import sharded_unet, unet_source

DD = "dd bs=16M (floor)"
# label: (bench_load loader, options, the tables it is in: "mount" (the latency mounts and bindfs), "local" (the local
# disk, page cache evicted), "read" (--read-backends)); every case touches one byte of every page of every weight
CASES = {
    "floor: 16 threads × 4 MiB O_DIRECT reads, no tensors": ("odirect", {}, "mount"),
    DD: ("dd", {}, "local read"),
    "safetensors load_file (mmap)": ("floor", {}, "mount read"),
    "safetensors load_file(backend='pread')": ("floor", {"backend": "pread"}, "read"),
    "fastsafetensors (nogds, cpu)": ("fastsafetensors", {}, "mount"),
    "accelerate load_checkpoint_and_dispatch": ("accelerate", {}, "read"),
    "diffusers from_pretrained": ("diffusers", {}, "mount read"),
    "shardkit.open, ck[k] for every key": ("open", {}, "mount local"),
    # read="direct": what ``auto`` chose on every FUSE/network mount before issue 34
    "shardkit.open(read='direct'), ck[k] for every key": ("open", {"read": "direct"}, "mount"),
    # read="mmap": zero-copy views of private maps, as safetensors gives, no read-ahead of shardkit's
    "shardkit.open(read='mmap'), ck[k] for every key": ("open", {"read": "mmap"}, "mount"),
    "shardkit to_state_dict": ("state_dict", {}, "mount"),
    "shardkit.load_model read=auto": ("shardkit", {}, "mount local read"),
    **{f"shardkit.load_model read={r}": ("shardkit", {"read": r}, "read") for r in ("mmap", "pread", "direct")},
}


def labels_in(table: str) -> list[str]:
    return [label for label, (*_, tables) in CASES.items() if table in tables.split()]


Runs = dict[str, list[dict[str, Any]]]
LOADS: list[tuple[float, float]] = []  # the load average at the start and end of each round, for the report head
Place = tuple[str, Callable[[], object]]  # the folder a case reads, and what runs before each run (cache, counters)


def run_case(name: str, options: dict[str, Any], folder: str) -> dict[str, Any]:
    """One case in a fresh process; its time ``s`` is the load with every page touched (imports excluded)."""
    if name == "dd":
        result = outside(" && ".join(f"dd if={quote(p)} of=/dev/null bs=16M" for p in shard_files(folder)))
    else:
        result = load(name, folder, {**options, "touch": "pages"}, check=False)
    return {**result, "s": result["touch_s"]} if "error" not in result else result


def run_cells(labels: list[str], places: dict[str, Place], runs: int,
              note: Callable[[dict[str, Any]], object] = dict) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Every case at every place ``runs`` times, interleaved; the place's preparation before each, ``note(result)``
    after."""
    def one(cell: tuple[str, str], r: int) -> dict[str, Any]:
        folder, prepare = places[cell[1]]
        left = prepare()
        result = run_case(*CASES[cell[0]][:2], folder)
        note(result)
        return {**result, "left": left} if isinstance(left, float) else result

    def line(d: dict[str, Any]) -> str:
        return f"{d['s']:.2f} s" + (f", {d['requests']} requests" if "requests" in d else "") + \
            (f" (cached before: {d['left']:.0%})" if "left" in d else "")

    return benchlib.rounds([(label, where) for where in places for label in labels], runs, one, loads=LOADS, line=line)


def run_cases(folder: str, runs: int, labels: list[str], prepare: Callable[[], object],
              note: Callable[[dict[str, Any]], object] = dict) -> Runs:
    """Every case ``runs`` times on ``folder``, interleaved: :func:`run_cells` at one place."""
    return {label: v for (label, _), v in run_cells(labels, {os.path.basename(folder): (folder, prepare)}, runs,
                                                    note).items()}


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


def speed(runs: list[dict[str, Any]], nbytes: int, base: float | None) -> list[str]:
    """The median seconds (GB/s), and ``base`` over them: two cells (failed: why, and nothing)."""
    t = med(runs, "s")
    return [f"{t:.2f} ({nbytes / t / 1e9:.2f})", f"{(base or 0.0) / t:.2f}×"] if t else [failed(runs), ""]


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
    cases = benchlib.picked(labels_in("mount"), args.only)
    if importlib.util.find_spec("fastsafetensors") is None:
        cases = [c for c in cases if not c.startswith("fastsafetensors")]
        print("fastsafetensors is not installed (pip install fastsafetensors): its row is left out")
    what = f"{args.latency_model} UNet fp16, {nbytes / 1e9:.2f} GB, {len(shard_files(folder))} shards"
    print(f"{what}, {folder} ({benchlib.filesystem_line(folder)}); {benchlib.machine_line()}", flush=True)
    by_latency = {x: run_latency(folder, x, args.runs, cases) for x in args.latency_ms}
    evicted = functools.partial(set_cache, shard_files(folder), cold=True)
    passthrough: Runs = {}
    if args.bindfs:  # through a bindfs mount of ``folder`` (FUSE passthrough, no latency), backing files evicted
        with benchlib.bindfs_mount(folder) as mnt:
            passthrough = run_cases(mnt, args.runs, [c for c in cases if not c.startswith("floor")], evicted)
    cold = {} if args.no_local else run_cases(folder, args.runs, labels_in("local"), evicted)
    print("\n" + benchlib.report_head(f"{what}; load + touch every page of every weight in fresh processes, imports "
                                      "excluded", runs=args.runs, loads=LOADS), end="")
    if by_latency:
        print(latency_table(by_latency, nbytes))
    if cold:
        rows = [[label, *speed(runs, nbytes, med(cold[DD], "s"))] for label, runs in cold.items()]
        print("\n" + markdown(["local disk, page cache evicted", "s (GB/s)", "× dd"], rows))
    if passthrough:
        base = med(passthrough.get("safetensors load_file (mmap)", []), "s")
        rows = [[label, *speed(runs, nbytes, base), cpu(runs), ", ".join(f"{r['s']:.2f}" for r in runs if "s" in r)]
                for label, runs in passthrough.items()]
        print("\n" + markdown(["bindfs (no latency), backing evicted", "s (GB/s)", "× safetensors", "CPU s", "runs s"],
                              rows, align="lrrrl"))


def main_read(args: argparse.Namespace) -> None:
    """``--read-backends``: the SD 1.5 UNet fp16 (one file) on the local disk and a bindfs mount, cold and warm."""
    weights = unet_source("tiny" if args.tiny else "sd15", args.work, dtype="F16")
    folder, nbytes = os.path.dirname(weights), os.path.getsize(weights)
    labels = [DD, *benchlib.picked(labels_in("read")[1:], args.only)]
    with benchlib.bindfs_mount(folder) as mount:
        print(f"SD 1.5 UNet fp16: {nbytes / 1e9:.2f} GB in {folder} ({benchlib.filesystem_line(folder)}), FUSE: "
              f"{mount}; {benchlib.machine_line()}", flush=True)

        def cache(root: str, cold: bool) -> Callable[[], float]:  # cold: evict the backing file and the mount's
            path = os.path.join(root, os.path.basename(weights))
            return lambda: max(benchlib.evict(weights), benchlib.evict(path)) if cold else set_cache([path], cold=False)

        roots = {"local": folder, "fuse": mount}
        places = {f"{where} {c}": (root, cache(root, c == "cold"))
                  for where, root in roots.items() for c in ("cold", "warm")}
        results = run_cells(labels, places, args.runs)
    rows = []
    for label in labels:
        cells = [" ".join(speed(results[(label, p)], nbytes, med(results[(DD, p.split()[0] + " cold")], "s")))
                 for p in places]
        rss = max((r["hwm"] - r["base"] for p in places for r in results[(label, p)] if "hwm" in r), default=0)
        rows.append([label, *cells, f"{rss / 2**20:.0f}"])
    print("\n" + benchlib.report_head(f"SD 1.5 UNet fp16, {nbytes / 1e9:.2f} GB, one file; load + touch every page of "
                                      "every weight in fresh processes, imports excluded", runs=args.runs,
                                      loads=LOADS), end="")
    print(markdown(["case", *(f"{p} s (GB/s) × dd cold" for p in places), "peak RSS above imports MB"], rows))
