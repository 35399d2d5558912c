#!/usr/bin/env python3
"""Benchmark ``convert s3://A s3://B``: one process, ``torchrun`` with 2 ranks, and a plan run by 1 or 2 workers, on SeaweedFS.

The source is one safetensors object of random fp16 values (``--size-mb``, in 64 MiB tensors) in a
local SeaweedFS (scripts/s3_server.py); each case converts it into a fresh prefix with
``--max-shard-size`` (default 300MB; ``--dtype`` to cast too), in fresh processes, ``--runs`` times
interleaved (median). The plan cases write the plan first (not timed), then time the tasks (1 worker:
one process runs every task; 2 workers: two processes at once, tasks 0,2,4... and 1,3,5...) and the
finalize apart. Peak RSS: the largest process's (``RUSAGE_CHILDREN``), and for the plan cases each
worker's own (VmHWM, ``benchlib.py --shardkit``). Every output's manifest (every tensor's crc32) and
object sizes are checked equal to the first one-process output. The load average is printed before
each run: other work on the machine shows there.

    .venv/bin/python scripts/bench_distributed_s3.py --size-mb 1024 --runs 3
    .venv/bin/python scripts/bench_distributed_s3.py --cases plan --dtype bf16
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

from benchlib import HERE, machine_line, measure, median, parser, rank_peaks_mb, remove, rounds
from build_checkpoint import build_random
from s3_server import SeaweedS3, weed_unavailable

BUCKET = "bench"
SHARDKIT = f"{sys.executable} {os.path.join(HERE, 'benchlib.py')} --shardkit"
CASES = {"shardkit convert, 1 process": f"{sys.executable} -m shardkit convert",
         "torchrun, 2 ranks": f"{sys.executable} -m torch.distributed.run --standalone --nproc-per-node 2 -m shardkit convert",
         "plan, 1 worker": 1, "plan, 2 workers": 2}


def plan_case(workers: int, source: str, output: str, convert_args: str, work: str) -> dict[str, Any]:
    """Write the plan, then time its tasks on ``workers`` processes at once, then its finalize."""
    import shardkit

    plan_path, rss = os.path.join(work, "plan.json"), os.path.join(work, "rss")
    remove(rss)
    os.makedirs(rss)
    args = convert_args.split()
    options = {"max_shard_size": args[args.index("--max-shard-size") + 1]}
    if "--dtype" in args:
        options["dtype"] = args[args.index("--dtype") + 1]
    tasks = len(shardkit.write_plan(source, output, plan_path, **options).tasks)
    shares = [" ".join(f"--task {i}" for i in range(w, tasks, workers)) for w in range(workers)]
    run = " ".join(f"BENCH_RSS_DIR={rss} RANK={w} {SHARDKIT} run {plan_path} {share} -q & p{w}=$!;"
                   for w, share in enumerate(shares))
    load = os.getloadavg()[0]
    seconds, rss_mb = measure(run + " && ".join(f" wait $p{w}" for w in range(workers)))  # any worker failing fails it
    peaks = rank_peaks_mb(rss)
    final_s, final_mb = measure(f"BENCH_RSS_DIR={rss} RANK=f {SHARDKIT} run {plan_path} --finalize -q")
    return {"seconds": seconds, "finalize_s": final_s, "rss_mb": rss_mb, "worker_mb": peaks, "finalize_mb": final_mb,
            "tasks": tasks, "load": load}


def main() -> None:
    p = parser(__doc__, output=False)
    p.add_argument("--size-mb", type=int, default=1024)
    p.add_argument("--max-shard-size", default="300MB")
    p.add_argument("--dtype", default="", help="cast too (e.g. bf16)")
    p.add_argument("--cases", default="", help="only the cases whose name holds this (e.g. plan)")
    args = p.parse_args()
    reason = weed_unavailable()
    if reason:
        raise SystemExit(reason)
    convert_args = f"--max-shard-size {args.max_shard_size}" + (f" --dtype {args.dtype}" if args.dtype else "")
    names = [n for n in CASES if args.cases in n]
    with tempfile.TemporaryDirectory(prefix="bench-dist-s3-") as work, SeaweedS3(os.path.join(work, "weed")) as server:
        os.environ.update(server.client_env())
        build_random(os.path.join(work, "src"), size_bytes=args.size_mb << 20, dtype="F16", manifest=False)
        size_bytes = server.upload(os.path.join(work, "src"), BUCKET, "src")
        reference: list[Any] = []

        def one(name: str, r: int) -> dict[str, Any]:
            prefix = f"out{r}-{list(CASES).index(name)}"
            source, output = f"s3://{BUCKET}/src", f"s3://{BUCKET}/{prefix}"
            if isinstance(CASES[name], int):
                result = plan_case(int(CASES[name]), source, output, convert_args, work)
            else:
                load = os.getloadavg()[0]
                seconds, rss_mb = measure(f"{CASES[name]} {source} {output} {convert_args}")
                result = {"seconds": seconds, "rss_mb": rss_mb, "load": load}
            client = server.client()
            manifest = client.get_object(Bucket=BUCKET, Key=f"{prefix}/shardkit.manifest.json")["Body"].read()
            client.close()
            got = (server.objects(BUCKET, prefix + "/"), manifest)
            reference[:] = reference or [got]
            if got != reference[0]:
                raise SystemExit(f"{name}: the output differs from the first output")
            server.drop(BUCKET, prefix + "/")
            extra = f", finalize {result['finalize_s']:.2f} s, workers {_mb(result['worker_mb'])} MB" \
                if "worker_mb" in result else ""
            print(f"run {r + 1} {name}: {result['seconds']:.2f} s, {result['rss_mb']:.0f} MB{extra} "
                  f"(load {result['load']:.1f} before)", flush=True)
            return result

        results = rounds(names, args.runs, one)
    print(machine_line())
    print(f"load average at the end: {os.getloadavg()}")
    print(f"\n{size_bytes / 1e9:.2f} GB, {convert_args}, {args.runs} runs\n")
    print("| case | runs s | median s | finalize s | peak RSS MB (largest process) | per-worker peak MB | load before |")
    print("|---|---|---:|---:|---:|---|---|")
    for name, runs in results.items():
        each = ", ".join(f"{r['seconds']:.2f}" for r in runs)
        final = f"{median(r['finalize_s'] for r in runs):.2f}" if "finalize_s" in runs[0] else "-"
        workers = "; ".join(_mb(r["worker_mb"]) for r in runs) if "worker_mb" in runs[0] else "-"
        loads = ", ".join(f"{r['load']:.1f}" for r in runs)
        print(f"| {name} | {each} | {median(r['seconds'] for r in runs):.2f} | {final} | "
              f"{max(r['rss_mb'] for r in runs):.0f} | {workers} | {loads} |")


def _mb(peaks: list[float]) -> str:
    return " + ".join(f"{m:.0f}" for m in peaks)


if __name__ == "__main__":
    main()
