#!/usr/bin/env python3
"""``shardkit.open`` (all tensors) from ``s3://`` against the raw parallel ranged GET of the same bytes (issue 33).

Starts SeaweedFS (scripts/s3_server.py) on loopback, splits a checkpoint of ``--size-mb`` random
fp16 bytes into ``--shard-mb`` shards and uploads them, then in a fresh process per case reads
every tensor byte once into memory allocated once:

  raw-boto3      the floor: boto3 get_object(Range=...) of every shard object whole, ``--parts``
                 requests of ``--part-mb`` in flight on a thread pool, straight into one buffer per object
  shardkit-open  ``shardkit.open("s3://...").to_state_dict()`` (header-only mirror, then the read plan
                 through the store's ranged reads)

straight to the server and through the delay proxy (``--delay-ms`` each way). The time starts
after the imports and ends when the last byte is in memory (the shardkit case includes building
the header-only mirror: one ranged GET per shard plus the index); bytes checked by crc32 against
the local files. Cases run interleaved, ``--runs`` rounds; the table shows medians and peak RSS.

    python scripts/bench_s3_open.py --size-mb 1024 --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CASES = ["raw-boto3", "shardkit-open"]
READ_SECONDS = 0.0  # the shardkit case: to_state_dict alone, after the store and the mirror are open
PREFIX = "ckpt"


def read_raw(bucket: str, part: int, parts: int) -> tuple[float, int]:
    from concurrent.futures import ThreadPoolExecutor

    import boto3
    from botocore.config import Config

    client = boto3.client("s3", config=Config(max_pool_connections=parts, s3={"addressing_style": "path"}))
    objects = [(o["Key"], o["Size"]) for o in client.list_objects_v2(Bucket=bucket, Prefix=PREFIX + "/")["Contents"]
               if o["Key"].endswith(".safetensors")]
    start = time.perf_counter()
    buffers = {key: memoryview(bytearray(size)) for key, size in objects}

    def get(job: tuple[str, int, int]) -> None:
        key, begin, end = job
        body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={begin}-{end - 1}")["Body"]
        view, got = buffers[key][begin:end], 0
        while got < len(view):
            n = body.readinto(view[got:got + (1 << 20)])
            if not n:
                raise OSError(f"short read of {key} at {begin + got}")
            got += n

    jobs = [(key, b, min(b + part, size)) for key, size in objects for b in range(0, size, part)]
    with ThreadPoolExecutor(parts) as pool:
        list(pool.map(get, jobs))
    seconds = time.perf_counter() - start
    crc = 0
    for key, _ in sorted(objects):
        crc = zlib.crc32(buffers[key], crc)
    return seconds, crc


def read_shardkit(bucket: str) -> tuple[float, int]:
    import boto3  # noqa: F401 - imported before the clock starts, as in the raw case
    import torch  # noqa: F401

    import shardkit
    import shardkit.api.stores
    import shardkit.hub.remote  # noqa: F401

    start = time.perf_counter()
    with shardkit.open(f"s3://{bucket}/{PREFIX}") as ckpt:
        opened = time.perf_counter()
        state = ckpt.to_state_dict()
        seconds = time.perf_counter() - start
    global READ_SECONDS
    READ_SECONDS = seconds - (opened - start)
    crc = 0
    for name in sorted(state):
        crc = zlib.crc32(state[name].contiguous().view(-1).view(__import__("torch").uint8).numpy(), crc)
    return seconds, crc


def child(case: str, bucket: str, part: int, parts: int) -> None:
    seconds, crc = read_raw(bucket, part, parts) if case == "raw-boto3" else read_shardkit(bucket)
    print(json.dumps({"seconds": seconds, "crc": crc, "read_seconds": READ_SECONDS or seconds,
                      "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def make_checkpoint(folder: str, size_mb: int, shard_mb: int) -> tuple[int, int]:
    """A random fp16 checkpoint split into shards; returns (tensor bytes, crc32 of the tensors in name order)."""
    import torch
    from safetensors.torch import save_file

    import shardkit

    gen = torch.Generator().manual_seed(0)
    tensors = {f"layers.{i:03d}.weight": torch.randn(2048, 4096, generator=gen).half()
               for i in range(max(1, (size_mb << 20) // (2048 * 4096 * 2)))}
    save_file(tensors, os.path.join(folder, "one.safetensors"))
    shardkit.split(os.path.join(folder, "one.safetensors"), os.path.join(folder, PREFIX), max_shard_size=f"{shard_mb}MB")
    os.remove(os.path.join(folder, "one.safetensors"))
    crc = 0
    for name in sorted(tensors):
        crc = zlib.crc32(tensors[name].view(-1).view(torch.uint8).numpy(), crc)
    return sum(t.nbytes for t in tensors.values()), crc


def shard_crc(folder: str) -> int:
    crc = 0
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with open(os.path.join(folder, name), "rb") as f:
                crc = zlib.crc32(f.read(), crc)
    return crc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--shard-mb", type=int, default=300)
    parser.add_argument("--part-mb", type=int, default=16, help="raw case: bytes per ranged GET, MiB")
    parser.add_argument("--parts", type=int, default=16, help="raw case: requests in flight")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--delay-ms", type=float, default=1.0)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--bucket", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.bucket, args.part_mb << 20, args.parts)
        return

    from benchlib import machine_line
    from s3_server import DelayProxy, SeaweedS3

    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    reads: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as work, SeaweedS3(os.path.join(work, "weed")) as server, \
            DelayProxy(server.port, delay_ms=args.delay_ms) as proxy:
        data_bytes, tensor_crc = make_checkpoint(work, args.size_mb, args.shard_mb)
        expected = {"raw-boto3": shard_crc(os.path.join(work, PREFIX)), "shardkit-open": tensor_crc}
        client = server.client()
        client.create_bucket(Bucket="bench")  # type: ignore[attr-defined]
        for name in sorted(os.listdir(os.path.join(work, PREFIX))):
            client.upload_file(os.path.join(work, PREFIX, name), "bench", f"{PREFIX}/{name}")  # type: ignore[attr-defined]
        client.close()  # type: ignore[attr-defined]
        paths = {"loopback": server.client_env(), f"proxy {args.delay_ms:g} ms": server.client_env(port=proxy.port)}
        for r in range(args.runs):
            for path, env in paths.items():
                for case in CASES[r % 2:] + CASES[:r % 2]:
                    cmd = [sys.executable, os.path.abspath(__file__), "--child", case, "--bucket", "bench",
                           "--part-mb", str(args.part_mb), "--parts", str(args.parts)]
                    done = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
                    if done.returncode != 0:
                        raise SystemExit(f"{case} failed: {done.stderr.strip()[-2000:]}")
                    data = json.loads(done.stdout.strip().splitlines()[-1])
                    if data["crc"] != expected[case]:
                        raise SystemExit(f"{case}: the bytes read differ from the checkpoint's")
                    results.setdefault((path, case), []).append((data["seconds"], data["rss_mb"]))
                    reads.setdefault((path, case), []).append(data["read_seconds"])
                    print(f"  run {r + 1}/{args.runs} {path:>14} {case:>14}: {data['seconds']:.2f} s, "
                          f"{data_bytes / data['seconds'] / 1e9:.2f} GB/s, {data['rss_mb']:.0f} MB", flush=True)
    lines = [f"Machine: {machine_line()}, load average {os.getloadavg()[0]:.2f} at the end.",
             f"{data_bytes / 1e6:.0f} MB of fp16 tensors in {args.shard_mb} MB shards on SeaweedFS, median of "
             f"{args.runs}, fresh process each (time after imports). raw-boto3: {args.parts} ranged GETs of "
             f"{args.part_mb} MiB in flight.", "",
             "The read column: the shardkit case less opening the store (two boto3 clients, a HEAD of the bucket) "
             "and building the header-only mirror; the raw case creates its client before its clock starts.", "",
             "| path | case | median s | GB/s | vs raw | read only s | read vs raw | peak RSS MB |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for (path, case), values in results.items():
        med = statistics.median(v[0] for v in values)
        raw = statistics.median(v[0] for v in results[(path, "raw-boto3")])
        read = statistics.median(reads[(path, case)])
        lines.append(f"| {path} | {case} | {med:.2f} | {data_bytes / med / 1e9:.2f} | {med / raw:.2f}x | "
                     f"{read:.2f} | {read / raw:.2f}x | {max(v[1] for v in values):.0f} |")
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
