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

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The CLI, then its peak RSS (VmHWM: this process's own high-water mark since exec). ru_maxrss from
# wait4/getrusage would not do: Linux carries the forking parent's RSS over into the child's.
CLI = """import atexit, os, sys
def peak():
    with open("/proc/self/status") as f:
        kb = next(line.split()[1] for line in f if line.startswith("VmHWM:"))
    with open(os.environ["BENCH_RSS_FILE"], "w") as out:
        out.write(kb)
atexit.register(peak)
from shardkit.cli import main
sys.argv[0] = "shardkit"
main()
"""


def make_source(folder: str, size_mb: int, shard_mb: int) -> list[str]:
    """A sharded checkpoint of random bf16 tensors (64 MiB each), written shard by shard; its file names."""
    import torch
    from safetensors.torch import save_file

    tensor_bytes = 64 << 20
    count = max(1, (size_mb << 20) // tensor_bytes)
    per_shard = max(1, (shard_mb << 20) // tensor_bytes)
    shards = -(-count // per_shard)
    gen = torch.Generator().manual_seed(0)
    weight_map, names = {}, []
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {f"layers.{i:04d}.weight": torch.randn(4096, tensor_bytes // 8192, generator=gen).bfloat16()
                   for i in range(s * per_shard, min(count, (s + 1) * per_shard))}
        save_file(tensors, os.path.join(folder, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        names.append(name)
        del tensors
    index = {"metadata": {"total_size": count * tensor_bytes}, "weight_map": weight_map}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    return [*names, "model.safetensors.index.json"]


def run_case(case: str, src: str, dst: str, env: dict[str, str], staged_src: str | None) -> tuple[float, float]:
    """One CLI split in a fresh process: (wall seconds, peak RSS MB of that process)."""
    path = staged_src if case == "staged" else ROOT
    with tempfile.NamedTemporaryFile(prefix="bench-rss-") as rss:
        child_env = {**os.environ, **env, "PYTHONPATH": path, "BENCH_RSS_FILE": rss.name}
        cmd = [sys.executable, "-c", CLI, "split", src, dst, "--max-shard-size", "1GB"]
        start = time.perf_counter()
        done = subprocess.run(cmd, env=child_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=path,
                              timeout=3600)
        seconds = time.perf_counter() - start
        if done.returncode != 0:
            raise SystemExit(f"{case} failed ({done.returncode}): {done.stderr.decode()[-2000:]}")
        return seconds, int(open(rss.name).read()) / 1024


def listing(client: object, bucket: str) -> tuple[list[tuple[str, int]], bytes]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)  # type: ignore[attr-defined]
    objects = sorted((o["Key"], o["Size"]) for page in pages for o in page.get("Contents", []))
    manifest = client.get_object(Bucket=bucket, Key="ckpt/shardkit.manifest.json")["Body"].read()  # type: ignore[attr-defined]
    return objects, manifest


def drop_bucket(client: object, bucket: str) -> None:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)  # type: ignore[attr-defined]
    for page in pages:
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys})  # type: ignore[attr-defined]
    client.delete_bucket(Bucket=bucket)  # type: ignore[attr-defined]


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=int, default=6144)
    parser.add_argument("--source-shard-mb", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--staged-src", default=None, help="a shardkit tree from before streaming (the staged case)")
    parser.add_argument("--dir", default=None, help="where SeaweedFS keeps its data (needs ~2x the size)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _interrupt)  # stop the server and remove its data on a plain kill too
    cases = ["streamed", "staged"] if args.staged_src else ["streamed"]

    from benchlib import machine_line
    from s3_server import SeaweedS3

    results: dict[str, list[tuple[float, float]]] = {}
    expected: tuple[list[tuple[str, int]], bytes] | None = None
    with tempfile.TemporaryDirectory(dir=args.dir) as work, SeaweedS3(os.path.join(work, "weed")) as server:
        client = server.client()
        client.create_bucket(Bucket="bench")  # type: ignore[attr-defined]
        local = os.path.join(work, "src")
        os.mkdir(local)
        for name in make_source(local, args.size_mb, args.source_shard_mb):
            client.upload_file(os.path.join(local, name), "bench", f"src/{name}")  # type: ignore[attr-defined]
            os.remove(os.path.join(local, name))
        print(f"source uploaded: {args.size_mb} MB; load average {os.getloadavg()[0]:.2f}", flush=True)
        env = server.client_env()
        n = 0
        for r in range(args.runs):
            for case in cases[r % 2:] + cases[:r % 2]:
                n += 1
                bucket = f"out-{n}"
                client.create_bucket(Bucket=bucket)  # type: ignore[attr-defined]
                seconds, rss = run_case(case, "s3://bench/src", f"s3://{bucket}/ckpt", env, args.staged_src)
                got = listing(client, bucket)
                if expected is None:
                    expected = got
                elif got != expected:
                    raise SystemExit(f"{case}: the output differs from the first run's (names, sizes or manifest)")
                drop_bucket(client, bucket)
                results.setdefault(case, []).append((seconds, rss))
                print(f"  run {r + 1}/{args.runs} {case:>9}: {seconds:.1f} s, peak RSS {rss:.0f} MB, "
                      f"load average {os.getloadavg()[0]:.2f}", flush=True)
        client.close()  # type: ignore[attr-defined]
    assert expected is not None
    shards = sum(1 for key, _ in expected[0] if key.endswith(".safetensors"))
    lines = [f"Machine: {machine_line()}, load average {os.getloadavg()[0]:.2f} at the end.",
             f"`shardkit split s3://bench/src s3://out/ckpt --max-shard-size 1GB`: {args.size_mb} MiB of random bf16 "
             f"in {args.source_shard_mb} MiB source shards → {shards} shards; SeaweedFS on loopback; fresh process "
             f"each, interleaved, median of {args.runs}.", "",
             "| case | wall s (runs) | median s | MB/s | peak RSS MB (max) |", "|---|---|---:|---:|---:|"]
    for case, values in results.items():
        med = statistics.median(v[0] for v in values)
        runs = ", ".join(f"{v[0]:.1f}" for v in values)
        lines.append(f"| {case} | {runs} | {med:.1f} | {(args.size_mb << 20) / med / 1e6:.0f} | "
                     f"{max(v[1] for v in values):.0f} |")
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
