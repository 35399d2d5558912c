#!/usr/bin/env python3
"""Benchmark ``torchrun -m shardkit convert s3://A s3://B`` with 2 ranks against one process, on SeaweedFS.

The source is one safetensors object of random fp16 values (``--size-mb``, in 64 MiB tensors) in a
local SeaweedFS (scripts/s3_server.py); each case converts it into a fresh prefix with
``--max-shard-size`` (default 300MB), in a fresh process, ``--runs`` times interleaved (median).
Peak RSS is the largest single process's (``RUSAGE_CHILDREN``). Every output's manifest (which
holds every tensor's crc32) and object sizes are checked equal to the first one-process output.

    .venv/bin/python scripts/bench_distributed_s3.py --size-mb 1024 --runs 3
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

from benchlib import machine_line, measure, median, parser, rounds
from build_checkpoint import build_random
from s3_server import SeaweedS3, weed_unavailable

BUCKET = "bench"
CASES = {"shardkit convert, 1 process": f"{sys.executable} -m shardkit convert",
         "torchrun, 2 ranks": f"{sys.executable} -m torch.distributed.run --standalone --nproc-per-node 2 -m shardkit convert"}


def main() -> None:
    p = parser(__doc__, output=False)
    p.add_argument("--size-mb", type=int, default=1024)
    p.add_argument("--max-shard-size", default="300MB")
    args = p.parse_args()
    reason = weed_unavailable()
    if reason:
        raise SystemExit(reason)
    with tempfile.TemporaryDirectory(prefix="bench-dist-s3-") as work, SeaweedS3(os.path.join(work, "weed")) as server:
        os.environ.update(server.client_env())
        build_random(os.path.join(work, "src"), size_bytes=args.size_mb << 20, dtype="F16", manifest=False)
        size_bytes = server.upload(os.path.join(work, "src"), BUCKET, "src")
        reference: list[Any] = []

        def one(name: str, r: int) -> dict[str, float]:
            prefix = f"out{r}-{list(CASES).index(name)}"
            seconds, rss_mb = measure(f"{CASES[name]} s3://{BUCKET}/src s3://{BUCKET}/{prefix} "
                                      f"--max-shard-size {args.max_shard_size}")
            client = server.client()
            manifest = client.get_object(Bucket=BUCKET, Key=f"{prefix}/shardkit.manifest.json")["Body"].read()
            client.close()
            got = (server.objects(BUCKET, prefix + "/"), manifest)
            reference[:] = reference or [got]
            if got != reference[0]:
                raise SystemExit(f"{name}: the output differs from the first one-process output")
            server.drop(BUCKET, prefix + "/")
            print(f"run {r + 1} {name}: {seconds:.2f} s, {rss_mb:.0f} MB", flush=True)
            return {"seconds": seconds, "rss_mb": rss_mb}

        results = rounds(list(CASES), args.runs, one)
    print(machine_line())
    print(f"load average at the end: {os.getloadavg()}")
    print(f"\n{size_bytes / 1e9:.2f} GB, --max-shard-size {args.max_shard_size}, {args.runs} runs\n")
    print("| case | runs s | median s | peak RSS MB (largest process) |\n|---|---|---:|---:|")
    for name, runs in results.items():
        each = ", ".join(f"{r['seconds']:.2f}" for r in runs)
        print(f"| {name} | {each} | {median(r['seconds'] for r in runs):.2f} | {max(r['rss_mb'] for r in runs):.0f} |")


if __name__ == "__main__":
    main()
