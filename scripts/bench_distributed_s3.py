#!/usr/bin/env python3
"""Benchmark ``torchrun -m shardkit convert s3://A s3://B`` with 2 ranks against one process, on SeaweedFS.

The source is one safetensors object of random fp16 bytes (``--size-mb``, in 64 MiB tensors) in a
local SeaweedFS (scripts/s3_server.py); each case converts it into a fresh prefix with
``--max-shard-size`` (default 300MB), in a fresh process, ``--runs`` times interleaved (median).
Peak RSS is the largest single process's (``RUSAGE_CHILDREN``). Every output's manifest (which
holds every tensor's crc32) and object sizes are checked equal to the first one-process output.

    .venv/bin/python scripts/bench_distributed_s3.py --size-mb 1024 --runs 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from benchlib import machine_line, measure  # noqa: E402
from s3_server import SeaweedS3, weed_unavailable  # noqa: E402

BUCKET = "bench"


def _build_source(path: str, size_mb: int) -> None:
    import torch
    from safetensors.torch import save_file

    tensors = {}
    for i in range(max(1, size_mb // 64)):
        tensors[f"layers.{i}.weight"] = torch.empty(64 << 20, dtype=torch.uint8).random_(0, 120).view(torch.float16)
    save_file(tensors, path)


def _outputs(client, prefix: str) -> tuple[dict[str, int], bytes]:  # noqa: ANN001 - a boto3 client
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/")
    sizes = {o["Key"][len(prefix) + 1:]: o["Size"] for page in pages for o in page.get("Contents", [])}
    manifest = client.get_object(Bucket=BUCKET, Key=f"{prefix}/shardkit.manifest.json")["Body"].read()
    return sizes, manifest


def _delete(client, prefix: str) -> None:  # noqa: ANN001
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/")
    keys = [{"Key": o["Key"]} for page in pages for o in page.get("Contents", [])]
    if keys:
        client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-shard-size", default="300MB")
    args = parser.parse_args()
    reason = weed_unavailable()
    if reason:
        raise SystemExit(reason)
    with tempfile.TemporaryDirectory(prefix="bench-dist-s3-") as work:
        os.mkdir(os.path.join(work, "weed"))
        server = SeaweedS3(os.path.join(work, "weed")).start()
        try:
            os.environ.update(server.client_env())
            client = server.client()
            client.create_bucket(Bucket=BUCKET)
            source = os.path.join(work, "model.safetensors")
            _build_source(source, args.size_mb)
            client.upload_file(source, BUCKET, "src/model.safetensors")
            size_bytes = os.path.getsize(source)
            os.remove(source)
            py = sys.executable
            cases = {
                "shardkit convert, 1 process": f"{py} -m shardkit convert",
                "torchrun, 2 ranks": f"{py} -m torch.distributed.run --standalone --nproc-per-node 2 -m shardkit convert",
            }
            times: dict[str, list[float]] = {name: [] for name in cases}
            rss: dict[str, list[float]] = {name: [] for name in cases}
            reference = None
            for run in range(args.runs):
                for j, (name, command) in enumerate(cases.items()):
                    prefix = f"out{run}-{j}"
                    seconds, rss_mb = measure(f"{command} s3://{BUCKET}/src s3://{BUCKET}/{prefix} "
                                              f"--max-shard-size {args.max_shard_size}")
                    got = _outputs(client, prefix)
                    reference = reference or got
                    if got != reference:
                        raise SystemExit(f"{name}: the output differs from the first one-process output")
                    _delete(client, prefix)
                    times[name].append(seconds)
                    rss[name].append(rss_mb)
                    print(f"run {run + 1} {name}: {seconds:.2f} s, {rss_mb:.0f} MB", flush=True)
            print(machine_line())
            print(f"load average at the end: {os.getloadavg()}")
            print(f"\n{size_bytes / 1e9:.2f} GB, --max-shard-size {args.max_shard_size}, {args.runs} runs\n")
            print("| case | runs s | median s | peak RSS MB (largest process) |\n|---|---|---:|---:|")
            for name in cases:
                runs_s = ", ".join(f"{t:.2f}" for t in times[name])
                print(f"| {name} | {runs_s} | {statistics.median(times[name]):.2f} | {max(rss[name]):.0f} |")
            client.close()
        finally:
            server.stop()


if __name__ == "__main__":
    main()
