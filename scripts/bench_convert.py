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
  * verify read speed (warm page cache): ``cat shards > /dev/null``; ``shardkit verify``

    .venv/bin/python scripts/bench_convert.py --runs 3            # SD 1.5 UNet
    .venv/bin/python scripts/bench_convert.py --large --runs 3    # SDXL UNet
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from benchlib import (  # noqa: E402
    TORCH_SAVE,
    Case,
    build_once,
    build_unet_source,
    machine_line,
    publish_report,
    run_interleaved,
    table,
)

# Child-process code saving sys.argv[1] (safetensors) as a DCP folder at sys.argv[2], as FSDP training does.
DCP_SAVE = ("import sys, warnings; warnings.simplefilter('ignore'); import torch.distributed.checkpoint as dcp; "
            "from safetensors.torch import load_file; "
            "dcp.save({'model': load_file(sys.argv[1])}, checkpoint_id=sys.argv[2], no_dist=True)")


def prepare(kind: str, work: str) -> dict[str, str]:
    """Build (once) the safetensors source, its zip pickle, its DCP folder and a sharded copy."""
    src = build_unet_source(kind, work)
    paths = {"src": src, "bin": os.path.join(work, f"{kind}-unet.bin"), "dcp": os.path.join(work, f"{kind}-unet-dcp"),
             "sharded": os.path.join(work, f"{kind}-unet-5GB")}
    build_once(paths["bin"], TORCH_SAVE, src, hide_stderr=True)
    build_once(paths["dcp"], DCP_SAVE, src, hide_stderr=True)
    if not os.path.exists(paths["sharded"]):
        sk = os.path.join(os.path.dirname(sys.executable), "shardkit")
        subprocess.run([sk, "split", src, paths["sharded"], "--max-shard-size", "2GB", "-q"], check=True)
    return paths


def _size_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _has_verify(sk: str) -> bool:
    return subprocess.run([sk, "verify", "--help"], capture_output=True).returncode == 0


def groups(paths: dict[str, str], work: str) -> dict[str, list[Case]]:
    bin_dir = os.path.dirname(sys.executable)
    sk = os.path.join(bin_dir, "shardkit")
    q = {k: shlex.quote(v) for k, v in paths.items()}
    out = os.path.join(work, "out")
    q_out, q_sk, py = shlex.quote(out), shlex.quote(sk), shlex.quote(sys.executable)
    accelerate = shlex.quote(os.path.join(bin_dir, "accelerate"))
    hub = (f"{py} -c \"import torch; from huggingface_hub import save_torch_state_dict; "
           f"save_torch_state_dict(torch.load('{paths['bin']}', weights_only=True, mmap=True), '{out}', "
           f"max_shard_size='5GB')\"")
    result = {
        "bin": [
            Case("cp .bin (floor)", f"mkdir -p {q_out} && cp {q['bin']} {q_out}/ && sync", cleanup=[out]),
            Case("shardkit convert .bin 5GB", f"{q_sk} convert {q['bin']} {q_out} --max-shard-size 5GB -q && sync",
                 "≤ 1.5× cp, ≤ 1 GB", [out]),
            Case("torch.load(mmap) + hub save_torch_state_dict", f"mkdir -p {q_out} && {hub} && sync", "incumbent",
                 [out]),
        ],
        "dcp": [
            Case("cp -r DCP (floor)", f"cp -r {q['dcp']} {q_out} && sync", cleanup=[out]),
            Case("shardkit convert DCP 5GB", f"{q_sk} convert {q['dcp']} {q_out} --max-shard-size 5GB -q && sync",
                 "≤ 1.5× cp, ≤ 1 GB", [out]),
            Case("accelerate merge-weights", f"{accelerate} merge-weights {q['dcp']} {q_out} >/dev/null 2>&1 && sync",
                 "incumbent (one file)", [out]),
        ],
    }
    if _has_verify(sk):
        shards = " ".join(shlex.quote(os.path.join(paths["sharded"], f)) for f in sorted(os.listdir(paths["sharded"])))
        result["verify"] = [
            Case("cat shards > /dev/null (floor, warm)", f"cat {shards} > /dev/null"),
            Case("shardkit verify", f"{q_sk} verify {q['sharded']} -q", "≥ 0.8× cat speed"),
        ]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--large", action="store_true", help="SDXL UNet (~10.3 GB) instead of SD 1.5 (~3.4 GB)")
    parser.add_argument("--tiny", action="store_true", help="a few MB, to check the script itself")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--work", default="bench-data")
    parser.add_argument("--output", help="write the markdown tables here too")
    args = parser.parse_args()
    kind = "tiny" if args.tiny else "sdxl" if args.large else "sd15"
    os.makedirs(args.work, exist_ok=True)
    paths = prepare(kind, args.work)
    all_groups = groups(paths, args.work)
    run_interleaved([c for cases in all_groups.values() for c in cases], runs=args.runs)
    floors = {"bin": "cp .bin (floor)", "dcp": "cp -r DCP (floor)", "verify": "cat shards > /dev/null (floor, warm)"}
    sizes = {"bin": _size_bytes(paths["bin"]), "dcp": _size_bytes(paths["dcp"]), "verify": _size_bytes(paths["sharded"])}
    parts = [f"convert benchmark: {kind} UNet, median of {args.runs} runs, interleaved, each write followed by sync",
             f"machine: {machine_line()}"]
    for name, cases in all_groups.items():
        parts.append(f"\n{name} ({sizes[name] / 1e9:.2f} GB):\n{table(cases, floor=floors[name])}")
    if "verify" not in all_groups:
        parts.append("\n(shardkit verify not available: verify read speed not measured)")
    report = "\n".join(parts) + "\n"
    publish_report(report, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
