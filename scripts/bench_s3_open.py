#!/usr/bin/env python3
"""``shardkit.open`` and ``load_model`` from ``s3://`` against the Run:ai Model Streamer and the raw limit (issue 33).

Starts SeaweedFS (scripts/s3_server.py) on loopback and uploads a checkpoint: by default the SD 1.5
UNet in fp16 built from its config with random weights (one 1.72 GB safetensors file and its
config.json, as published); ``--model random`` gives ``--size-mb`` of fp16 tensors in
``--shard-mb`` shards instead. Then, in a fresh process per case, every tensor byte is read once
into memory, straight to the server and through the delay proxy (``--delay-ms`` each way):

  raw-boto3       the limit: boto3 get_object(Range=...) of every safetensors object whole, ``--parts``
                  requests of ``--part-mb`` in flight on a thread pool, straight into one buffer per object
  runai           the Run:ai Model Streamer: SafetensorsStreamer().stream_file(s3://...), every tensor
                  of get_tensors() kept (its buffer holds the whole file: the tensors stay valid)
  shardkit-open   shardkit.open("s3://...").to_state_dict()
  load-model      shardkit.load_model("diffusers:UNet2DConditionModel", "s3://...") (sd15 only): the
                  skeleton built from the bucket's config.json, every parameter filled
  download+load   boto3 download_file (s3transfer, 10 threads) to a local file, then
                  safetensors.torch.load_file of it (the file is removed after)

Every case's clock starts after its imports (boto3, torch, diffusers, the streamer) and includes
what the case must make: clients, the streamer, the store and its header-only mirror. ``setup s``
is that part (the raw case's client; shardkit's store and mirror), ``read s`` the rest. Bytes are
checked by crc32 of every tensor in name order (raw: of the objects). Cases run interleaved,
``--runs`` rounds, order rotating; the table shows medians, peak RSS (the child's own ``VmHWM``)
and the 1-minute load average at the start and end of each round.

The streamer is a benchmark-only dependency: ``pip install 'shardkit[bench]'`` (or
``pip install runai-model-streamer runai-model-streamer-s3``); without it the runai case is left
out with a note.

    python scripts/bench_s3_open.py --runs 3 --delay-ms 1
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import tempfile
import time
import zlib
from typing import Any

from bench_s3 import boto3_client, get_range_into
from benchlib import child, machine_line, median, peak_rss_mb, rotated, shard_files
from build_checkpoint import build_random, build_unet
from s3_server import DelayProxy, SeaweedS3

CASES = ["raw-boto3", "runai", "shardkit-open", "load-model", "download+load"]
PREFIX = "ckpt"
RUNAI_MISSING = ("the Run:ai streamer is not installed: pip install 'shardkit[bench]' "
                 "(runai-model-streamer runai-model-streamer-s3); its case is left out")


# ----------------------------------------------------------------------------- the child: one case

def _tensor_crc(state: dict[str, Any]) -> int:
    import torch

    crc = 0
    for name in sorted(state):
        crc = zlib.crc32(state[name].detach().contiguous().view(-1).view(torch.uint8).numpy(), crc)
    return crc


def _import_readers() -> None:
    """shardkit's s3:// reading modules, imported before the clock starts (wherever they live in this tree)."""
    for name in ("shardkit.api.stores", "shardkit.stores.s3", "shardkit.stores.hf", "shardkit.hub.remote"):
        with contextlib.suppress(ModuleNotFoundError):
            importlib.import_module(name)


def _objects(client: Any, bucket: str) -> list[tuple[str, int]]:
    listing = client.list_objects_v2(Bucket=bucket, Prefix=PREFIX + "/")
    return sorted((o["Key"], o["Size"]) for o in listing["Contents"] if o["Key"].endswith(".safetensors"))


def read_raw(bucket: str, part: int, parts: int) -> tuple[float, float, int]:
    from concurrent.futures import ThreadPoolExecutor

    import boto3  # noqa: F401 - imported before the clock starts: the client is part of the setup, not its import
    import numpy

    start = time.perf_counter()
    client = boto3_client(parts)
    objects = _objects(client, bucket)
    ready = time.perf_counter()
    # numpy.empty, as torch.empty in the other cases: bytearray(n) would first write n zero bytes
    buffers = {key: memoryview(numpy.empty(size, dtype=numpy.uint8)) for key, size in objects}
    jobs = [(key, b, min(b + part, size)) for key, size in objects for b in range(0, size, part)]
    with ThreadPoolExecutor(parts) as pool:
        list(pool.map(lambda j: get_range_into(client, bucket, j[0], j[1], buffers[j[0]][j[1]:j[2]]), jobs))
    end = time.perf_counter()
    client.close()
    crc = 0
    for key, _ in objects:
        crc = zlib.crc32(buffers[key], crc)
    return end - start, ready - start, crc


def read_runai(bucket: str) -> tuple[float, float, int]:
    import boto3
    from runai_model_streamer import SafetensorsStreamer

    client = boto3.client("s3")  # only to list the objects, before the clock
    keys = [key for key, _ in _objects(client, bucket)]
    client.close()
    start = time.perf_counter()
    state = {}
    with SafetensorsStreamer() as streamer:
        ready = time.perf_counter()
        streamer.stream_files([f"s3://{bucket}/{key}" for key in keys])
        for name, tensor in streamer.get_tensors():
            state[name] = tensor
        end = time.perf_counter()
        crc = _tensor_crc(state)
    return end - start, ready - start, crc


def read_shardkit(bucket: str) -> tuple[float, float, int]:
    import boto3  # noqa: F401 - imported before the clock starts, as in the raw case
    import torch  # noqa: F401

    import shardkit

    _import_readers()

    start = time.perf_counter()
    with shardkit.open(f"s3://{bucket}/{PREFIX}") as ckpt:
        ready = time.perf_counter()
        state = ckpt.to_state_dict()
        end = time.perf_counter()
    return end - start, ready - start, _tensor_crc(state)


def read_load_model(bucket: str) -> tuple[float, float, int]:
    import boto3  # noqa: F401
    import diffusers  # noqa: F401
    import torch  # noqa: F401
    from diffusers import UNet2DConditionModel  # noqa: F401 - the class import is part of the imports

    import shardkit

    _import_readers()

    start = time.perf_counter()
    model = shardkit.load_model("diffusers:UNet2DConditionModel", f"s3://{bucket}/{PREFIX}", dtype="fp16")
    end = time.perf_counter()
    return end - start, 0.0, _tensor_crc(dict(model.state_dict()))


def read_download(bucket: str) -> tuple[float, float, int]:
    import boto3
    import torch  # noqa: F401
    from safetensors.torch import load_file

    state = {}
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        client = boto3.client("s3")
        objects = _objects(client, bucket)
        ready = time.perf_counter()
        for key, _ in objects:
            local = os.path.join(tmp, key.rpartition("/")[2])
            client.download_file(bucket, key, local)
            state.update(load_file(local))
        end = time.perf_counter()
        client.close()
    return end - start, ready - start, _tensor_crc(state)


def time_opens(bucket: str, opens: int) -> list[float]:
    """Seconds of each of ``opens`` successive ``shardkit.open(...)`` + close in this process (headers only)."""
    import boto3  # noqa: F401
    import torch  # noqa: F401

    import shardkit

    _import_readers()

    times = []
    for _ in range(opens):
        start = time.perf_counter()
        with shardkit.open(f"s3://{bucket}/{PREFIX}"):
            times.append(time.perf_counter() - start)
    return times


def run_child(case: str, bucket: str, part: int, parts: int) -> None:
    if case == "open":
        import shardkit

        print(json.dumps({"opens": time_opens(bucket, 3), "module": shardkit.__file__}))
        return
    readers = {"raw-boto3": lambda: read_raw(bucket, part, parts), "runai": lambda: read_runai(bucket),
               "shardkit-open": lambda: read_shardkit(bucket), "load-model": lambda: read_load_model(bucket),
               "download+load": lambda: read_download(bucket)}
    seconds, setup, crc = readers[case]()
    print(json.dumps({"seconds": seconds, "setup": setup, "crc": crc, "rss_mb": peak_rss_mb()}))


# ----------------------------------------------------------------------------- the parent

def build(work: str, args: argparse.Namespace) -> tuple[int, dict[str, int]]:
    """The checkpoint under work/PREFIX: (tensor bytes, the crc32 each case must read)."""
    from safetensors.torch import load_file

    folder = os.path.join(work, PREFIX)
    if args.model == "sd15":  # the SD 1.5 UNet in fp16 with random weights (one file and config.json)
        build_unet("sd15", folder, dtype="F16")
    else:  # random fp16 tensors of 16 MiB split into shards
        build_random(folder, size_bytes=args.size_mb << 20, shard_bytes=f"{args.shard_mb}MB", tensor_bytes=16 << 20,
                     dtype="F16")
    state: dict[str, Any] = {}
    raw_crc = 0
    for path in shard_files(folder):
        state.update(load_file(path))
        with open(path, "rb") as f:
            raw_crc = zlib.crc32(f.read(), raw_crc)
    expected = dict.fromkeys(CASES, _tensor_crc(state))
    expected["raw-boto3"] = raw_crc
    return sum(t.nbytes for t in state.values()), expected


FAILURES: list[str] = []


def run_case(case: str, env: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    """One case in a fresh process; a failed one is tried once more and the failure kept for the report."""
    flags = ["--child", case, "--bucket", "bench", "--part-mb", str(args.part_mb), "--parts", str(args.parts)]
    for attempt in range(2):
        data = child(__file__, *flags, env=env, check=attempt == 1, timeout=900)
        if "error" not in data:
            return data
        FAILURES.append(f"{case} failed (try {attempt + 1}, load {os.getloadavg()[0]:.1f}): {data['error'][-300:]}")
        print(f"  {FAILURES[-1]}", flush=True)
    raise AssertionError("unreachable: the second try raises")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["sd15", "random"], default="sd15")
    p.add_argument("--size-mb", type=int, default=1024, help="--model random: tensor bytes, MB")
    p.add_argument("--shard-mb", type=int, default=300, help="--model random: shard size, MB")
    p.add_argument("--part-mb", type=int, default=16, help="raw case: bytes per ranged GET, MiB")
    p.add_argument("--parts", type=int, default=16, help="raw case: requests in flight")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--delay-ms", type=float, default=1.0)
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ",".join(CASES))
    p.add_argument("--open-runs", type=int, default=0,
                   help="instead of reading: time shardkit.open alone (3 opens a process, this many processes)")
    p.add_argument("--shardkit-path", default=None,
                   help="with --open-runs: import shardkit from this folder (e.g. an older checkout)")
    p.add_argument("--dir", default=None)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--bucket", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        run_child(args.child, args.bucket, args.part_mb << 20, args.parts)
        return
    cases = [c for c in args.cases.split(",") if c in CASES and (c != "load-model" or args.model == "sd15")]
    notes = []
    if "runai" in cases and importlib.util.find_spec("runai_model_streamer") is None:
        cases.remove("runai")
        notes.append(RUNAI_MISSING)
        print(RUNAI_MISSING, flush=True)
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    loads: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as work, SeaweedS3(os.path.join(work, "weed")) as server, \
            DelayProxy(server.port, delay_ms=args.delay_ms) as proxy:
        print(f"building the {args.model} checkpoint ...", flush=True)
        data_bytes, expected = build(work, args)
        server.upload(os.path.join(work, PREFIX), "bench", PREFIX)
        runai_env = {"AWS_EC2_METADATA_DISABLED": "true", "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0"}
        paths = {"loopback": {**server.client_env(), **runai_env},
                 f"proxy {args.delay_ms:g} ms": {**server.client_env(port=proxy.port), **runai_env}}
        if args.open_runs:
            print("\n".join(open_latency(paths, proxy, args)))
            return
        for r in range(args.runs):
            load_before = os.getloadavg()[0]
            for path, env in paths.items():
                for case in rotated(cases, r):
                    data = run_case(case, env, args)
                    if data["crc"] != expected[case]:
                        raise SystemExit(f"{case}: the bytes read differ from the checkpoint's")
                    results.setdefault((path, case), []).append(data)
                    print(f"  run {r + 1}/{args.runs} {path:>12} {case:>14}: {data['seconds']:.2f} s "
                          f"(setup {data['setup']:.2f}), {data_bytes / data['seconds'] / 1e9:.2f} GB/s, "
                          f"{data['rss_mb']:.0f} MB, load {os.getloadavg()[0]:.1f}", flush=True)
            loads.append((load_before, os.getloadavg()[0]))
    print("\n" + "\n".join(report(results, data_bytes, loads, notes, args)))


def open_latency(paths: dict[str, dict[str, str]], proxy: DelayProxy, args: argparse.Namespace) -> list[str]:
    """Median seconds of the first ``shardkit.open`` in a fresh process and of the later ones, and the
    requests one open makes (counted at the proxy)."""
    extra = {"PYTHONPATH": os.path.abspath(args.shardkit_path)} if args.shardkit_path else {}
    lines = ["| path | first open s | later opens s | requests per open | load before/after |", "|---|---:|---:|---|---|"]
    module = ""
    for path, env in paths.items():
        first: list[float] = []
        later: list[float] = []
        load_before = os.getloadavg()[0]
        proxy.reset_counters()
        for _ in range(args.open_runs):
            data = run_case("open", {**env, **extra}, args)
            first.append(data["opens"][0])
            later += data["opens"][1:]
            module = data["module"]
        requests = {k: v / (3 * args.open_runs) for k, v in proxy.requests.items()}
        shown = ", ".join(f"{v:g} {k}" for k, v in sorted(requests.items())) if path != "loopback" else "-"
        lines.append(f"| {path} | {median(first):.3f} | {median(later):.3f} | {shown} | "
                     f"{load_before:.1f}/{os.getloadavg()[0]:.1f} |")
    return [f"shardkit from {module}", *lines]


def report(results: dict[tuple[str, str], list[dict[str, Any]]], data_bytes: int, loads: list[tuple[float, float]],
           notes: list[str], args: argparse.Namespace) -> list[str]:
    what = "the SD 1.5 UNet, fp16, one file" if args.model == "sd15" else f"fp16 tensors in {args.shard_mb} MB shards"
    lines = [f"Machine: {machine_line()}. Load average (1 min) at the start/end of each round: "
             + ", ".join(f"{a:.1f}/{b:.1f}" for a, b in loads) + ".",
             f"{data_bytes / 1e6:.0f} MB of {what} on SeaweedFS, median of {args.runs}, fresh process each "
             f"(clock after imports). raw-boto3: {args.parts} ranged GETs of {args.part_mb} MiB in flight.",
             *notes, *(f"Failed and retried: {f}" for f in FAILURES), "",
             "| path | case | median s | GB/s | vs raw | vs runai | setup s | read s | read vs raw read | peak RSS MB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    nan = [{"seconds": float("nan"), "setup": 0.0}]
    for (path, case), values in results.items():
        total, raw, runai = (median(v["seconds"] for v in results.get((path, c), nan))
                             for c in (case, "raw-boto3", "runai"))
        read = median(v["seconds"] - v["setup"] for v in values)
        raw_read = median(v["seconds"] - v["setup"] for v in results[(path, "raw-boto3")])
        lines.append(f"| {path} | {case} | {total:.2f} | {data_bytes / total / 1e9:.2f} | {total / raw:.2f}x | "
                     f"{total / runai:.2f}x | {median(v['setup'] for v in values):.2f} | {read:.2f} | "
                     f"{read / raw_read:.2f}x | {max(v['rss_mb'] for v in values):.0f} |")
    return lines


if __name__ == "__main__":
    main()
