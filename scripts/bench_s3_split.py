#!/usr/bin/env python3
"""``shardkit split s3://A s3://B``: streamed shards against the staged path (split to a local folder, then upload).

Starts SeaweedFS (scripts/s3_server.py) on loopback, builds a checkpoint of ``--size-mb`` random
bf16 bytes in ``--source-shard-mb`` shards and uploads it to ``s3://bench/src``, then runs

    shardkit split s3://bench/src s3://out-N/ckpt --max-shard-size 1GB

in a fresh process per case, interleaved, ``--runs`` rounds:

  streamed   this tree: each shard streamed into its multipart upload, no local copy
  staged     the tree given by ``--staged-src`` (a checkout from before streaming; ``git archive REV``),
             which splits into a staging folder under TMPDIR, then uploads it

Peak RSS is the child's own high-water mark (``VmHWM``, read at its exit), wall time is the whole CLI process. Every run writes
into a new bucket, deleted afterwards (SeaweedFS frees a bucket's volumes with it); the output
objects' names and sizes, and the manifest's bytes (every tensor's crc32), are checked equal
across runs and cases.

    git archive 396671a | (mkdir -p /tmp/staged && tar -x -C /tmp/staged)
    python scripts/bench_s3_split.py --size-mb 6144 --runs 3 --staged-src /tmp/staged
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchlib import HERE, ROOT, machine_line, markdown, median, parser, rank_peaks_mb, rounds
from build_checkpoint import build_random
from s3_server import SeaweedS3


def run_case(case: str, src: str, dst: str, env: dict[str, str], staged_src: str | None) -> dict[str, float]:
    """One CLI split in a fresh process: wall seconds, peak RSS MB of that process."""
    path = staged_src if case == "staged" else ROOT
    with tempfile.TemporaryDirectory(prefix="bench-rss-") as rss:
        child_env = {**os.environ, **env, "PYTHONPATH": path, "BENCH_RSS_DIR": rss}
        start = time.perf_counter()
        done = subprocess.run([sys.executable, os.path.join(HERE, "benchlib.py"), "--shardkit", "split", src, dst,
                               "--max-shard-size", "1GB"], env=child_env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, cwd=path, timeout=3600)
        seconds = time.perf_counter() - start
        if done.returncode != 0:
            raise SystemExit(f"{case} failed ({done.returncode}): {done.stderr.decode()[-2000:]}")
        return {"seconds": seconds, "rss_mb": rank_peaks_mb(rss)[0]}


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    p = parser(__doc__, output=False)
    p.add_argument("--size-mb", type=int, default=6144)
    p.add_argument("--source-shard-mb", type=int, default=2048)
    p.add_argument("--staged-src", default=None, help="a shardkit tree from before streaming (the staged case)")
    p.add_argument("--dir", default=None, help="where SeaweedFS keeps its data (needs ~2x the size)")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, _interrupt)  # stop the server and remove its data on a plain kill too
    expected: list[Any] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as work, SeaweedS3(os.path.join(work, "weed")) as server:
        local = os.path.join(work, "src")
        build_random(local, size_bytes=args.size_mb << 20, shard_bytes=args.source_shard_mb << 20, manifest=False)
        server.upload(local, "bench", "src")
        shutil.rmtree(local)
        print(f"source uploaded: {args.size_mb} MB; load average {os.getloadavg()[0]:.2f}", flush=True)
        env, count = server.client_env(), [0]

        def one(case: str, r: int) -> dict[str, float]:
            count[0] += 1
            bucket = f"out-{count[0]}"
            client = server.client()
            client.create_bucket(Bucket=bucket)
            data = run_case(case, "s3://bench/src", f"s3://{bucket}/ckpt", env, args.staged_src)
            manifest = client.get_object(Bucket=bucket, Key="ckpt/shardkit.manifest.json")["Body"].read()
            client.close()
            got = (server.objects(bucket), manifest)
            expected[:] = expected or [got]
            if got != expected[0]:
                raise SystemExit(f"{case}: the output differs from the first run's (names, sizes or manifest)")
            server.drop(bucket)
            print(f"  run {r + 1}/{args.runs} {case:>9}: {data['seconds']:.1f} s, peak RSS {data['rss_mb']:.0f} MB, "
                  f"load average {os.getloadavg()[0]:.2f}", flush=True)
            return data

        results = rounds(["streamed", "staged"] if args.staged_src else ["streamed"], args.runs, one)
    shards = sum(1 for key in expected[0][0] if key.endswith(".safetensors"))
    rows = [[case, ", ".join(f"{v['seconds']:.1f}" for v in values), f"{median(v['seconds'] for v in values):.1f}",
             f"{(args.size_mb << 20) / median(v['seconds'] for v in values) / 1e6:.0f}",
             f"{max(v['rss_mb'] for v in values):.0f}"] for case, values in results.items()]
    print(f"\nMachine: {machine_line()}, load average {os.getloadavg()[0]:.2f} at the end.\n"
          f"`shardkit split s3://bench/src s3://out/ckpt --max-shard-size 1GB`: {args.size_mb} MiB of random bf16 "
          f"in {args.source_shard_mb} MiB source shards → {shards} shards; SeaweedFS on loopback; fresh process "
          f"each, interleaved, median of {args.runs}.\n")
    print(markdown(["case", "wall s (runs)", "median s", "MB/s", "peak RSS MB (max)"], rows, align="llrrr"))


if __name__ == "__main__":
    main()
