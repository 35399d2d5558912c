"""verify read speed vs `cat FILES > /dev/null` on warm files (median of N runs, same process tree)."""
import hashlib
import json
import mmap
import os
import statistics
import struct
import subprocess
import sys
import time

import shardkit
from shardkit.checking.verify import verify

root = sys.argv[1]
total_bytes = int(float(sys.argv[2]) * 1e9)
runs = int(sys.argv[3]) if len(sys.argv) > 3 else 3
single = os.path.join(root, "model.safetensors")
sharded = os.path.join(root, "sharded")
if not os.path.exists(single):
    n_tensors = 64
    per = total_bytes // n_tensors // 4 * 4
    header = {f"w{i}": {"dtype": "F32", "shape": [per // 4], "data_offsets": [i * per, (i + 1) * per]} for i in range(n_tensors)}
    raw = json.dumps(header).encode(); raw += b" " * (-len(raw) % 8)
    with open(single, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        block = os.urandom(64 << 20)
        left = per * n_tensors
        while left:
            f.write(block[:min(left, len(block))]); left -= min(left, len(block))
    shardkit.split(single, sharded, max_shard_size=total_bytes // 4 + 1)
shards = sorted(os.path.join(sharded, n) for n in os.listdir(sharded))

def timed(fn):
    fn()  # warm the page cache
    times = []
    for _ in range(runs):
        t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
    return statistics.median(times)

def cat(files):
    return lambda: subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)

def read_only(files):
    def run():
        buf = mmap.mmap(-1, 1 << 20); view = memoryview(buf)
        for p in files:
            fd = os.open(p, os.O_RDONLY)
            while os.readv(fd, [view]):
                pass
            os.close(fd)
    return run

def sha_only(files):
    def run():
        for p in files:
            with open(p, "rb") as f:
                hashlib.file_digest(f, "sha256")
    return run

size_single = os.path.getsize(single)
size_sharded = sum(os.path.getsize(p) for p in shards)
results = {}
for label, files, size, target in (("single file", [single], size_single, single),
                                   (f"{len(shards) - 1} shards + index", shards, size_sharded, sharded)):
    t_cat = timed(cat(files))
    t_read = timed(read_only(files))
    t_hash = timed(sha_only(files))
    t_verify = timed(lambda target=target: verify(target))
    row = {"GB": size / 1e9, "cat GB/s": size / t_cat / 1e9, "read loop GB/s": size / t_read / 1e9,
           "hashlib.file_digest (1 thread) GB/s": size / t_hash / 1e9, "verify GB/s": size / t_verify / 1e9,
           "verify / cat": t_cat / t_verify, "read loop / cat": t_cat / t_read}
    results[label] = row
t_against = timed(lambda: verify(sharded, against=single))
results["shards --against single"] = {"verify --against GB/s": size_sharded / t_against / 1e9}
print(json.dumps({"cpus": os.cpu_count(), "runs": runs, **results}, indent=2))
