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

Peak RSS: for shardkit, each rank's own ``ru_maxrss`` (a wrapper records it at exit); for the
others, the process tree's. Every shardkit output is checked byte-identical to the 1-rank one.

    .venv/bin/python scripts/bench_distributed.py --gb 2.5 --runs 1     # what fits a 2-core box
    .venv/bin/python scripts/bench_distributed.py --runs 3              # the full 10.27 GB
"""

from __future__ import annotations

import argparse
import filecmp
import glob
import os
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from benchlib import build_once, build_unet_source, machine_line, measure, publish_report  # noqa: E402

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

# Runs ``shardkit`` with argv, then records this process's peak RSS in $BENCH_RSS_DIR/rank-<RANK>.
RSS_WRAPPER = """import os, resource, runpy, sys
def _record():
    folder = os.environ.get("BENCH_RSS_DIR")
    if folder:
        with open(os.path.join(folder, "rank-" + os.environ.get("RANK", "0")), "w") as f:
            f.write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))
sys.argv = ["shardkit", *sys.argv[1:]]
try:
    runpy.run_module("shardkit", run_name="__main__")
finally:
    _record()
"""

DCP_TO_TORCH = ("import sys, warnings; warnings.simplefilter('ignore'); "
                "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
                "dcp_to_torch_save(sys.argv[1], sys.argv[2])")


def prepare(args: argparse.Namespace) -> str:
    source = args.source if os.path.exists(args.source) else build_unet_source("sdxl", args.work)
    tag = f"{args.gb:g}GB" if args.gb else "full"
    return build_once(os.path.join(args.work, f"sdxl-unet-dcp-{tag}"), DCP_SAVE, source, str(int(args.gb * 1e9)),
                      hide_stderr=True)


def cases(args: argparse.Namespace, dcp: str) -> list[tuple[str, str, str, str]]:
    """(name, command, output, rss dir or "") of every case."""
    py, work, size = sys.executable, args.work, args.max_shard_size
    wrapper = os.path.join(work, "shardkit_rss.py")
    with open(wrapper, "w") as f:
        f.write(RSS_WRAPPER)
    accelerate = os.path.join(os.path.dirname(py), "accelerate")
    out = {n: os.path.join(work, f"out-{n}") for n in ("cp", "r1", "r2", "r4", "acc", "pt")}
    rows = [("cp -r (floor)", f"cp -r {dcp} {out['cp']} && sync", out["cp"], "")]
    for n in args.ranks:
        rss = os.path.join(work, f"rss-{n}")
        launch = f"{py} {wrapper}" if n == 1 else \
            f"{py} -m torch.distributed.run --standalone --nproc-per-node {n} {wrapper}"
        rows.append((f"shardkit convert, {n} rank{'s' if n > 1 else ''}",
                     f"BENCH_RSS_DIR={rss} {launch} convert {dcp} {out[f'r{n}']} --max-shard-size {size} -q && sync",
                     out[f"r{n}"], rss))
    if not args.no_incumbents:
        rows.append(("accelerate merge-weights", f"{accelerate} merge-weights {dcp} {out['acc']} >/dev/null 2>&1 && sync",
                     out["acc"], ""))
        rows.append(("dcp_to_torch_save", f"{py} -c \"{DCP_TO_TORCH}\" {dcp} {out['pt']}.pt 2>/dev/null && sync",
                     out["pt"] + ".pt", ""))
    return rows


def _clean(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)


def run(args: argparse.Namespace, dcp: str) -> list[dict]:
    rows = cases(args, dcp)
    results = {name: {"name": name, "seconds": [], "rss_mb": [], "rank_rss_mb": []} for name, *_ in rows}
    for r in range(args.runs):
        for name, command, output, rss in rows[r % len(rows):] + rows[: r % len(rows)]:
            _clean(output)
            if rss:
                _clean(rss)
                os.makedirs(rss)
            print(f"run {r + 1}: {name} ...", flush=True)
            seconds, rss_mb = measure(command)
            results[name]["seconds"].append(seconds)
            results[name]["rss_mb"].append(rss_mb)
            if rss:
                ranks = sorted(glob.glob(os.path.join(rss, "rank-*")))
                results[name]["rank_rss_mb"] = [int(open(p).read()) / 1024 for p in ranks]
            _check_identical(rows, output)
    return list(results.values())


def _check_identical(rows: list[tuple[str, str, str, str]], output: str) -> None:
    """A shardkit output must equal the first shardkit case's; all but that one are removed (disk)."""
    first = next(out for _, _, out, rss in rows if rss)
    if output != first and any(out == output and rss for _, _, out, rss in rows) and os.path.isdir(first):
        names = sorted(os.listdir(first))
        assert names == sorted(os.listdir(output)), (first, output)
        _, mismatch, errors = filecmp.cmpfiles(first, output, names, shallow=False)
        assert not mismatch and not errors, f"{output} differs from {first}: {mismatch or errors}"
        print(f"{output} is byte-identical to {first}", flush=True)
    if output != first:
        _clean(output)


def report(args: argparse.Namespace, dcp: str, results: list[dict]) -> str:
    size_bytes = sum(os.path.getsize(p) for p in glob.glob(os.path.join(dcp, "*")))
    lines = [f"DCP folder {dcp}: {size_bytes / 1e9:.2f} GB, shards of {args.max_shard_size}, "
             f"median of {args.runs} run(s); {machine_line()}", "",
             "| case | seconds | GB/s | peak RSS (MB) | per-rank peak RSS (MB) |", "|---|---:|---:|---:|---|"]
    for r in results:
        seconds = statistics.median(r["seconds"])
        ranks = ", ".join(f"{m:.0f}" for m in r["rank_rss_mb"]) or "-"
        lines.append(f"| {r['name']} | {seconds:.1f} | {size_bytes / 1e9 / seconds:.2f} | "
                     f"{statistics.median(r['rss_mb']):.0f} | {ranks} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default=DEFAULT_SOURCE, help="the SDXL UNet safetensors file")
    parser.add_argument("--gb", type=float, default=0.0, help="keep only the first tensors up to this many GB (0: all)")
    parser.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--max-shard-size", default="2GB")
    parser.add_argument("--work", default="/tmp/bench-distributed")
    parser.add_argument("--no-incumbents", action="store_true")
    parser.add_argument("--output", help="also write the report (markdown) here")
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)
    dcp = prepare(args)
    started = time.perf_counter()
    text = report(args, dcp, run(args, dcp))
    print(text)
    print(f"(benchmark took {time.perf_counter() - started:.0f} s)")
    publish_report(text, args.output)
    for name in os.listdir(args.work):
        if name.startswith("out-"):
            _clean(os.path.join(args.work, name))


if __name__ == "__main__":
    main()
