#!/usr/bin/env python3
"""Benchmark ``shardkit split`` (and ``merge``) against ``cp`` (the floor) and huggingface_hub, in one run; ``--fs xfs``
(or ``btrfs``): the copy-on-write cases on a loop-mounted filesystem.
Method: docs/benchmarks.md, "How each benchmark measures".

    .venv/bin/python scripts/bench_split.py --size sd15 --runs 3
    .venv/bin/python scripts/bench_split.py --runs 5 --output bench-ext4.md
    .venv/bin/python scripts/bench_split.py --fs xfs --runs 5 --output bench-xfs.md
"""

from __future__ import annotations

import os
import subprocess
import sys
from shlex import quote

from benchlib import SK, Case, filesystem_line, loop_mount, parser, shell_bench
from build_checkpoint import TORCH_SAVE, build_once, unet_source

COW = "≤ 2× floor, < 5% of copying cp"


def split_case(name: str, src: str, out: str, flags: str, target: str, **kw: str) -> Case:
    return Case(name, f"{SK} split {quote(src)} {quote(out)} {flags} -q && sync", target, [out], **kw)


def copy_case(name: str, src: str, out: str, cp: str = "cp") -> Case:
    return Case(name, f"mkdir -p {quote(out)} && {cp} {quote(src)} {quote(out)}/ && sync", cleanup=[out])


def shared_cases(src: str, root: str, merge_target: str) -> list[Case]:
    """The merge of 5 GB shards (split once; the merge only reads them) and huggingface_hub's path."""
    shards, out, merged = os.path.join(root, "shards-5GB"), os.path.join(root, "out"), os.path.join(root, "merged.safetensors")
    if not os.path.isdir(shards):
        subprocess.run([SK.strip("'"), "split", src, shards, "--max-shard-size", "5GB", "-q"], check=True)
    hub = (f"{quote(sys.executable)} -c \"from safetensors.torch import load_file; from huggingface_hub import "
           f"save_torch_state_dict; save_torch_state_dict(load_file('{src}'), '{out}', max_shard_size='5GB')\"")
    return [Case("shardkit merge of the 5GB shards", f"{SK} merge {quote(shards)} {quote(merged)} -q && sync",
                 merge_target, [merged]),
            Case("hub save_torch_state_dict(load_file)", f"mkdir -p {quote(out)} && {hub} && sync", "incumbent", [out])]


def cases(src: str, pickle: str, work: str, *, with_diffusers: bool) -> list[Case]:
    out = os.path.join(work, "out")
    merge, hub = shared_cases(src, work, "≤ 1.10× cp")
    result = [
        copy_case("cp (floor)", src, out),
        split_case("shardkit split 2GB", src, out, "--max-shard-size 2GB", "≤ 1.10× cp, ≤ 300 MB"),
        split_case("shardkit split 5GB", src, out, "--max-shard-size 5GB", "≤ 1.10× cp, ≤ 300 MB"),
        split_case("shardkit split 5GB --dtype bf16", src, out, "--max-shard-size 5GB --dtype bf16", "≤ 1.3× cp"),
        merge,
        copy_case("cp of the pickle (its floor)", pickle, out),
        split_case("shardkit split pickle source", pickle, out, "--max-shard-size 5GB", "≤ 1.5× cp, ≤ 1 GB",
                   floor="cp of the pickle (its floor)"),
        hub,
    ]
    if with_diffusers:
        code = (f"from diffusers import UNet2DConditionModel; UNet2DConditionModel.from_pretrained("
                f"'{os.path.dirname(src)}').save_pretrained('{out}', max_shard_size='5GB')")
        result.append(Case("diffusers from_pretrained+save_pretrained", f"{quote(sys.executable)} -c \"{code}\" && sync",
                           "incumbent", [out]))
    return result


def cow_cases(src: str, mount: str) -> list[Case]:
    """The copy-on-write cases, all inside the loop-mounted filesystem ``mount``."""
    out = os.path.join(mount, "out")
    merge, hub = shared_cases(src, mount, COW)
    return [
        copy_case("cp --reflink=always (floor)", src, out, "cp --reflink=always"),
        copy_case("cp --reflink=never", src, out, "cp --reflink=never"),
        split_case("shardkit split 2GB", src, out, "--max-shard-size 2GB", COW),
        split_case("shardkit split 5GB", src, out, "--max-shard-size 5GB", COW),
        split_case("shardkit split 2GB --no-manifest", src, out, "--max-shard-size 2GB --no-manifest", COW),
        split_case("shardkit reshard its 5GB shards to 2GB", os.path.join(mount, "shards-5GB"), out,
                   "--max-shard-size 2GB", COW + " (crc32s carried from the manifest)"),
        merge,
        hub,
    ]


def main() -> int:
    p = parser(__doc__, work="bench-data")
    p.add_argument("--size", choices=["sd15", "sdxl", "tiny"], default="sdxl")
    p.add_argument("--fs", choices=["xfs", "btrfs"], help="copy-on-write cases on a loop-mounted filesystem")
    p.add_argument("--with-diffusers", action="store_true", help="also time diffusers save_pretrained (needs ~2× RAM)")
    args = p.parse_args()
    os.makedirs(args.work, exist_ok=True)
    src = unet_source(args.size, args.work)
    size = os.path.getsize(src)
    title = f"{args.size} UNet, {size / 1e9:.2f} GB fp32 safetensors"
    if args.fs:  # copy the source into a fresh loop-mounted filesystem and time the copy-on-write cases there
        with loop_mount(args.fs, os.path.abspath(os.path.join(args.work, f"{args.fs}.img")), 2 * size + 6 * 10**9) as mnt:
            inner = os.path.join(mnt, "unet", os.path.basename(src))
            os.makedirs(os.path.dirname(inner))
            print(f"copying the source into {mnt} ...", flush=True)
            subprocess.run(["cp", "--reflink=never", src, inner], check=True)
            shell_bench(f"copy-on-write split benchmark: {title}", {"": cow_cases(inner, mnt)}, runs=args.runs,
                        output=args.output, also="cp --reflink=never", note=f"filesystem: {filesystem_line(mnt)} "
                        f"(a sparse image on {filesystem_line(args.work)}, loop-mounted)")
        return 0
    pickle = build_once(os.path.join(args.work, f"{args.size}-unet.bin"), TORCH_SAVE, src,
                        note=" (torch.save of the same state dict)")
    shell_bench(f"split benchmark: {title}", {"": cases(src, pickle, args.work, with_diffusers=args.with_diffusers)},
                runs=args.runs, output=args.output, note=f"filesystem: {filesystem_line(args.work)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
