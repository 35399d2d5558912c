#!/usr/bin/env python3
"""verify read speed vs ``cat FILES > /dev/null`` on warm files (median of N runs, same process tree).

Builds (once, under ROOT) one safetensors file of GB gigabytes of random F32 tensors and a copy split
into 4 shards, then times, warm: ``cat``, a plain read loop, single-threaded ``hashlib.file_digest``
and shardkit's ``verify`` of each, and ``verify(shards, against=single)``. Prints JSON.

    .venv/bin/python scripts/bench_verify.py /tmp/bench-verify 2 3     # ROOT GB RUNS
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import subprocess
import time
from collections.abc import Callable

from benchlib import median
from build_checkpoint import build_random


def timed(fn: Callable[[], object], runs: int) -> float:
    fn()  # warm the page cache
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return median(times)


def read_loop(files: list[str]) -> None:
    view = memoryview(mmap.mmap(-1, 1 << 20))
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        while os.readv(fd, [view]):
            pass
        os.close(fd)


def sha_only(files: list[str]) -> None:
    for path in files:
        with open(path, "rb") as f:
            hashlib.file_digest(f, "sha256")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root")
    p.add_argument("gb", type=float)
    p.add_argument("runs", type=int, nargs="?", default=3)
    args = p.parse_args()
    import shardkit
    from shardkit.checking.verify import verify

    total_bytes = int(args.gb * 1e9)
    single, sharded = os.path.join(args.root, "single"), os.path.join(args.root, "sharded")
    if not os.path.exists(sharded):
        build_random(single, size_bytes=total_bytes // 256 * 256, tensor_bytes=total_bytes // 256 * 4, dtype="F32")
        shardkit.split(single, sharded, max_shard_size=total_bytes // 4 + 1)
    single = os.path.join(single, "model.safetensors")
    shards = sorted(os.path.join(sharded, n) for n in os.listdir(sharded))
    results: dict[str, dict[str, float]] = {}
    for label, files, target in (("single file", [single], single),
                                 (f"{sum(n.endswith('.safetensors') for n in shards)} shards + index", shards, sharded)):
        size = sum(os.path.getsize(p) for p in files)
        t_cat = timed(lambda files=files: subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True),
                      args.runs)
        t_read = timed(lambda files=files: read_loop(files), args.runs)
        t_hash = timed(lambda files=files: sha_only(files), args.runs)
        t_verify = timed(lambda target=target: verify(target), args.runs)
        results[label] = {"GB": size / 1e9, "cat GB/s": size / t_cat / 1e9, "read loop GB/s": size / t_read / 1e9,
                          "hashlib.file_digest (1 thread) GB/s": size / t_hash / 1e9,
                          "verify GB/s": size / t_verify / 1e9, "verify / cat": t_cat / t_verify,
                          "read loop / cat": t_cat / t_read}
    t_against = timed(lambda: verify(sharded, against=single), args.runs)
    size_sharded = sum(os.path.getsize(p) for p in shards)
    results["shards --against single"] = {"verify --against GB/s": size_sharded / t_against / 1e9}
    print(json.dumps({"cpus": os.cpu_count(), "runs": args.runs, **results}, indent=2))


if __name__ == "__main__":
    main()
