#!/usr/bin/env python3
"""Benchmark ``convert`` in one process, as ``torchrun`` ranks and as a plan run by workers, against the incumbents
(:func:`cases`), locally or with ``--s3`` in SeaweedFS (tests/s3_server.py).
Method: docs/benchmarks.md, "How each benchmark measures".

    .venv/bin/python scripts/bench_distributed.py --gb 2.5 --runs 1     # what fits a 2-core box
    .venv/bin/python scripts/bench_distributed.py --runs 3              # the full 10.27 GB
    .venv/bin/python scripts/bench_distributed.py --s3 --size-mb 1024 --runs 3
    .venv/bin/python scripts/bench_distributed.py --s3 --ranks 1 --dtype bf16
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import benchlib
from benchlib import HERE, measure, med, rank_peaks_mb, remove
from build_checkpoint import DCP_SAVE, build_once, build_random, unet_source

DEFAULT_SOURCE = "/work/cowbench/sdxl-unet/diffusion_pytorch_model.safetensors"
BUCKET = "bench"
WRAPPER = f"{os.path.join(HERE, 'benchlib.py')} --shardkit"  # shardkit recording its process's peak RSS
SHARDKIT = f"{sys.executable} {WRAPPER}"

DCP_TO_TORCH = ("import sys, warnings; warnings.simplefilter('ignore'); "
                "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
                "dcp_to_torch_save(sys.argv[1], sys.argv[2])")


def cases(args: argparse.Namespace, convert_args: str) -> dict[str, str | int]:
    """Every case: a shell command of ``{src}``, ``{out}`` and ``{rss}`` (where shardkit processes leave their
    peaks), or a plan case's count of workers."""
    end, py = ("" if args.s3 else " && sync"), sys.executable
    found: dict[str, str | int] = {} if args.s3 else {"cp -r (floor)": "cp -r {src} {out}" + end}
    for n in args.ranks:
        launch = SHARDKIT if n == 1 else f"{py} -m torch.distributed.run --standalone --nproc-per-node {n} {WRAPPER}"
        found[f"shardkit convert, {n} rank{'s' if n > 1 else ''}"] = \
            f"BENCH_RSS_DIR={{rss}} {launch} convert {{src}} {{out}} {convert_args} -q{end}"
    found.update({f"plan, {w} worker{'s' if w > 1 else ''}": w for w in args.workers})
    if not args.s3 and not args.no_incumbents:
        found["accelerate merge-weights"] = (f"{os.path.join(os.path.dirname(py), 'accelerate')} merge-weights {{src}} "
                                             f"{{out}} >/dev/null 2>&1{end}")
        found["dcp_to_torch_save"] = f"{py} -c \"{DCP_TO_TORCH}\" {{src}} {{out}} 2>/dev/null{end}"
    return {name: case for name, case in found.items() if args.cases in name}


def run_plan(workers: int, source: str, output: str, convert_args: str, work: str, rss: str) -> dict[str, Any]:
    """Write the plan, then time its tasks on ``workers`` processes at once, then its finalize."""
    import shardkit

    plan_path = os.path.join(work, "plan.json")
    args = convert_args.split()
    options: dict[str, Any] = {"max_shard_size": args[args.index("--max-shard-size") + 1]}
    if "--dtype" in args:
        options["dtype"] = args[args.index("--dtype") + 1]
    tasks = len(shardkit.write_plan(source, output, plan_path, **options).tasks)
    if workers > tasks:  # a worker given no task would run every task, then publish, while the others run theirs
        print(f"plan, {workers} workers: the plan has {tasks} task(s), so {tasks} worker(s) run it (raise --size-mb or "
              "lower --max-shard-size for more)", file=sys.stderr, flush=True)
        workers = tasks
    shares = [" ".join(f"--task {i}" for i in range(w, tasks, workers)) for w in range(workers)]
    run = " ".join(f"BENCH_RSS_DIR={rss} RANK={w} {SHARDKIT} run {plan_path} {share} -q & p{w}=$!;"
                   for w, share in enumerate(shares))
    tasks_run = measure(run + " && ".join(f" wait $p{w}" for w in range(workers)))  # any worker failing fails it
    peaks = rank_peaks_mb(rss)
    final = measure(f"BENCH_RSS_DIR={rss} RANK=f {SHARDKIT} run {plan_path} --finalize -q")
    remove(plan_path)
    return {"seconds": tasks_run.seconds, "finalize_s": final.seconds, "rss_mb": max(tasks_run.rss_mb, final.rss_mb),
            "rank_mb": peaks}


@contextlib.contextmanager
def local_source(args: argparse.Namespace) -> Iterator[tuple[str, int, Callable[[str], object], Callable[[str], None]]]:
    """The DCP folder (built once under ``--work``), its bytes, and how to read back and drop an output."""
    source = args.source if os.path.exists(args.source) else unet_source("sdxl", args.work)
    dcp = build_once(os.path.join(args.work, f"sdxl-unet-dcp-{f'{args.gb:g}GB' if args.gb else 'full'}"), DCP_SAVE,
                     source, str(int(args.gb * 1e9)), hide_stderr=True)

    def files(out: str) -> object:  # every file's name, size and crc32
        found = {}
        for name in sorted(os.listdir(out)) if os.path.isdir(out) else []:
            with open(os.path.join(out, name), "rb") as f:
                crc = 0
                while chunk := f.read(16 << 20):
                    crc = zlib.crc32(chunk, crc)
            found[name] = (os.path.getsize(os.path.join(out, name)), crc)
        return found

    yield dcp, sum(os.path.getsize(os.path.join(dcp, n)) for n in os.listdir(dcp)), files, remove


@contextlib.contextmanager
def s3_source(args: argparse.Namespace) -> Iterator[tuple[str, int, Callable[[str], object], Callable[[str], None]]]:
    """``s3://bench/src`` in a fresh SeaweedFS, its bytes, and how to read back and drop an output."""
    from s3_server import SeaweedS3, weed_unavailable

    reason = weed_unavailable()
    if reason:
        raise SystemExit(reason)
    with tempfile.TemporaryDirectory(prefix="bench-dist-s3-") as work, SeaweedS3(os.path.join(work, "weed")) as server:
        os.environ.update(server.client_env())
        build_random(os.path.join(work, "src"), size_bytes=args.size_mb << 20, dtype="F16", manifest=False)
        size_bytes = server.upload(os.path.join(work, "src"), BUCKET, "src")

        def objects(out: str) -> object:  # every object's name and size, and the manifest (every tensor's crc32)
            client: Any
            prefix, client = out.removeprefix(f"s3://{BUCKET}/"), server.client()
            manifest = client.get_object(Bucket=BUCKET, Key=f"{prefix}/shardkit.manifest.json")["Body"].read()
            client.close()
            return server.objects(BUCKET, prefix + "/"), manifest

        yield f"s3://{BUCKET}/src", size_bytes, objects, lambda out: server.drop(BUCKET, out.removeprefix(f"s3://{BUCKET}/") + "/")


def run(args: argparse.Namespace) -> tuple[str, int, dict[str, list[dict[str, Any]]]]:
    convert_args = f"--max-shard-size {args.max_shard_size}" + (f" --dtype {args.dtype}" if args.dtype else "")
    all_cases = cases(args, convert_args)
    with (s3_source if args.s3 else local_source)(args) as (src, size_bytes, read_back, drop):
        reference: list[object] = []

        def one(name: str, r: int) -> dict[str, Any]:
            rss = os.path.join(args.work, "rss")
            out = f"s3://{BUCKET}/out{r}-{list(all_cases).index(name)}" if args.s3 else os.path.join(args.work, "out")
            for path in (rss, *([] if args.s3 else [out])):
                remove(path)
            os.makedirs(rss)
            load, case = os.getloadavg()[0], all_cases[name]
            if isinstance(case, int):
                result = run_plan(case, src, out, convert_args, args.work, rss)
            else:
                usage = measure(case.format(src=src, out=out, rss=rss))
                result = {"seconds": usage.seconds, "rss_mb": usage.rss_mb, "rank_mb": rank_peaks_mb(rss)}
            if name.startswith(("shardkit", "plan")):  # every shardkit output equals the first
                got = read_back(out)
                reference[:] = reference or [got]
                if got != reference[0]:
                    raise SystemExit(f"{name}: the output differs from the first shardkit output")
            drop(out)
            return {**result, "load": load}

        results = benchlib.rounds(list(all_cases), args.runs, one, line=lambda d: (
            f"{d['seconds']:.2f} s, {d['rss_mb']:.0f} MB, ranks {_mb(d['rank_mb'])} MB (load {d['load']:.1f} before)"))
        return f"{src}: {size_bytes / 1e9:.2f} GB, {convert_args}", size_bytes, results


def main() -> None:
    p = benchlib.parser(__doc__, runs=1, work="/tmp/bench-distributed")
    p.add_argument("--s3", action="store_true", help="convert s3:// to s3:// in a local SeaweedFS")
    p.add_argument("--source", default=DEFAULT_SOURCE, help="local: the SDXL UNet safetensors file")
    p.add_argument("--gb", type=float, default=0.0, help="local: keep only the first tensors up to this many GB (0: all)")
    p.add_argument("--size-mb", type=int, default=1024, help="--s3: the object's size, MiB")
    p.add_argument("--ranks", type=_ints, help="shardkit convert cases, by ranks (default: local 1,2,4; --s3 1,2)")
    p.add_argument("--workers", type=_ints, help="plan cases, by workers (default: local none; --s3 1,2)")
    p.add_argument("--max-shard-size", help="default: local 2GB, --s3 300MB")
    p.add_argument("--dtype", default="", help="cast too (e.g. bf16)")
    p.add_argument("--cases", default="", help="only the cases whose name holds this (e.g. plan)")
    p.add_argument("--no-incumbents", action="store_true")
    args = p.parse_args()
    args.ranks = args.ranks if args.ranks is not None else [1, 2] if args.s3 else [1, 2, 4]
    args.workers = args.workers if args.workers is not None else [1, 2] if args.s3 else []
    args.max_shard_size = args.max_shard_size or ("300MB" if args.s3 else "2GB")
    os.makedirs(args.work, exist_ok=True)
    started = time.perf_counter()
    what, size_bytes, results = run(args)
    rows = [[name, ", ".join(f"{r['seconds']:.2f}" for r in runs), f"{med(runs, 'seconds'):.2f}",
             f"{size_bytes / 1e9 / med(runs, 'seconds'):.2f}",
             f"{med(runs, 'finalize_s'):.2f}" if "finalize_s" in runs[0] else "-",
             f"{max(r['rss_mb'] for r in runs):.0f}", "; ".join(_mb(r["rank_mb"]) for r in runs) or "-",
             ", ".join(f"{r['load']:.1f}" for r in runs)] for name, runs in results.items()]
    head = benchlib.report_head(what, runs=args.runs, notes=[f"load average at the end {os.getloadavg()[0]:.1f}; "
                                                             f"the benchmark took {time.perf_counter() - started:.0f} s"])
    table = benchlib.markdown(["case", "runs s", "median s", "GB/s", "finalize s", "peak RSS MB (largest process)",
                               "per-rank (worker) peak MB", "load before"], rows, align="llrrrrll")
    benchlib.publish_report(head + table, args.output)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _mb(peaks: list[float]) -> str:
    return " + ".join(f"{m:.0f}" for m in peaks) or "-"


if __name__ == "__main__":
    main()
