#!/usr/bin/env python3
"""Benchmark ``shardkit convert`` (zip pickle and DCP sources) and ``shardkit verify``, in one run.

Builds the SD 1.5 UNet (default, ~3.4 GB fp32) or the SDXL UNet (``--large``, ~10.3 GB) with
random weights, then writes the same state dict as a ``torch.save`` zip pickle and as a
``torch.distributed.checkpoint`` folder (``dcp.save({"model": sd}, no_dist=True)``, as FSDP
training leaves it). Every case runs interleaved, ``--runs`` times (median reported), each in a
fresh process with its peak RSS (getrusage of the children); every write ends with ``sync``.

Groups, each with its own floor:
  * .bin → 5GB shards: ``cp`` of the .bin; shardkit convert; torch.load + save_torch_state_dict
  * DCP  → 5GB shards: ``cp -r`` of the folder; shardkit convert; ``accelerate merge-weights``
  * verify read speed (warm page cache, the 2GB shards): ``cat shards > /dev/null``; a plain read loop
    (1 MiB ``readv``); ``hashlib.file_digest`` sha256 on one thread; ``shardkit verify`` of the shards, of
    the single file, and of the shards ``--against`` the single file

    .venv/bin/python scripts/bench_convert.py --runs 3            # SD 1.5 UNet
    .venv/bin/python scripts/bench_convert.py --large --runs 3    # SDXL UNet
"""

from __future__ import annotations

import os
import subprocess
import sys
from shlex import quote

from benchlib import SK, Case, parser, shell_bench
from build_checkpoint import TORCH_SAVE, build_once, unet_source

# Child-process code saving sys.argv[1] (safetensors) as a DCP folder at sys.argv[2], as FSDP training does.
DCP_SAVE = ("import sys, warnings; warnings.simplefilter('ignore'); import torch.distributed.checkpoint as dcp; "
            "from safetensors.torch import load_file; "
            "dcp.save({'model': load_file(sys.argv[1])}, checkpoint_id=sys.argv[2], no_dist=True)")
# Child-process code reading the files sys.argv[1:] (as ``verify`` must): a plain loop, or sha256 on one thread.
READ_LOOP = ("import mmap, os, sys\nview = memoryview(mmap.mmap(-1, 1 << 20))\nfor p in sys.argv[1:]:\n"
             "    fd = os.open(p, os.O_RDONLY)\n    while os.readv(fd, [view]): pass\n    os.close(fd)")
SHA256 = "import hashlib, sys\nfor p in sys.argv[1:]:\n    hashlib.file_digest(open(p, 'rb'), 'sha256')"
BIN = os.path.dirname(sys.executable)


def size_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def groups(kind: str, work: str) -> dict[str, list[Case]]:
    """Each group's cases (inputs built once), the floor first; named with the input's size."""
    src = unet_source(kind, work)
    pkl = build_once(os.path.join(work, f"{kind}-unet.bin"), TORCH_SAVE, src, hide_stderr=True)
    dcp = build_once(os.path.join(work, f"{kind}-unet-dcp"), DCP_SAVE, src, hide_stderr=True)
    sharded = os.path.join(work, f"{kind}-unet-5GB")
    if not os.path.exists(sharded):
        subprocess.run([os.path.join(BIN, "shardkit"), "split", src, sharded, "--max-shard-size", "2GB", "-q"],
                       check=True)
    out, py = os.path.join(work, "out"), quote(sys.executable)
    q_out, target = quote(out), "≤ 1.5× cp, ≤ 1 GB"
    hub = (f"{quote(sys.executable)} -c \"import torch; from huggingface_hub import save_torch_state_dict; "
           f"save_torch_state_dict(torch.load('{pkl}', weights_only=True, mmap=True), '{out}', max_shard_size='5GB')\"")
    shards = " ".join(quote(p) for p in sorted(os.path.join(sharded, f) for f in os.listdir(sharded)))
    return {
        f"bin ({size_bytes(pkl) / 1e9:.2f} GB)": [
            Case("cp .bin (floor)", f"mkdir -p {q_out} && cp {quote(pkl)} {q_out}/ && sync", cleanup=[out]),
            Case("shardkit convert .bin 5GB", f"{SK} convert {quote(pkl)} {q_out} --max-shard-size 5GB -q && sync",
                 target, [out]),
            Case("torch.load(mmap) + hub save_torch_state_dict", f"mkdir -p {q_out} && {hub} && sync", "incumbent",
                 [out])],
        f"dcp ({size_bytes(dcp) / 1e9:.2f} GB)": [
            Case("cp -r DCP (floor)", f"cp -r {quote(dcp)} {q_out} && sync", cleanup=[out]),
            Case("shardkit convert DCP 5GB", f"{SK} convert {quote(dcp)} {q_out} --max-shard-size 5GB -q && sync",
                 target, [out]),
            Case("accelerate merge-weights", f"{quote(os.path.join(BIN, 'accelerate'))} merge-weights {quote(dcp)} "
                 f"{q_out} >/dev/null 2>&1 && sync", "incumbent (one file)", [out])],
        f"verify ({size_bytes(sharded) / 1e9:.2f} GB)": [
            Case("cat shards > /dev/null (floor, warm)", f"cat {shards} > /dev/null"),
            Case("read loop (1 MiB readv)", f"{py} -c {quote(READ_LOOP)} {shards}"),
            Case("hashlib.file_digest sha256 (1 thread)", f"{py} -c {quote(SHA256)} {shards}"),
            Case("shardkit verify", f"{SK} verify {quote(sharded)} -q", "≥ 0.8× cat speed"),
            Case("shardkit verify of the single file", f"{SK} verify {quote(src)} -q"),
            Case("shardkit verify --against the single file", f"{SK} verify {quote(sharded)} --against {quote(src)} -q",
                 "reads both")],
    }


def main() -> int:
    p = parser(__doc__, work="bench-data")
    p.add_argument("--large", action="store_true", help="SDXL UNet (~10.3 GB) instead of SD 1.5 (~3.4 GB)")
    p.add_argument("--tiny", action="store_true", help="a few MB, to check the script itself")
    args = p.parse_args()
    kind = "tiny" if args.tiny else "sdxl" if args.large else "sd15"
    os.makedirs(args.work, exist_ok=True)
    shell_bench(f"convert benchmark: {kind} UNet", groups(kind, args.work), runs=args.runs, output=args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
