#!/usr/bin/env python3
"""S3 benchmarks against a real SeaweedFS on loopback (tests/s3_server.py), through a counting delay proxy: four
tables of cases (issue 33).
Method: docs/benchmarks.md, "How each benchmark measures"; what each table shows: docs/s3.md.

    python scripts/bench_s3.py clients --size-mb 1024 --write-mb 256 --runs 3 --delay-ms 1
    python scripts/bench_s3.py open --runs 3 --delay-ms 1
    python scripts/bench_s3.py open --model random --size-mb 256 --shard-mb 50 --open-runs 5
    python scripts/bench_s3.py copy --size-mb 1024 --shards 5 --out-shards 2 --runs 3
    python scripts/bench_s3.py split --size-mb 6144 --runs 3
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import importlib.util
import io
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from statistics import median
from typing import Any

import benchlib
from benchlib import markdown, med, peak_rss_mb
from build_checkpoint import build_random, build_unet
from s3_server import DelayProxy, SeaweedS3

BUCKET, KEY, PREFIX = "bench", "bench/blob.bin", "ckpt"
CASES = {"clients": ["boto3-threads", "s3transfer", "obstore-threads", "obstore-ranges", "shardkit-stores",
                     "write-shardkit", "write-s3transfer", "write-obstore"],
         "open": ["raw-boto3", "runai", "shardkit-open", "load-model", "download+load"],
         "copy": ["copy", "staged", "boto3"], "split": ["streamed"]}
SIZE_MB = {"clients": 1024, "open": 1024, "copy": 1024, "split": 6144}
RUNAI_MISSING = ("the Run:ai streamer is not installed: pip install 'shardkit[bench]' "
                 "(runai-model-streamer runai-model-streamer-s3); its case is left out")
RUNAI_ENV = {"AWS_EC2_METADATA_DISABLED": "true", "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0"}


# ----------------------------------------------------------------------------- clients (children)

def boto3_client(parts: int) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client("s3", config=Config(max_pool_connections=parts, s3={"addressing_style": "path"}))


def _pool_map(fn: Callable[[Any], None], items: list[Any], threads: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(fn, items))


def get_ranges(client: Any, bufs: dict[str, memoryview], part: int, parts: int) -> None:
    """Every object of ``bufs`` straight into its buffer by ranged GETs of ``part`` bytes, ``parts`` in flight (1 MiB
    a readinto: urllib3 reads each readinto into a temporary first)."""
    def get(key: str, begin: int, view: memoryview) -> None:
        body = client.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={begin}-{begin + len(view) - 1}")["Body"]
        got = 0
        while got < len(view):
            n = body.readinto(view[got:got + (1 << 20)])
            if not n:
                raise OSError(f"short read of {key} at {begin + got}")
            got += n

    jobs = [(key, b, buf[b:b + part]) for key, buf in bufs.items() for b in range(0, len(buf), part)]
    _pool_map(lambda job: get(*job), jobs, parts)


class _BufferWriter:
    """A seekable, writable file over the destination buffer (what s3transfer writes into)."""

    def __init__(self, out: memoryview) -> None:
        self.out, self.pos = out, 0

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else len(self.out) + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def write(self, data: Any) -> int:
        self.out[self.pos:self.pos + len(data)] = data
        self.pos += len(data)
        return len(data)

    def seekable(self) -> bool:
        return True


def _obstore() -> Any:
    from obstore.store import S3Store

    endpoint = os.environ["AWS_ENDPOINT_URL"]
    return S3Store(BUCKET, endpoint=endpoint, region=os.environ["AWS_REGION"],
                   client_options={"allow_http": endpoint.startswith("http://"), "pool_max_idle_per_host": "64"})


def client_case(case: str, buf: memoryview, part: int, parts: int) -> None:
    """One client reading the object into ``buf`` (or writing ``buf`` back), timed by the caller."""
    from boto3.s3.transfer import TransferConfig

    size, transfer = len(buf), TransferConfig(multipart_threshold=part, multipart_chunksize=part,
                                              max_concurrency=parts, use_threads=True)
    if case == "boto3-threads":
        get_ranges(boto3_client(parts), {KEY: buf}, part, parts)
    elif case == "s3transfer":
        boto3_client(parts).download_fileobj(BUCKET, KEY, _BufferWriter(buf), Config=transfer)
    elif case in ("obstore-threads", "obstore-ranges"):
        import obstore

        store, ranges = _obstore(), [(b, min(b + part, size)) for b in range(0, size, part)]
        if case == "obstore-ranges":  # all ranges in one call: the Rust side fans them out
            replies = obstore.get_ranges(store, KEY, starts=[b for b, _ in ranges], ends=[e for _, e in ranges])
            for (b, e), data in zip(ranges, replies, strict=True):
                buf[b:e] = memoryview(data)
        else:
            _pool_map(lambda r: buf.__setitem__(slice(*r), memoryview(obstore.get_range(store, KEY, start=r[0],
                                                                                         end=r[1]))), ranges, parts)
    elif case == "shardkit-stores":
        from shardkit.stores import RangeRequest, open_store, read_ranges

        with open_store(f"s3://{BUCKET}", threads=parts) as store:
            read_ranges(store, [RangeRequest(KEY, 0, buf)], threads=parts, part_bytes=part)
    elif case == "write-shardkit":
        from shardkit.stores import parse_store_url
        from shardkit.stores.s3 import S3Store

        with S3Store(parse_store_url(f"s3://{BUCKET}"), part_bytes=part) as s3, s3.writer("bench/out-shardkit") as w:
            for begin in range(0, size, 8 << 20):  # as a shard writer hands over its bytes
                w.write(buf[begin:begin + (8 << 20)])
            w.commit()
    elif case == "write-s3transfer":
        boto3_client(parts).upload_fileobj(io.BytesIO(buf), BUCKET, "bench/out-s3transfer", Config=transfer)
    elif case == "write-obstore":
        import obstore

        obstore.put(_obstore(), "bench/out-obstore", buf, chunk_size=part, max_concurrency=parts)


def child_clients(case: str, args: argparse.Namespace, extra: dict[str, Any]) -> dict[str, Any]:
    import boto3  # noqa: F401 - imported before the clock starts

    size = (args.write_mb if case.startswith("write-") else args.size_mb) << 20
    buf = memoryview(bytearray(size))
    if case.startswith("write-"):
        for begin in range(0, size, 16 << 20):  # filled in place: the setup adds no peak of its own
            buf[begin:begin + (16 << 20)] = os.urandom(min(16 << 20, size - begin))
    start = time.perf_counter()
    client_case(case, buf, args.part_mb << 20, args.parts)
    seconds = time.perf_counter() - start
    if not case.startswith("write-") and zlib.crc32(buf[size // 2: size // 2 + (1 << 20)]) != extra["crc"]:
        raise SystemExit(f"{case}: the bytes read differ from the object's")
    return {"seconds": seconds}


# ----------------------------------------------------------------------------- open (children)

def _tensor_crc(state: dict[str, Any]) -> int:
    import torch

    crc = 0
    for name in sorted(state):
        crc = zlib.crc32(state[name].detach().contiguous().view(-1).view(torch.uint8).numpy(), crc)
    return crc


def _objects(client: Any) -> list[tuple[str, int]]:
    listing = client.list_objects_v2(Bucket=BUCKET, Prefix=PREFIX + "/")
    return sorted((o["Key"], o["Size"]) for o in listing["Contents"] if o["Key"].endswith(".safetensors"))


def open_case(case: str, args: argparse.Namespace) -> tuple[float, float, dict[str, Any] | int]:
    """(seconds, setup seconds, what was read: tensors by name, or the raw objects' crc32)."""
    import boto3
    import numpy

    url = f"s3://{BUCKET}/{PREFIX}"
    if case == "raw-boto3":
        start = time.perf_counter()
        client = boto3_client(args.parts)
        objects = _objects(client)
        ready = time.perf_counter()
        # numpy.empty, as torch.empty in the other cases: bytearray(n) would first write n zero bytes
        bufs = {key: memoryview(numpy.empty(size, dtype=numpy.uint8)) for key, size in objects}
        get_ranges(client, bufs, args.part_mb << 20, args.parts)
        end = time.perf_counter()
        crc = 0
        for key, _ in objects:
            crc = zlib.crc32(bufs[key], crc)
        return end - start, ready - start, crc
    if case == "runai":
        from runai_model_streamer import SafetensorsStreamer

        keys = [key for key, _ in _objects(boto3.client("s3"))]  # only the listing, before the clock
        start, state = time.perf_counter(), {}
        with SafetensorsStreamer() as streamer:
            ready = time.perf_counter()
            streamer.stream_files([f"s3://{BUCKET}/{key}" for key in keys])
            for name, tensor in streamer.get_tensors():
                state[name] = tensor
            return time.perf_counter() - start, ready - start, {**state}
    if case == "download+load":
        from safetensors.torch import load_file

        state = {}
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            client = boto3.client("s3")
            objects = _objects(client)
            ready = time.perf_counter()
            for key, _ in objects:
                client.download_file(BUCKET, key, os.path.join(tmp, key.rpartition("/")[2]))
                state.update(load_file(os.path.join(tmp, key.rpartition("/")[2])))
            return time.perf_counter() - start, ready - start, state
    import shardkit

    if case == "load-model":
        from diffusers import UNet2DConditionModel  # noqa: F401 - the class import is part of the imports

        start = time.perf_counter()
        model = shardkit.load_model("diffusers:UNet2DConditionModel", url, dtype="fp16")
        return time.perf_counter() - start, 0.0, dict(model.state_dict())
    start = time.perf_counter()
    with shardkit.open(url) as ckpt:
        ready = time.perf_counter()
        state = ckpt.to_state_dict()
        return time.perf_counter() - start, ready - start, state


def child_open(case: str, args: argparse.Namespace, extra: dict[str, Any]) -> dict[str, Any]:
    import torch  # noqa: F401 - imported before the clock starts

    import shardkit

    for name in ("shardkit.api.stores", "shardkit.stores.s3", "shardkit.stores.hf", "shardkit.hub.remote"):  # pre-clock
        with contextlib.suppress(ModuleNotFoundError):
            importlib.import_module(name)
    if case == "open":  # shardkit.open alone (headers only), three times in this process
        times = []
        for _ in range(3):
            start = time.perf_counter()
            with shardkit.open(f"s3://{BUCKET}/{PREFIX}"):
                times.append(time.perf_counter() - start)
        return {"opens": times, "module": shardkit.__file__}
    seconds, setup, got = open_case(case, args)
    return {"seconds": seconds, "setup": setup, "read": seconds - setup,
            "crc": got if isinstance(got, int) else _tensor_crc(got)}


# ----------------------------------------------------------------------------- copy (children)

def child_copy(case: str, args: argparse.Namespace, extra: dict[str, Any]) -> dict[str, Any]:
    from boto3.s3.transfer import TransferConfig

    import shardkit
    import shardkit.api.checkpoints as checkpoints
    import shardkit.api.store_copy as store_copy

    if case == "staged":
        checkpoints.copy_split = lambda *a, **k: None  # the path without copies
    if case.startswith("copy-"):  # an A/B of the copy part size: copy-128 = parts of 128 MiB
        store_copy.COPY_PART_BYTES = int(case.removeprefix("copy-")) << 20
    out, max_shard, start, cloned = extra["out"], extra["max_shard"], time.perf_counter(), 0
    if case == "boto3":  # what users do today: download, split locally, upload
        client, config = boto3_client(16), TransferConfig(multipart_chunksize=16 << 20, max_concurrency=10)
        src, dst = os.path.join(extra["scratch"], "src"), os.path.join(extra["scratch"], "out")
        os.makedirs(src)
        for key in [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix="src/")["Contents"]]:
            client.download_file(BUCKET, key, os.path.join(src, key[len("src/"):]), Config=config)
        shardkit.split(src, dst, max_shard_size=max_shard)
        for name in sorted(os.listdir(dst)):
            client.upload_file(os.path.join(dst, name), BUCKET, f"{out}/{name}", Config=config)
    else:
        cloned = shardkit.split(f"s3://{BUCKET}/src", f"s3://{BUCKET}/{out}", max_shard_size=max_shard).cloned_bytes
    return {"seconds": time.perf_counter() - start, "cloned": cloned}


CHILDREN = {"clients": child_clients, "open": child_open, "copy": child_copy}


# ----------------------------------------------------------------------------- the parent

@contextlib.contextmanager
def serve(args: argparse.Namespace) -> Iterator[tuple[str, SeaweedS3, DelayProxy]]:
    """A scratch folder, SeaweedFS on loopback and the delay proxy in front of it."""
    with tempfile.TemporaryDirectory(dir=args.dir) as work, SeaweedS3(os.path.join(work, "weed")) as server, \
            DelayProxy(server.port, delay_ms=args.delay_ms) as proxy:
        yield work, server, proxy


def run_child(case: str, env: dict[str, str], args: argparse.Namespace, *, retry: bool = False,
              **extra: Any) -> dict[str, Any]:
    """One case in a fresh process (``--child``); ``retry``: a failed one is tried once more, noted."""
    argv = sys.argv[1:]
    for attempt in range(2 if retry else 1):
        data = benchlib.child(__file__, *argv, "--child", case, "--extra", json.dumps(extra), env=env,
                              check=attempt == 1 or not retry, timeout=1800)
        if "error" not in data:
            return data
        args.notes.append(f"Failed and retried: {case} (try {attempt + 1}, load {os.getloadavg()[0]:.1f}): "
                          f"{data['error'][-300:]}")
        print(f"  {args.notes[-1]}", flush=True)
    raise AssertionError("unreachable: the last try raises")


def header(args: argparse.Namespace, what: str) -> str:
    return benchlib.report_head(f"{what}; fresh process each", runs=args.runs, loads=args.loads, notes=args.notes)


def peak(runs: list[dict[str, Any]]) -> str:
    return f"{max(v['rss_mb'] for v in runs):.0f}"


def paths_of(server: SeaweedS3, proxy: DelayProxy, args: argparse.Namespace) -> dict[str, dict[str, str]]:
    return {"loopback": {**server.client_env(), **RUNAI_ENV},
            f"proxy {args.delay_ms:g} ms": {**server.client_env(port=proxy.port), **RUNAI_ENV}}


def upload_blob(server: SeaweedS3, work: str, size: int) -> int:
    """A ``size``-byte object of random bytes at KEY (written to disk first); the crc32 of its middle MiB."""
    folder = os.path.join(work, "blob")
    os.makedirs(folder)
    with open(os.path.join(folder, "blob.bin"), "wb") as f:
        for begin in range(0, size, 64 << 20):
            f.write(os.urandom(min(64 << 20, size - begin)))
    with open(os.path.join(folder, "blob.bin"), "rb") as f:
        f.seek(size // 2)
        crc = zlib.crc32(f.read(1 << 20))
    server.upload(folder, BUCKET, KEY.partition("/")[0])
    shutil.rmtree(folder)
    return crc


def bench_clients(args: argparse.Namespace, cases: list[str]) -> str:
    with serve(args) as (work, server, proxy):
        crc, paths = upload_blob(server, work, args.size_mb << 20), paths_of(server, proxy, args)

        def moved(case: str) -> int:
            return (args.write_mb if case.startswith("write-") else args.size_mb) << 20

        def one(key: tuple[str, str], r: int) -> dict[str, Any]:
            return {**run_child(key[1], paths[key[0]], args, crc=crc), "moved": moved(key[1])}

        results = benchlib.rounds([(p, c) for p in paths for c in cases], args.runs, one, loads=args.loads,
                                  line=lambda d: f"{d['seconds']:.2f} s, {d['moved'] / d['seconds'] / 1e9:.2f} GB/s, "
                                  f"{d['rss_mb']:.0f} MB")
    rows = [[path, case, f"{med(vs, 'seconds'):.2f}", f"{moved(case) / med(vs, 'seconds') / 1e9:.2f}", peak(vs)]
            for (path, case), vs in results.items()]
    return header(args, f"One {args.size_mb} MiB object, {args.parts} ranged GETs of {args.part_mb} MiB in flight "
                        f"(RSS includes the destination); write cases write {args.write_mb} MiB from memory") + \
        markdown(["path", "client", "median s", "GB/s", "peak RSS MB"], rows, align="llrrr")


def build_open(work: str, args: argparse.Namespace) -> tuple[int, dict[str, int]]:
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
    for path in benchlib.shard_files(folder):
        state.update(load_file(path))
        with open(path, "rb") as f:
            raw_crc = zlib.crc32(f.read(), raw_crc)
    return sum(t.nbytes for t in state.values()), {**dict.fromkeys(CASES["open"], _tensor_crc(state)),
                                                   "raw-boto3": raw_crc}


def bench_open(args: argparse.Namespace, cases: list[str]) -> str:
    cases = [c for c in cases if c != "load-model" or args.model == "sd15"]
    if "runai" in cases and importlib.util.find_spec("runai_model_streamer") is None:
        cases.remove("runai")
        args.notes.append(RUNAI_MISSING)
        print(RUNAI_MISSING, flush=True)
    with serve(args) as (work, server, proxy):
        print(f"building the {args.model} checkpoint ...", flush=True)
        data_bytes, expected = build_open(work, args)
        server.upload(os.path.join(work, PREFIX), BUCKET, PREFIX)
        paths = paths_of(server, proxy, args)
        if args.open_runs:
            return open_latency(paths, proxy, args)

        def one(key: tuple[str, str], r: int) -> dict[str, Any]:
            data = run_child(key[1], paths[key[0]], args, retry=True)
            if data["crc"] != expected[key[1]]:
                raise SystemExit(f"{key[1]}: the bytes read differ from the checkpoint's")
            return data

        results = benchlib.rounds([(p, c) for p in paths for c in cases], args.runs, one, loads=args.loads,
                                  line=lambda d: f"{d['seconds']:.2f} s (setup {d['setup']:.2f}), "
                                  f"{data_bytes / d['seconds'] / 1e9:.2f} GB/s, {d['rss_mb']:.0f} MB")
    rows = []
    for (path, case), vs in results.items():  # nan where a case compared with did not run
        total, raw, runai, read, raw_read = (med(results.get((path, c), []), key) or float("nan") for c, key in (
            (case, "seconds"), ("raw-boto3", "seconds"), ("runai", "seconds"), (case, "read"), ("raw-boto3", "read")))
        rows.append([path, case, f"{total:.2f}", f"{data_bytes / total / 1e9:.2f}", f"{total / raw:.2f}x",
                     f"{total / runai:.2f}x", f"{med(vs, 'setup'):.2f}", f"{read:.2f}", f"{read / raw_read:.2f}x",
                     peak(vs)])
    what = "the SD 1.5 UNet, fp16, one file" if args.model == "sd15" else f"fp16 tensors in {args.shard_mb} MB shards"
    return header(args, f"{data_bytes / 1e6:.0f} MB of {what}; clock after imports; raw-boto3: {args.parts} "
                        f"ranged GETs of {args.part_mb} MiB in flight") + \
        markdown(["path", "case", "median s", "GB/s", "vs raw", "vs runai", "setup s", "read s", "read vs raw read",
                  "peak RSS MB"], rows, align="llrrrrrrrr")


def open_latency(paths: dict[str, dict[str, str]], proxy: DelayProxy, args: argparse.Namespace) -> str:
    """Median seconds of the first ``shardkit.open`` in a fresh process and of the later ones, and the
    requests one open makes (counted at the proxy)."""
    extra = {"PYTHONPATH": os.path.abspath(args.shardkit_path)} if args.shardkit_path else {}
    rows, module = [], ""
    for path, env in paths.items():
        first: list[float] = []
        later: list[float] = []
        load_before = os.getloadavg()[0]
        proxy.reset_counters()
        for _ in range(args.open_runs):
            data = run_child("open", {**env, **extra}, args, retry=True)
            first.append(data["opens"][0])
            later += data["opens"][1:]
            module = data["module"]
        requests = {k: v / (3 * args.open_runs) for k, v in proxy.requests.items()}
        shown = ", ".join(f"{v:g} {k}" for k, v in sorted(requests.items())) if path != "loopback" else "-"
        rows.append([path, f"{median(first):.3f}", f"{median(later):.3f}", shown,
                     f"{load_before:.1f}/{os.getloadavg()[0]:.1f}"])
    return f"shardkit from {module}\n" + markdown(["path", "first open s", "later opens s", "requests per open",
                                                    "load before/after"], rows, align="lrrll")


def bench_copy(args: argparse.Namespace, cases: list[str]) -> str:
    max_shard = -(-(args.size_mb << 20) // args.out_shards) + (1 << 20)
    with serve(args) as (work, server, proxy):
        src = os.path.join(work, "src")
        build_random(src, size_bytes=args.size_mb << 20, shard_bytes=-(-(args.size_mb << 20) // args.shards),
                     tensor_bytes=32 << 20)
        with open(os.path.join(src, "config.json"), "w") as f:
            f.write('{"model_type": "bench"}\n')
        size = server.upload(src, BUCKET, "src")
        shutil.rmtree(src)
        reference: list[dict[str, str]] = []

        def one(key: tuple[str, str], r: int) -> dict[str, Any]:
            case, scratch, out = key[1], tempfile.mkdtemp(dir=work), f"out-{key[1]}-{r}"
            before = proxy.sent_bytes + proxy.received_bytes
            data = run_child(case, server.client_env(port=proxy.port), args, out=out, max_shard=max_shard,
                             scratch=scratch)
            data["moved"] = proxy.sent_bytes + proxy.received_bytes - before
            shutil.rmtree(scratch)
            got = digests(server, out)
            reference[:] = reference or [got]
            if got != reference[0]:
                raise SystemExit(f"{case}: its output differs from the first case's: {got} != {reference[0]}")
            return data

        results = benchlib.rounds([(f"proxy {args.delay_ms:g} ms", c) for c in cases], args.runs, one, loads=args.loads,
                                  line=lambda d: f"{d['seconds']:.2f} s, through the client {d['moved'] / 1e6:.1f} MB "
                                  f"({100 * d['moved'] / size:.2f}%), copied in the store {d['cloned'] / 1e6:.0f} "
                                  f"MB, {d['rss_mb']:.0f} MB RSS")
    rows = [[case, f"{med(vs, 'seconds'):.2f}", ", ".join(f"{v['seconds']:.2f}" for v in vs),
             f"{med(vs, 'moved') / 1e6:.1f} MB", f"{100 * med(vs, 'moved') / size:.2f}%",
             f"{max(v['cloned'] for v in vs) / 1e6:.0f} MB", peak(vs)] for (_, case), vs in results.items()]
    return header(args, f"A {size / 1e6:.0f} MB checkpoint of random bf16 tensors in {args.shards} shards resharded "
                        f"into {args.out_shards}, every request through the counting proxy; outputs identical") + \
        markdown(["case", "median s", "runs s", "bytes through the client", "% of the checkpoint",
                  "copied in the store", "peak RSS MB"], rows, align="lrlrrrr")


def digests(server: SeaweedS3, prefix: str) -> dict[str, str]:
    """sha256 of every object under ``prefix``/ (read back, then deleted)."""
    client: Any = server.client()
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


def split_cli(dst: str, env: dict[str, str]) -> dict[str, float]:
    """One CLI split in a fresh process: wall seconds, and the peak RSS MB of that process."""
    with tempfile.TemporaryDirectory(prefix="bench-rss-") as rss:
        root = shlex.quote(benchlib.ROOT)
        usage = benchlib.measure(f"cd {root} && PYTHONPATH={root} BENCH_RSS_DIR={rss} {sys.executable} "
                                 f"{benchlib.HERE}/benchlib.py --shardkit split s3://{BUCKET}/src {dst} "
                                 "--max-shard-size 1GB", env=env)
        return {"seconds": usage.seconds, "rss_mb": benchlib.rank_peaks_mb(rss)[0]}


def bench_split(args: argparse.Namespace, cases: list[str]) -> str:
    expected: list[Any] = []
    with serve(args) as (work, server, _):
        local = os.path.join(work, "src")
        build_random(local, size_bytes=args.size_mb << 20, shard_bytes=args.source_shard_mb << 20, manifest=False)
        server.upload(local, BUCKET, "src")
        shutil.rmtree(local)
        print(f"source uploaded: {args.size_mb} MB; load average {os.getloadavg()[0]:.2f}", flush=True)

        def one(key: tuple[str, str], r: int) -> dict[str, float]:
            bucket = f"out-{r}-{cases.index(key[1])}"
            client: Any = server.client()
            client.create_bucket(Bucket=bucket)
            data = split_cli(f"s3://{bucket}/ckpt", server.client_env())
            manifest = client.get_object(Bucket=bucket, Key="ckpt/shardkit.manifest.json")["Body"].read()
            client.close()
            got = (server.objects(bucket), manifest)
            expected[:] = expected or [got]
            if got != expected[0]:
                raise SystemExit(f"{key[1]}: the output differs from the first run's (names, sizes or manifest)")
            server.drop(bucket)  # SeaweedFS frees a bucket's volumes with it
            return data

        results = benchlib.rounds([("loopback", c) for c in cases], args.runs, one, loads=args.loads,
                                  line=lambda d: f"{d['seconds']:.1f} s, peak RSS {d['rss_mb']:.0f} MB")
    shards = sum(1 for key in expected[0][0] if key.endswith(".safetensors"))
    rows = [[case, ", ".join(f"{v['seconds']:.1f}" for v in vs), f"{med(vs, 'seconds'):.1f}",
             f"{(args.size_mb << 20) / med(vs, 'seconds') / 1e6:.0f}", peak(vs)] for (_, case), vs in results.items()]
    return header(args, f"`shardkit split s3://bench/src s3://out/ckpt --max-shard-size 1GB`: {args.size_mb} MiB of "
                        f"random bf16 in {args.source_shard_mb} MiB source shards → {shards} shards") + \
        markdown(["case", "wall s (runs)", "median s", "MB/s", "peak RSS MB (max)"], rows, align="llrrr")


BENCHES = {"clients": bench_clients, "open": bench_open, "copy": bench_copy, "split": bench_split}


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    p = benchlib.parser(__doc__)
    p.add_argument("table", choices=sorted(BENCHES))
    p.add_argument("--size-mb", type=int, help="bytes of the object or checkpoint, MiB (default: " +
                   ", ".join(f"{k} {v}" for k, v in SIZE_MB.items()) + ")")
    p.add_argument("--delay-ms", type=float, default=1.0, help="proxy delay each way (default 1 ms)")
    p.add_argument("--cases", help="comma-separated subset of the table's cases (copy: also copy-N)")
    p.add_argument("--dir", default=None, help="where SeaweedFS keeps its data (default: a temporary folder)")
    p.add_argument("--part-mb", type=int, default=16, help="clients, open raw-boto3: bytes per ranged GET, MiB")
    p.add_argument("--parts", type=int, default=16, help="clients, open raw-boto3: requests in flight")
    p.add_argument("--write-mb", type=int, default=256, help="clients: bytes each write case writes, MiB")
    p.add_argument("--model", choices=["sd15", "random"], default="sd15", help="open: the checkpoint")
    p.add_argument("--shard-mb", type=int, default=300, help="open --model random: shard size, MB")
    p.add_argument("--open-runs", type=int, default=0, help="open: time shardkit.open alone in this many processes")
    p.add_argument("--shardkit-path", default=None, help="open --open-runs: import shardkit from this folder")
    p.add_argument("--shards", type=int, default=5, help="copy: source shards")
    p.add_argument("--out-shards", type=int, default=2, help="copy: output shards")
    p.add_argument("--source-shard-mb", type=int, default=2048, help="split: source shard size, MiB")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--extra", default="{}", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.size_mb = args.size_mb or SIZE_MB[args.table]
    if args.child:
        print(json.dumps({**CHILDREN[args.table](args.child, args, json.loads(args.extra)), "rss_mb": peak_rss_mb()}))
        return
    signal.signal(signal.SIGTERM, _interrupt)  # stop the server and remove its data on a plain kill too
    args.notes, args.loads = [], []
    cases = args.cases.split(",") if args.cases else CASES[args.table]
    benchlib.publish_report(BENCHES[args.table](args, cases), args.output)


if __name__ == "__main__":
    main()
