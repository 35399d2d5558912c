#!/usr/bin/env python3
"""S3 → S3 reshard: server-side copies (UploadPartCopy) against download + split + upload (issue 33).

Starts SeaweedFS (scripts/s3_server.py) on loopback and the byte-counting delay proxy in this
parent process (``--delay-ms`` each way); every client request of every case goes through the
proxy, so its counters are the bytes that crossed the client. Builds a checkpoint of
``--size-mb`` random bf16 bytes in ``--shards`` shards (shardkit's own split, with its manifest),
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
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CASES = ["copy", "staged", "boto3"]
BUCKET = "bench"


# ----------------------------------------------------------------------------- the child: one reshard

def _boto3_client():  # noqa: ANN202
    import boto3
    from botocore.config import Config

    return boto3.client("s3", config=Config(max_pool_connections=16, s3={"addressing_style": "path"}))


def run_boto3(out_prefix: str, max_shard: int, work: str) -> None:
    from boto3.s3.transfer import TransferConfig

    import shardkit

    client = _boto3_client()
    config = TransferConfig(multipart_chunksize=16 << 20, max_concurrency=10)
    src, out = os.path.join(work, "src"), os.path.join(work, "out")
    os.makedirs(src)
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix="src/")
    for key in [o["Key"] for page in pages for o in page.get("Contents", [])]:
        client.download_file(BUCKET, key, os.path.join(src, key[len("src/"):]), Config=config)
    shardkit.split(src, out, max_shard_size=max_shard)
    for name in sorted(os.listdir(out)):
        client.upload_file(os.path.join(out, name), BUCKET, f"{out_prefix}/{name}", Config=config)


def child(case: str, out_prefix: str, max_shard: int, work: str) -> None:
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
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "rss_mb": peak_rss_mb(), "cloned": cloned}))


def peak_rss_mb() -> float:
    """This process's peak RSS since its exec (``VmHWM``; ``ru_maxrss`` would include the parent's at the fork)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ----------------------------------------------------------------------------- the parent

def build(server, work: str, size_mb: int, shards: int) -> int:  # noqa: ANN001
    """A checkpoint of random bf16 tensors (32 MiB each but the last), split into ``shards``, uploaded to src/."""
    import torch
    from safetensors.torch import save_file

    import shardkit

    single = os.path.join(work, "single")
    os.makedirs(single)
    total, state, i = size_mb << 20, {}, 0
    while total > 0:
        nbytes = min(32 << 20, total)
        state[f"layers.{i:03d}.weight"] = torch.frombuffer(bytearray(os.urandom(nbytes)), dtype=torch.bfloat16)
        total -= nbytes
        i += 1
    save_file(state, os.path.join(single, "model.safetensors"))
    del state
    with open(os.path.join(single, "config.json"), "w") as f:
        f.write('{"model_type": "bench"}\n')
    src = os.path.join(work, "src")
    shardkit.split(single, src, max_shard_size=-(-(size_mb << 20) // shards))
    shutil.rmtree(single)
    client = server.client()
    client.create_bucket(Bucket=BUCKET)
    uploaded = 0
    for name in sorted(os.listdir(src)):
        client.upload_file(os.path.join(src, name), BUCKET, f"src/{name}")
        uploaded += os.path.getsize(os.path.join(src, name))
    client.close()
    shutil.rmtree(src)
    return uploaded


def digests(server, prefix: str) -> dict[str, str]:  # noqa: ANN001
    client = server.client()
    found = {}
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/")
    for key in sorted(o["Key"] for page in pages for o in page.get("Contents", [])):
        body = client.get_object(Bucket=BUCKET, Key=key)["Body"]
        h = hashlib.sha256()
        while chunk := body.read(8 << 20):
            h.update(chunk)
        found[key[len(prefix) + 1:]] = h.hexdigest()
        client.delete_object(Bucket=BUCKET, Key=key)
    client.close()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=int, default=1024, help="checkpoint size in MiB (default 1024)")
    parser.add_argument("--shards", type=int, default=5, help="source shards (default 5)")
    parser.add_argument("--out-shards", type=int, default=2, help="output shards (default 2)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--delay-ms", type=float, default=1.0, help="proxy delay each way (default 1 ms)")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out-prefix", help=argparse.SUPPRESS)
    parser.add_argument("--max-shard", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.out_prefix, args.max_shard, args.work)
        return

    from benchlib import machine_line
    from s3_server import DelayProxy, SeaweedS3

    cases = args.cases.split(",")
    max_shard = -(-(args.size_mb << 20) // args.out_shards) + (1 << 20)
    results: dict[str, list[tuple[float, float, int, int]]] = {}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(dir=args.dir) as work, SeaweedS3(os.path.join(work, "weed")) as server, \
            DelayProxy(server.port, delay_ms=args.delay_ms) as proxy:
        size = build(server, work, args.size_mb, args.shards)
        env = {**os.environ, **server.client_env(port=proxy.port)}
        reference: dict[str, str] | None = None
        for r in range(args.runs):
            for case in cases[r % len(cases):] + cases[:r % len(cases)]:
                scratch = tempfile.mkdtemp(dir=work)
                before = proxy.sent_bytes + proxy.received_bytes
                cmd = [sys.executable, os.path.abspath(__file__), "--child", case, "--out-prefix", f"out-{case}-{r}",
                       "--max-shard", str(max_shard), "--work", scratch]
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
                if done.returncode != 0:
                    raise SystemExit(f"{case} failed: {done.stderr.strip()[-2000:]}")
                moved = proxy.sent_bytes + proxy.received_bytes - before
                shutil.rmtree(scratch)
                data = json.loads(done.stdout.strip().splitlines()[-1])
                got = digests(server, f"out-{case}-{r}")
                reference = reference or got
                if got != reference:
                    raise SystemExit(f"{case}: its output differs from the first case's: {got} != {reference}")
                results.setdefault(case, []).append((data["seconds"], data["rss_mb"], moved, data["cloned"]))
                load.append(os.getloadavg()[0])
                print(f"  run {r + 1}/{args.runs} {case:>7}: {data['seconds']:.2f} s, through the client "
                      f"{moved / 1e6:.1f} MB ({100 * moved / size:.2f}%), copied in the store {data['cloned'] / 1e6:.0f} MB, "
                      f"{data['rss_mb']:.0f} MB RSS, load {load[-1]:.2f}", flush=True)
    lines = [f"Machine: {machine_line()}; load average (1 min) {min(load):.1f}-{max(load):.1f} during the run.",
             f"A {size / 1e6:.0f} MB checkpoint of random bf16 tensors in {args.shards} shards resharded into "
             f"{args.out_shards} on SeaweedFS, every request through the counting proxy ({args.delay_ms:g} ms each "
             f"way); median of {args.runs}, interleaved, fresh process each; outputs identical byte for byte.", "",
             "| case | median s | runs s | bytes through the client | % of the checkpoint | copied in the store | "
             "peak RSS MB |", "|---|---:|---|---:|---:|---:|---:|"]
    for case, values in results.items():
        med = statistics.median(v[0] for v in values)
        moved = statistics.median(v[2] for v in values)
        lines.append(f"| {case} | {med:.2f} | {', '.join(f'{v[0]:.2f}' for v in values)} | {moved / 1e6:.1f} MB | "
                     f"{100 * moved / size:.2f}% | {max(v[3] for v in values) / 1e6:.0f} MB | "
                     f"{max(v[1] for v in values):.0f} |")
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
