#!/usr/bin/env python3
"""S3 → S3 reshard: server-side copies (UploadPartCopy) against download + split + upload (issue 33).

Starts SeaweedFS (scripts/s3_server.py) on loopback and the byte-counting delay proxy in this
parent process (``--delay-ms`` each way); every client request of every case goes through the
proxy, so its counters are the bytes that crossed the client. Builds a checkpoint of
``--size-mb`` random bf16 values in ``--shards`` shards (shardkit's own split, with its manifest),
uploads it, then reshards it into ``--out-shards`` shards with each case, interleaved, each in a
fresh process; the time starts after imports and ends when the index is published. Each output is
checked against the first case's (byte for byte, every object) and deleted after its run.

Cases:
  copy     ``shardkit.split("s3://.../src", "s3://.../out")``: composed by copies in the store
  staged   the same call with the copies switched off: shardkit's ranged GETs into a local staged
           split, then its multipart upload (what a store without UploadPartCopy gets)
  copy-N   copies with parts of N MiB (an A/B of the part size; the default is 512 MiB)
  boto3    download with s3transfer (``download_file``), ``shardkit.split`` locally, upload with
           s3transfer (``upload_file``): what users do today

    python scripts/bench_s3_copy.py --size-mb 1024 --runs 3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time

from benchlib import child, machine_line, markdown, median, peak_rss_mb, rounds
from build_checkpoint import build_random
from s3_server import DelayProxy, SeaweedS3

CASES = ["copy", "staged", "boto3"]
BUCKET = "bench"


def run_boto3(out_prefix: str, max_shard: int, work: str) -> None:
    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config

    import shardkit

    client = boto3.client("s3", config=Config(max_pool_connections=16, s3={"addressing_style": "path"}))
    config = TransferConfig(multipart_chunksize=16 << 20, max_concurrency=10)
    src, out = os.path.join(work, "src"), os.path.join(work, "out")
    os.makedirs(src)
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix="src/")
    for key in [o["Key"] for page in pages for o in page.get("Contents", [])]:
        client.download_file(BUCKET, key, os.path.join(src, key[len("src/"):]), Config=config)
    shardkit.split(src, out, max_shard_size=max_shard)
    for name in sorted(os.listdir(out)):
        client.upload_file(os.path.join(out, name), BUCKET, f"{out_prefix}/{name}", Config=config)


def run_child(case: str, out_prefix: str, max_shard: int, work: str) -> None:
    import shardkit
    import shardkit.api.checkpoints as checkpoints

    if case == "staged":
        checkpoints.copy_split = lambda *a, **k: None  # type: ignore[assignment]  # the path without copies
    if case.startswith("copy-"):  # an A/B of the copy part size: copy-128 = parts of 128 MiB
        import shardkit.api.store_copy as store_copy

        store_copy.COPY_PART_BYTES = int(case.removeprefix("copy-")) << 20
    start = time.perf_counter()
    cloned = 0
    if case == "boto3":
        run_boto3(out_prefix, max_shard, work)
    else:
        result = shardkit.split(f"s3://{BUCKET}/src", f"s3://{BUCKET}/{out_prefix}", max_shard_size=max_shard)
        cloned = result.cloned_bytes
    print(json.dumps({"seconds": time.perf_counter() - start, "rss_mb": peak_rss_mb(), "cloned": cloned}))


def digests(server: SeaweedS3, prefix: str) -> dict[str, str]:
    """sha256 of every object under ``prefix``/ (read back, then deleted)."""
    client = server.client()
    found = {}
    for key in sorted(server.objects(BUCKET, prefix + "/")):
        body = client.get_object(Bucket=BUCKET, Key=f"{prefix}/{key}")["Body"]
        h = hashlib.sha256()
        while chunk := body.read(8 << 20):
            h.update(chunk)
        found[key] = h.hexdigest()
    client.close()
    server.drop(BUCKET, prefix + "/")
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-mb", type=int, default=1024, help="checkpoint size in MiB (default 1024)")
    p.add_argument("--shards", type=int, default=5, help="source shards (default 5)")
    p.add_argument("--out-shards", type=int, default=2, help="output shards (default 2)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--delay-ms", type=float, default=1.0, help="proxy delay each way (default 1 ms)")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)  # CASE OUT_PREFIX MAX_SHARD WORK
    args = p.parse_args()
    if args.child:
        run_child(args.child[0], args.child[1], int(args.child[2]), args.child[3])
        return

    max_shard = -(-(args.size_mb << 20) // args.out_shards) + (1 << 20)
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(dir=args.dir) as work, SeaweedS3(os.path.join(work, "weed")) as server, \
            DelayProxy(server.port, delay_ms=args.delay_ms) as proxy:
        src = os.path.join(work, "src")
        build_random(src, size_bytes=args.size_mb << 20, shard_bytes=-(-(args.size_mb << 20) // args.shards),
                     tensor_bytes=32 << 20)
        with open(os.path.join(src, "config.json"), "w") as f:
            f.write('{"model_type": "bench"}\n')
        size = server.upload(src, BUCKET, "src")
        shutil.rmtree(src)
        reference: list[dict[str, str]] = []

        def one(case: str, r: int) -> dict[str, float]:
            scratch = tempfile.mkdtemp(dir=work)
            before = proxy.sent_bytes + proxy.received_bytes
            data = child(__file__, "--child", case, f"out-{case}-{r}", str(max_shard), scratch,
                         env=server.client_env(port=proxy.port), timeout=1200)
            data["moved"] = proxy.sent_bytes + proxy.received_bytes - before
            shutil.rmtree(scratch)
            got = digests(server, f"out-{case}-{r}")
            reference[:] = reference or [got]
            if got != reference[0]:
                raise SystemExit(f"{case}: its output differs from the first case's: {got} != {reference[0]}")
            load.append(os.getloadavg()[0])
            print(f"  run {r + 1}/{args.runs} {case:>7}: {data['seconds']:.2f} s, through the client "
                  f"{data['moved'] / 1e6:.1f} MB ({100 * data['moved'] / size:.2f}%), copied in the store "
                  f"{data['cloned'] / 1e6:.0f} MB, {data['rss_mb']:.0f} MB RSS, load {load[-1]:.2f}", flush=True)
            return data

        results = rounds(args.cases.split(","), args.runs, one)
    rows = []
    for case, values in results.items():
        moved = median(v["moved"] for v in values)
        rows.append([case, f"{median(v['seconds'] for v in values):.2f}", ", ".join(f"{v['seconds']:.2f}" for v in values),
                     f"{moved / 1e6:.1f} MB", f"{100 * moved / size:.2f}%", f"{max(v['cloned'] for v in values) / 1e6:.0f} MB",
                     f"{max(v['rss_mb'] for v in values):.0f}"])
    print(f"\nMachine: {machine_line()}; load average (1 min) {min(load):.1f}-{max(load):.1f} during the run.\n"
          f"A {size / 1e6:.0f} MB checkpoint of random bf16 tensors in {args.shards} shards resharded into "
          f"{args.out_shards} on SeaweedFS, every request through the counting proxy ({args.delay_ms:g} ms each "
          f"way); median of {args.runs}, interleaved, fresh process each; outputs identical byte for byte.\n")
    print(markdown(["case", "median s", "runs s", "bytes through the client", "% of the checkpoint",
                    "copied in the store", "peak RSS MB"], rows, align="lrlrrrr"))


if __name__ == "__main__":
    sys.exit(main())
