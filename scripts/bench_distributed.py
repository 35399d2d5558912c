#!/usr/bin/env python3
"""Benchmark ``torchrun -m shardkit convert`` of a DCP folder with 1, 2 and 4 ranks, against the incumbents.

The source is the SDXL UNet safetensors file (10.27 GB fp32; ``--source``, default the one under
/work/cowbench, else built with random weights); ``--gb`` keeps only its first tensors up to that
many GB, for machines with little memory or time. It is saved once as a DCP folder
(``dcp.save({"model": sd}, no_dist=True)``, as FSDP training leaves it). Cases, each run in a
fresh process, ``--runs`` times interleaved (median), every write ending with ``sync``:

  * ``cp -r`` of the DCP folder (the floor)
  * ``shardkit convert`` (1 process) and ``torchrun --nproc-per-node N -m shardkit convert`` (N = 2, 4)
  * ``accelerate merge-weights`` (one process, safetensors)
  * ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` (one process, a .pt file)

Peak RSS: for shardkit, each rank's own (VmHWM, recorded at its exit by ``benchlib.py --shardkit``);
for the others, the process tree's. Every shardkit output is checked byte-identical to the 1-rank one.

    .venv/bin/python scripts/bench_distributed.py --gb 2.5 --runs 1     # what fits a 2-core box
    .venv/bin/python scripts/bench_distributed.py --runs 3              # the full 10.27 GB
"""

from __future__ import annotations

import argparse
import filecmp
import glob
import os
import sys
import time
from typing import Any

from benchlib import HERE, Case, machine_line, med, parser, publish_report, rank_peaks_mb, remove, rounds
from benchlib import measure as measure_command
from build_checkpoint import build_once, unet_source

DEFAULT_SOURCE = "/work/cowbench/sdxl-unet/diffusion_pytorch_model.safetensors"

# sys.argv: [source safetensors, max bytes (0: all), output DCP folder]
DCP_SAVE = ("import sys, warnings; warnings.simplefilter('ignore'); import torch.distributed.checkpoint as dcp; "
            "from safetensors import safe_open\n"
            "limit = int(float(sys.argv[2])); sd = {}; total = 0\n"
            "with safe_open(sys.argv[1], 'pt') as f:\n"
            "    for k in f.keys():\n"
            "        t = f.get_tensor(k); total += t.numel() * t.element_size(); sd[k] = t\n"
            "        if limit and total >= limit: break\n"
            "dcp.save({'model': sd}, checkpoint_id=sys.argv[3], no_dist=True)")

DCP_TO_TORCH = ("import sys, warnings; warnings.simplefilter('ignore'); "
                "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
                "dcp_to_torch_save(sys.argv[1], sys.argv[2])")


def cases(args: argparse.Namespace, dcp: str, work: str) -> list[Case]:
    """Every case; each one's output is its first cleanup path."""
    py = sys.executable
    wrapper = f"{os.path.join(HERE, 'benchlib.py')} --shardkit"
    out = {n: os.path.join(work, f"out-{n}") for n in ("cp", "acc", "pt")}
    rows = [Case("cp -r (floor)", f"cp -r {dcp} {out['cp']} && sync", cleanup=[out["cp"]])]
    for n in args.ranks:
        rss, output = os.path.join(work, f"rss-{n}"), os.path.join(work, f"out-r{n}")
        launch = f"{py} {wrapper}" if n == 1 else f"{py} -m torch.distributed.run --standalone --nproc-per-node {n} {wrapper}"
        rows.append(Case(f"shardkit convert, {n} rank{'s' if n > 1 else ''}", f"BENCH_RSS_DIR={rss} {launch} convert "
                         f"{dcp} {output} --max-shard-size {args.max_shard_size} -q && sync",
                         cleanup=[output, rss], rss_dir=rss))
    if not args.no_incumbents:
        rows.append(Case("accelerate merge-weights", f"{os.path.join(os.path.dirname(py), 'accelerate')} merge-weights "
                         f"{dcp} {out['acc']} >/dev/null 2>&1 && sync", cleanup=[out["acc"]]))
        rows.append(Case("dcp_to_torch_save", f"{py} -c \"{DCP_TO_TORCH}\" {dcp} {out['pt']}.pt 2>/dev/null && sync",
                         cleanup=[out["pt"] + ".pt"]))
    return rows


def run(all_cases: list[Case], runs: int) -> dict[Case, list[dict[str, Any]]]:
    first = next(c.cleanup[0] for c in all_cases if c.rss_dir)

    def one(case: Case, r: int) -> dict[str, Any]:
        for path in case.cleanup:
            remove(path)
        if case.rss_dir:
            os.makedirs(case.rss_dir)
        print(f"run {r + 1}: {case.name} ...", flush=True)
        seconds, rss_mb = measure_command(case.command)
        ranks = rank_peaks_mb(case.rss_dir) if case.rss_dir else []
        output = case.cleanup[0]
        if case.rss_dir and output != first and os.path.isdir(first):  # must equal the first shardkit output
            names = sorted(os.listdir(first))
            _, mismatch, errors = filecmp.cmpfiles(first, output, names, shallow=False)
            if names != sorted(os.listdir(output)) or mismatch or errors:
                raise SystemExit(f"{output} differs from {first}: {mismatch or errors}")
            print(f"{output} is byte-identical to {first}", flush=True)
        if output != first:
            remove(output)  # disk
        return {"seconds": seconds, "rss_mb": rss_mb, "rank_rss_mb": ranks}

    return rounds(all_cases, runs, one)


def main() -> None:
    p = parser(__doc__, runs=1, work="/tmp/bench-distributed")
    p.add_argument("--source", default=DEFAULT_SOURCE, help="the SDXL UNet safetensors file")
    p.add_argument("--gb", type=float, default=0.0, help="keep only the first tensors up to this many GB (0: all)")
    p.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    p.add_argument("--max-shard-size", default="2GB")
    p.add_argument("--no-incumbents", action="store_true")
    args = p.parse_args()
    os.makedirs(args.work, exist_ok=True)
    source = args.source if os.path.exists(args.source) else unet_source("sdxl", args.work)
    dcp = build_once(os.path.join(args.work, f"sdxl-unet-dcp-{f'{args.gb:g}GB' if args.gb else 'full'}"), DCP_SAVE,
                     source, str(int(args.gb * 1e9)), hide_stderr=True)
    started = time.perf_counter()
    results = run(cases(args, dcp, args.work), args.runs)
    size_bytes = sum(os.path.getsize(p) for p in glob.glob(os.path.join(dcp, "*")))
    lines = [f"DCP folder {dcp}: {size_bytes / 1e9:.2f} GB, shards of {args.max_shard_size}, "
             f"median of {args.runs} run(s); {machine_line()}", "",
             "| case | seconds | GB/s | peak RSS (MB) | per-rank peak RSS (MB) |", "|---|---:|---:|---:|---|"]
    for case, runs in results.items():
        seconds = med(runs, "seconds")
        ranks = ", ".join(f"{m:.0f}" for m in runs[-1]["rank_rss_mb"]) or "-"
        lines.append(f"| {case.name} | {seconds:.1f} | {size_bytes / 1e9 / seconds:.2f} | {med(runs, 'rss_mb'):.0f} | {ranks} |")
    print("\n".join(lines))
    print(f"(benchmark took {time.perf_counter() - started:.0f} s)")
    publish_report("\n".join(lines), args.output)
    for case in results:
        for path in case.cleanup:
            remove(path)


if __name__ == "__main__":
    main()
