#!/usr/bin/env python3
"""S3 reads against a real SeaweedFS: which client reaches the network's limit (issue 33).

Starts SeaweedFS (scripts/s3_server.py) on loopback, uploads one object of ``--size-mb`` random
bytes, and reads it whole into one preallocated buffer by parallel ranged GETs (``--parts``
requests in flight, ``--part-mb`` each), with each client, straight to the server and through the
delay proxy (``--delay-ms`` each way, run in this parent process so it never shares the client's
GIL). Every case runs in a fresh process; the time starts after its imports and client setup and
ends when the last byte is in the buffer (checked against a sample of the object); peak RSS is the
child's own ``VmHWM`` (not ``ru_maxrss``, which starts from the parent's peak at fork; it includes the destination buffer, the same for every case). Cases run
interleaved, ``--runs`` rounds; the table shows medians.

    python scripts/bench_s3.py --size-mb 1024 --runs 3 --output docs/bench-s3.md

Cases (the raw client comparison; shardkit's own readers join as they land):
  boto3-threads   boto3 get_object(Range=...) on a thread pool, body read into the buffer slice
  s3transfer      boto3's download_fileobj (s3transfer) into a seekable view of the buffer
  obstore-threads obstore.get_range on a thread pool, each reply copied into the buffer slice
  obstore-ranges  obstore.get_ranges: all ranges in one call (the Rust side fans them out)
  shardkit-stores shardkit.stores.read_ranges on the S3 store (boto3, the chosen client)
  write-*         the same bytes written back: shardkit's multipart writer (fed 8 MiB at a time),
                  s3transfer's upload_fileobj, obstore.put (multipart); RSS includes the source buffer
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import zlib
from typing import Any

from benchlib import child, machine_line, markdown, median, peak_rss_mb, publish_report, rotated
from s3_server import DelayProxy, SeaweedS3

KEY = "bench/blob.bin"
CASES = ["boto3-threads", "s3transfer", "obstore-threads", "obstore-ranges", "shardkit-stores",
         "write-shardkit", "write-s3transfer", "write-obstore"]


# ----------------------------------------------------------------------------- the child: one read

def _ranges(size: int, part: int) -> list[tuple[int, int]]:
    return [(b, min(b + part, size)) for b in range(0, size, part)]


def boto3_client(parts: int) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client("s3", config=Config(max_pool_connections=parts, s3={"addressing_style": "path"}))


def get_range_into(client: Any, bucket: str, key: str, begin: int, view: memoryview) -> None:
    """The bytes of ``key`` from ``begin`` straight into ``view`` (1 MiB a readinto: urllib3 reads each
    readinto into a temporary first)."""
    body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={begin}-{begin + len(view) - 1}")["Body"]
    got = 0
    while got < len(view):
        n = body.readinto(view[got:got + (1 << 20)])
        if not n:
            raise OSError(f"short read of {key} at {begin + got}")
        got += n


def read_boto3_threads(bucket: str, size: int, part: int, parts: int, out: memoryview) -> float:
    from concurrent.futures import ThreadPoolExecutor

    client = boto3_client(parts)
    start = time.perf_counter()
    with ThreadPoolExecutor(parts) as pool:
        list(pool.map(lambda r: get_range_into(client, bucket, KEY, r[0], out[r[0]:r[1]]), _ranges(size, part)))
    return time.perf_counter() - start


class _BufferWriter:
    """A seekable, writable file over the destination buffer (what s3transfer writes into)."""

    def __init__(self, out: memoryview) -> None:
        self.out, self.pos = out, 0

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else len(self.out) + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def write(self, data: bytes) -> int:
        self.out[self.pos:self.pos + len(data)] = data
        self.pos += len(data)
        return len(data)

    def seekable(self) -> bool:
        return True


def read_s3transfer(bucket: str, size: int, part: int, parts: int, out: memoryview) -> float:
    from boto3.s3.transfer import TransferConfig

    client = boto3_client(parts)
    config = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=parts,
                            use_threads=True)
    start = time.perf_counter()
    client.download_fileobj(bucket, KEY, _BufferWriter(out), Config=config)
    return time.perf_counter() - start


def _obstore(bucket: str) -> Any:
    from obstore.store import S3Store

    endpoint = os.environ["AWS_ENDPOINT_URL"]
    return S3Store(bucket, endpoint=endpoint, region=os.environ["AWS_REGION"],
                   client_options={"allow_http": endpoint.startswith("http://"), "pool_max_idle_per_host": "64"})


def read_obstore_threads(bucket: str, size: int, part: int, parts: int, out: memoryview) -> float:
    from concurrent.futures import ThreadPoolExecutor

    import obstore

    store = _obstore(bucket)
    start = time.perf_counter()

    def get(r: tuple[int, int]) -> None:
        data = obstore.get_range(store, KEY, start=r[0], end=r[1])
        view = memoryview(data)
        if len(view) != r[1] - r[0]:
            raise OSError(f"short read at {r[0]}")
        out[r[0]:r[1]] = view

    with ThreadPoolExecutor(parts) as pool:
        list(pool.map(get, _ranges(size, part)))
    return time.perf_counter() - start


def read_obstore_ranges(bucket: str, size: int, part: int, parts: int, out: memoryview) -> float:
    import obstore

    store = _obstore(bucket)
    ranges = _ranges(size, part)
    start = time.perf_counter()
    replies = obstore.get_ranges(store, KEY, starts=[r[0] for r in ranges], ends=[r[1] for r in ranges])
    for (b, e), data in zip(ranges, replies, strict=True):
        out[b:e] = memoryview(data)
    return time.perf_counter() - start


def read_shardkit_store(bucket: str, size: int, part: int, parts: int, out: memoryview) -> float:
    from shardkit.stores import RangeRequest, open_store, read_ranges

    with open_store(f"s3://{bucket}", threads=parts) as store:
        start = time.perf_counter()
        read_ranges(store, [RangeRequest(KEY, 0, out)], threads=parts, part_bytes=part)
        return time.perf_counter() - start


def write_shardkit_store(bucket: str, size: int, part: int, parts: int, data: memoryview) -> float:
    from shardkit.stores import parse_store_url
    from shardkit.stores.s3 import S3Store

    with S3Store(parse_store_url(f"s3://{bucket}"), part_bytes=part) as store:
        start = time.perf_counter()
        with store.writer("bench/out-shardkit") as w:
            for begin in range(0, size, 8 << 20):  # as a shard writer hands over its bytes
                w.write(data[begin:begin + (8 << 20)])
            w.commit()
        return time.perf_counter() - start


def write_s3transfer(bucket: str, size: int, part: int, parts: int, data: memoryview) -> float:
    import io

    from boto3.s3.transfer import TransferConfig

    client = boto3_client(parts)
    config = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=parts)
    start = time.perf_counter()
    client.upload_fileobj(io.BytesIO(data), bucket, "bench/out-s3transfer", Config=config)  # type: ignore[arg-type]
    return time.perf_counter() - start


def write_obstore(bucket: str, size: int, part: int, parts: int, data: memoryview) -> float:
    import obstore

    store = _obstore(bucket)
    start = time.perf_counter()
    obstore.put(store, "bench/out-obstore", data, chunk_size=part, max_concurrency=parts)
    return time.perf_counter() - start


WRITERS = {"write-shardkit": write_shardkit_store, "write-s3transfer": write_s3transfer,
           "write-obstore": write_obstore}
READERS = {"shardkit-stores": read_shardkit_store, "boto3-threads": read_boto3_threads, "s3transfer": read_s3transfer,
           "obstore-threads": read_obstore_threads, "obstore-ranges": read_obstore_ranges}


def run_child(case: str, bucket: str, size: int, part: int, parts: int, crc_sample: int) -> None:
    if case in WRITERS:
        buffer = memoryview(bytearray(size))
        for begin in range(0, size, 16 << 20):  # filled in place: the setup adds no peak of its own
            buffer[begin:begin + (16 << 20)] = os.urandom(min(16 << 20, size - begin))
        seconds = WRITERS[case](bucket, size, part, parts, buffer)
    else:
        buffer = memoryview(bytearray(size))
        seconds = READERS[case](bucket, size, part, parts, buffer)
        if zlib.crc32(buffer[size // 2: size // 2 + (1 << 20)]) != crc_sample:
            raise SystemExit(f"{case}: the bytes read differ from the object's")
    print(json.dumps({"seconds": seconds, "rss_mb": peak_rss_mb()}))


# ----------------------------------------------------------------------------- the parent

def upload(server: SeaweedS3, bucket: str, size: int) -> int:
    """A ``size``-byte object of random bytes (multipart, 64 MiB at a time); returns the sample's crc32."""
    client = server.client()
    client.create_bucket(Bucket=bucket)
    upload_id = client.create_multipart_upload(Bucket=bucket, Key=KEY)["UploadId"]
    parts, crc, part = [], 0, 64 << 20
    for n, begin in enumerate(range(0, size, part), start=1):
        data = os.urandom(min(part, size - begin))
        if begin <= size // 2 < begin + len(data):
            crc = zlib.crc32(data[size // 2 - begin: size // 2 - begin + (1 << 20)])
        etag = client.upload_part(Bucket=bucket, Key=KEY, UploadId=upload_id, PartNumber=n, Body=data)["ETag"]
        parts.append({"PartNumber": n, "ETag": etag})
    client.complete_multipart_upload(Bucket=bucket, Key=KEY, UploadId=upload_id, MultipartUpload={"Parts": parts})
    client.close()
    return crc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-mb", type=int, default=1024, help="object size in MiB (default 1024)")
    p.add_argument("--write-mb", type=int, default=256, help="bytes each write case writes, MiB (default 256)")
    p.add_argument("--part-mb", type=int, default=16, help="bytes per ranged GET, MiB (default 16)")
    p.add_argument("--parts", type=int, default=16, help="requests in flight (default 16)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--delay-ms", type=float, default=1.0, help="proxy delay each way (default 1 ms)")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--dir", default=None, help="SeaweedFS data folder (default: a temporary one)")
    p.add_argument("--output", default=None, help="also write the report (markdown) here")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)  # CASE BUCKET CRC
    args = p.parse_args()
    size, part = args.size_mb << 20, args.part_mb << 20
    if args.child:
        case, bucket, crc = args.child
        run_child(case, bucket, (args.write_mb << 20) if case in WRITERS else size, part, args.parts, int(crc))
        return

    with tempfile.TemporaryDirectory(dir=args.dir) as work, SeaweedS3(work) as server, \
            DelayProxy(server.port, delay_ms=args.delay_ms) as proxy:
        crc = upload(server, "bench", size)
        paths = {"loopback": server.client_env(), f"proxy {args.delay_ms:g} ms": server.client_env(port=proxy.port)}
        flags = ["--size-mb", str(args.size_mb), "--write-mb", str(args.write_mb), "--part-mb", str(args.part_mb),
                 "--parts", str(args.parts)]

        def one(key: tuple[str, str], r: int) -> dict[str, float]:
            path, case = key
            data = child(__file__, "--child", case, "bench", str(crc), *flags, env=paths[path], timeout=600)
            moved = (args.write_mb << 20) if case in WRITERS else size
            print(f"  run {r + 1}/{args.runs} {path:>14} {case:>16}: {data['seconds']:.2f} s, "
                  f"{moved / data['seconds'] / 1e9:.2f} GB/s, {data['rss_mb']:.0f} MB", flush=True)
            return data

        # each round: every case on one path, then on the other (the case order rotating by round)
        results: dict[tuple[str, str], list[dict[str, float]]] = {}
        for r in range(args.runs):
            for path in paths:
                for case in rotated(args.cases.split(","), r):
                    results.setdefault((path, case), []).append(one((path, case), r))
    rows = []
    for (path, case), values in results.items():
        seconds = median(v["seconds"] for v in values)
        moved = (args.write_mb << 20) if case in WRITERS else size
        rows.append([path, case, f"{seconds:.2f}", f"{moved / seconds / 1e9:.2f}", f"{max(v['rss_mb'] for v in values):.0f}"])
    report = "\n".join([
        f"Machine: {machine_line()}, load average {os.getloadavg()[0]:.2f} at the end.",
        f"One {args.size_mb} MiB object on SeaweedFS, {args.parts} ranged GETs of {args.part_mb} MiB in flight, "
        f"median of {args.runs}, fresh process each (time after imports; RSS includes the {args.size_mb} MiB "
        f"destination). Write cases write {args.write_mb} MiB from memory (RSS includes it).", "",
        markdown(["path", "client", "median s", "GB/s", "peak RSS MB"], rows, align="llrrr")])
    publish_report(report, args.output)


if __name__ == "__main__":
    main()
