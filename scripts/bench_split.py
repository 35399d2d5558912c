#!/usr/bin/env python3
"""Benchmark ``shardkit split`` (and ``merge``) against ``cp`` (the floor) and huggingface_hub, in one run.

Builds the SDXL UNet (default, ~10.3 GB fp32) or the SD 1.5 UNet (``--size sd15``, ~3.4 GB) as
one .safetensors file with random weights, plus a ``torch.save`` pickle of the same state dict,
then runs every case interleaved, ``--runs`` times (median reported), each in a fresh process
with its peak RSS. Every write case ends with ``sync`` so timings include getting bytes to disk.

``--fs xfs`` (or ``btrfs``) runs the copy-on-write cases instead, on a fresh filesystem made in
a sparse image under ``--work`` and loop-mounted there (needs root; installs xfsprogs or
btrfs-progs with apt-get when missing; unmounted and deleted at the end): ``cp
--reflink=never``, ``cp --reflink=always`` (the floor), split at 2 GB and 5 GB, huggingface_hub's
path and a merge of 5 GB shards back into one file.

    .venv/bin/python scripts/bench_split.py --size sd15 --runs 3
    .venv/bin/python scripts/bench_split.py --runs 5 --output bench-ext4.md
    .venv/bin/python scripts/bench_split.py --fs xfs --runs 5 --output bench-xfs.md
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
    filesystem_line,
    loop_mount,
    machine_line,
    publish_report,
    run_interleaved,
    table,
)


def prepare(kind: str, work: str) -> tuple[str, str]:
    src = build_unet_source(kind, work)
    pickle = build_once(os.path.join(work, f"{kind}-unet.bin"), TORCH_SAVE, src,
                        note=" (torch.save of the same state dict)")
    return src, pickle


def _commands() -> tuple[str, str]:
    bin_dir = os.path.dirname(sys.executable)
    return shlex.quote(os.path.join(bin_dir, "shardkit")), shlex.quote(sys.executable)


def _hub_command(src: str, out: str) -> str:
    _, py = _commands()
    return (f"{py} -c \"from safetensors.torch import load_file; from huggingface_hub import save_torch_state_dict; "
            f"save_torch_state_dict(load_file('{src}'), '{out}', max_shard_size='5GB')\"")


def cases(src: str, pickle: str, work: str, *, with_diffusers: bool) -> list[Case]:
    sk, py = _commands()
    out = os.path.join(work, "out")
    q_src, q_pkl, q_out = shlex.quote(src), shlex.quote(pickle), shlex.quote(out)
    shards = _shards_once(src, os.path.join(work, "shards-5GB"))
    merged = os.path.join(work, "merged.safetensors")
    result = [
        Case("cp (floor)", f"mkdir -p {q_out} && cp {q_src} {q_out}/ && sync", cleanup=[out]),
        Case("shardkit split 2GB", f"{sk} split {q_src} {q_out} --max-shard-size 2GB -q && sync",
             "≤ 1.10× cp, ≤ 300 MB", [out]),
        Case("shardkit split 5GB", f"{sk} split {q_src} {q_out} --max-shard-size 5GB -q && sync",
             "≤ 1.10× cp, ≤ 300 MB", [out]),
        Case("shardkit split 5GB --dtype bf16", f"{sk} split {q_src} {q_out} --max-shard-size 5GB --dtype bf16 -q && sync",
             "≤ 1.3× cp", [out]),
        Case("shardkit merge of the 5GB shards", f"{sk} merge {shlex.quote(shards)} {shlex.quote(merged)} -q && sync",
             "≤ 1.10× cp", [merged]),
        Case("cp of the pickle (its floor)", f"mkdir -p {q_out} && cp {q_pkl} {q_out}/ && sync", cleanup=[out]),
        Case("shardkit split pickle source", f"{sk} split {q_pkl} {q_out} --max-shard-size 5GB -q && sync",
             "≤ 1.5× cp, ≤ 1 GB", [out], floor="cp of the pickle (its floor)"),
        Case("hub save_torch_state_dict(load_file)", f"mkdir -p {q_out} && {_hub_command(src, out)} && sync",
             "incumbent", [out]),
    ]
    if with_diffusers:
        code = (f"from diffusers import UNet2DConditionModel; "
                f"UNet2DConditionModel.from_pretrained('{os.path.dirname(src)}').save_pretrained('{out}', max_shard_size='5GB')")
        result.append(Case("diffusers from_pretrained+save_pretrained", f"{py} -c \"{code}\" && sync", "incumbent", [out]))
    return result


def cow_cases(src: str, mount: str) -> list[Case]:
    """The copy-on-write cases, all inside the loop-mounted filesystem ``mount``."""
    sk, _ = _commands()
    out, merged = os.path.join(mount, "out"), os.path.join(mount, "merged.safetensors")
    q_src, q_out = shlex.quote(src), shlex.quote(out)
    shards = _shards_once(src, os.path.join(mount, "shards-5GB"))
    return [
        Case("cp --reflink=never", f"mkdir -p {q_out} && cp --reflink=never {q_src} {q_out}/ && sync", cleanup=[out]),
        Case("cp --reflink=always (floor)", f"mkdir -p {q_out} && cp --reflink=always {q_src} {q_out}/ && sync",
             cleanup=[out]),
        Case("shardkit split 2GB", f"{sk} split {q_src} {q_out} --max-shard-size 2GB -q && sync",
             "≤ 2× floor, < 5% of copying cp", [out]),
        Case("shardkit split 5GB", f"{sk} split {q_src} {q_out} --max-shard-size 5GB -q && sync",
             "≤ 2× floor, < 5% of copying cp", [out]),
        Case("shardkit split 2GB --no-manifest", f"{sk} split {q_src} {q_out} --max-shard-size 2GB --no-manifest -q && sync",
             "≤ 2× floor, < 5% of copying cp", [out]),
        Case("shardkit reshard its 5GB shards to 2GB", f"{sk} split {shlex.quote(shards)} {q_out} --max-shard-size 2GB -q "
             "&& sync", "≤ 2× floor, < 5% of copying cp (crc32s carried from the manifest)", [out]),
        Case("shardkit merge of the 5GB shards", f"{sk} merge {shlex.quote(shards)} {shlex.quote(merged)} -q && sync",
             "≤ 2× floor, < 5% of copying cp", [merged]),
        Case("hub save_torch_state_dict(load_file)", f"mkdir -p {q_out} && {_hub_command(src, out)} && sync",
             "incumbent", [out]),
    ]


def _shards_once(src: str, folder: str) -> str:
    """5 GB shards of ``src`` for the merge case, split once (the merge reads them, never changes them)."""
    if not os.path.isdir(folder):
        sk, _ = _commands()
        subprocess.run([sk.strip("'"), "split", src, folder, "--max-shard-size", "5GB", "-q"], check=True)
    return folder


def run_cow(args: argparse.Namespace, src: str) -> str:
    """Copy the source into a fresh loop-mounted ``args.fs`` and time the copy-on-write cases there."""
    size = os.path.getsize(src)
    image = os.path.abspath(os.path.join(args.work, f"{args.fs}.img"))
    with loop_mount(args.fs, image, 2 * size + 6 * 10**9) as mount:
        inner = os.path.join(mount, "unet", os.path.basename(src))
        os.makedirs(os.path.dirname(inner))
        print(f"copying the source into {mount} ...", flush=True)
        subprocess.run(["cp", "--reflink=never", src, inner], check=True)
        all_cases = cow_cases(inner, mount)
        run_interleaved(all_cases, runs=args.runs)
        fs_line = f"{filesystem_line(mount)} (a sparse image on {filesystem_line(args.work)}, loop-mounted)"
    return (f"copy-on-write split benchmark: {args.size} UNet, {size / 1e9:.2f} GB fp32 safetensors, median of "
            f"{args.runs} runs, interleaved, each write followed by sync\nmachine: {machine_line()}\n"
            f"filesystem: {fs_line}\n\n{table(all_cases, floor='cp --reflink=always (floor)', also='cp --reflink=never')}\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["sd15", "sdxl", "tiny"], default="sdxl")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--work", default="bench-data")
    parser.add_argument("--fs", choices=["xfs", "btrfs"], help="copy-on-write cases on a loop-mounted filesystem")
    parser.add_argument("--with-diffusers", action="store_true", help="also time diffusers save_pretrained (needs ~2× RAM)")
    parser.add_argument("--output", help="write the markdown table here too")
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)
    if args.fs:
        publish_report(run_cow(args, build_unet_source(args.size, args.work)), args.output)
        return 0
    src, pickle = prepare(args.size, args.work)
    size_gb = os.path.getsize(src) / 1e9
    all_cases = cases(src, pickle, args.work, with_diffusers=args.with_diffusers)
    run_interleaved(all_cases, runs=args.runs)
    report = (f"split benchmark: {args.size} UNet, {size_gb:.2f} GB fp32 safetensors, median of {args.runs} runs, "
              f"interleaved, each write followed by sync\nmachine: {machine_line()}\n"
              f"filesystem: {filesystem_line(args.work)}\n\n{table(all_cases, floor='cp (floor)')}\n")
    publish_report(report, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
