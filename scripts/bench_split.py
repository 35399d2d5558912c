#!/usr/bin/env python3
"""Benchmark ``shardkit split`` against ``cp`` (the floor) and huggingface_hub, in one run.

Builds the SDXL UNet (default, ~10.3 GB fp32) or the SD 1.5 UNet (``--size sd15``, ~3.4 GB) as
one .safetensors file with random weights, plus a ``torch.save`` pickle of the same state dict,
then runs every case interleaved, ``--runs`` times (median reported), each in a fresh process
with its peak RSS. Every write case ends with ``sync`` so timings include getting bytes to disk.

    .venv/bin/python scripts/bench_split.py --size sd15 --runs 3
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from benchlib import (TORCH_SAVE, Case, build_once, build_unet_source, machine_line,  # noqa: E402
                      publish_report, run_interleaved, table)


def prepare(kind: str, work: str) -> tuple[str, str]:
    src = build_unet_source(kind, work)
    pickle = build_once(os.path.join(work, f"{kind}-unet.bin"), TORCH_SAVE, src,
                        note=" (torch.save of the same state dict)")
    return src, pickle


def cases(src: str, pickle: str, work: str, *, with_diffusers: bool) -> list[Case]:
    bin_dir = os.path.dirname(sys.executable)
    sk = shlex.quote(os.path.join(bin_dir, "shardkit"))
    py = shlex.quote(sys.executable)
    out = os.path.join(work, "out")
    q_src, q_pkl, q_out = shlex.quote(src), shlex.quote(pickle), shlex.quote(out)
    hub = (f"{py} -c \"from safetensors.torch import load_file; from huggingface_hub import save_torch_state_dict; "
           f"save_torch_state_dict(load_file('{src}'), '{out}', max_shard_size='5GB')\"")
    result = [
        Case("cp (floor)", f"mkdir -p {q_out} && cp {q_src} {q_out}/ && sync", cleanup=[out]),
        Case("shardkit split 2GB", f"{sk} split {q_src} {q_out} --max-shard-size 2GB -q && sync",
             "≤ 1.10× cp, ≤ 300 MB", [out]),
        Case("shardkit split 5GB", f"{sk} split {q_src} {q_out} --max-shard-size 5GB -q && sync",
             "≤ 1.10× cp, ≤ 300 MB", [out]),
        Case("shardkit split 5GB --dtype bf16", f"{sk} split {q_src} {q_out} --max-shard-size 5GB --dtype bf16 -q && sync",
             "≤ 1.3× cp", [out]),
        Case("cp of the pickle (its floor)", f"mkdir -p {q_out} && cp {q_pkl} {q_out}/ && sync", cleanup=[out]),
        Case("shardkit split pickle source", f"{sk} split {q_pkl} {q_out} --max-shard-size 5GB -q && sync",
             "≤ 1.5× cp, ≤ 1 GB", [out], floor="cp of the pickle (its floor)"),
        Case("hub save_torch_state_dict(load_file)", f"mkdir -p {q_out} && {hub} && sync", "incumbent", [out]),
    ]
    if with_diffusers:
        code = (f"from diffusers import UNet2DConditionModel; "
                f"UNet2DConditionModel.from_pretrained('{os.path.dirname(src)}').save_pretrained('{out}', max_shard_size='5GB')")
        result.append(Case("diffusers from_pretrained+save_pretrained", f"{py} -c \"{code}\" && sync", "incumbent", [out]))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["sd15", "sdxl", "tiny"], default="sdxl")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--work", default="bench-data")
    parser.add_argument("--with-diffusers", action="store_true", help="also time diffusers save_pretrained (needs ~2× RAM)")
    parser.add_argument("--output", help="write the markdown table here too")
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)
    src, pickle = prepare(args.size, args.work)
    size_gb = os.path.getsize(src) / 1e9
    all_cases = cases(src, pickle, args.work, with_diffusers=args.with_diffusers)
    run_interleaved(all_cases, runs=args.runs)
    report = (f"split benchmark: {args.size} UNet, {size_gb:.2f} GB fp32 safetensors, median of {args.runs} runs, "
              f"interleaved, each write followed by sync\nmachine: {machine_line()}\n\n{table(all_cases, floor='cp (floor)')}\n")
    publish_report(report, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
