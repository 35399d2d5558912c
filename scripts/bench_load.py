#!/usr/bin/env python3
"""Benchmark loading sharded checkpoints: shardkit.load_model against the floor and the incumbents.

Builds the SDXL UNet (default, ~10.3 GB fp32) or with ``--small`` the SD 1.5 UNet (~3.4 GB) with
random weights, splits it into shards with shardkit, then runs every case interleaved,
``--runs`` times (median reported), each in a fresh process:

* ``safetensors.torch.load_file`` over all shards (the floor; since safetensors 0.6 it maps the
  files lazily, so it reads nothing until a tensor is used), and a meta skeleton filled from it
  with ``load_state_dict(assign=True)`` (the least work that yields a model)
* ``shardkit.load_model(device_map="cpu")``
* ``accelerate.load_checkpoint_and_dispatch`` into an ``init_empty_weights`` skeleton
* ``UNet2DConditionModel.from_pretrained``
* disk offload: ``max_memory={"cpu": 4GiB}`` (scaled to the model for ``--small``) + offload
  folder, for shardkit and accelerate: time, RSS and bytes written to the offload folder
* ``shardkit plan`` for the 12B FLUX.1-dev transformer skeleton (whole process: imports included)
* with CUDA: host → GPU 0 for shardkit and accelerate

"load s" is the load call alone (imports excluded, the same for every case); "process s" is the
whole process. "peak RSS" is the process's high-water mark (VmHWM); "above imports" subtracts the
RSS after imports. Checkpoint pages are in the page cache (warm) for every run after the first.

    .venv/bin/python scripts/bench_load.py --small --runs 3

``--read-backends`` runs the read-backend matrix instead (issue 13): an SD 1.5 UNet in fp16
(~1.7 GB, one file), on the local disk and on a bindfs (FUSE passthrough) mount of the same
folder, page cache cold (evicted with POSIX_FADV_DONTNEED, checked with mincore) and warm; floors
``dd bs=16M``; cases safetensors ``load_file`` (mmap and pread), accelerate, diffusers and
``shardkit.load_model`` with each ``read=`` backend. Every case loads and then touches one byte of
every page of every weight; the time is measured inside the fresh child process, so interpreter
start-up and imports are excluded (dd runs alone: its start-up is negligible).

    .venv/bin/python scripts/bench_load.py --read-backends --runs 3

``--latency-ms 0.5 2 5`` runs the latency benchmark instead (issue 22, :mod:`bench_latency`): the
SD 1.5 UNet in fp16 read through a FUSE mount that sleeps that long in every read request
(:mod:`latency_mount`), for safetensors, fastsafetensors, diffusers and shardkit's lazy mapping,
``to_state_dict`` and ``load_model``, plus the local cold disk and the mount's limit.

    .venv/bin/python scripts/bench_load.py --latency-ms 0.5 2 5 --runs 3

``--bindfs`` adds the zero-latency FUSE case to it (a bindfs mount, backing files evicted before
each run); ``--latency-ms 0`` is the latency mount adding nothing (a Python FUSE server).

    .venv/bin/python scripts/bench_load.py --latency-ms 0 2 --bindfs --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FLUX_DEV = {
    "_class_name": "FluxTransformer2DModel", "in_channels": 64, "num_layers": 19, "num_single_layers": 38,
    "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
    "pooled_projection_dim": 768, "guidance_embeds": True, "axes_dims_rope": [16, 56, 56], "patch_size": 1,
}


# ------------------------------------------------------------------------- cases (child side)

def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _skeleton(folder: str):
    from accelerate import init_empty_weights
    from diffusers import UNet2DConditionModel

    with init_empty_weights():
        return UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(folder))


def _floor(folder: str, *, backend: str = "mmap", device_map="cpu", **_):
    from safetensors.torch import load_file

    device = "cuda:0" if device_map == 0 else "cpu"
    state = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(folder, name), device=device, backend=backend))
    return state


def _fastsafetensors(folder: str, *, device_map="cpu", **_):
    """fastsafetensors (no GDS) into a meta skeleton; its buffers back the tensors, so it stays open with the model."""
    from fastsafetensors import fastsafe_open

    files = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))
    opened = fastsafe_open(filenames=files, nogds=True, device="cuda:0" if device_map == 0 else "cpu")
    reader = opened.__enter__()
    model = _skeleton(folder)
    model.load_state_dict({k: reader.get_tensor(k) for k in reader.keys()}, assign=True, strict=True)
    model._bench_reader = opened
    return model


def _shardkit(folder: str, *, device_map="cpu", max_memory=None, offload=None, read="auto", **_):
    from diffusers import UNet2DConditionModel

    import shardkit

    return shardkit.load_model(UNet2DConditionModel, folder, config=folder, device_map=device_map,
                               max_memory=max_memory, offload_folder=offload, read=read)


def _accelerate(folder: str, *, device_map="cpu", max_memory=None, offload=None, **_):
    from accelerate import load_checkpoint_and_dispatch

    device_map = {"": device_map} if device_map in ("cpu", 0) else device_map
    files = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
    single = len(files) == 1 and not any(f.endswith(".index.json") for f in os.listdir(folder))
    return load_checkpoint_and_dispatch(_skeleton(folder), os.path.join(folder, files[0]) if single else folder, device_map=device_map, max_memory=max_memory,
                                        offload_folder=offload)


def _diffusers(folder: str, **_):
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel.from_pretrained(folder)


def _assign(folder: str, **_):
    model = _skeleton(folder)
    model.load_state_dict(_floor(folder), assign=True, strict=True)
    return model


CASES = {"floor": _floor, "assign": _assign, "shardkit": _shardkit, "accelerate": _accelerate,
         "diffusers": _diffusers, "fastsafetensors": _fastsafetensors}


def run_case(name: str, folder: str, options: dict) -> None:
    """Child process: import, load, print one JSON line."""
    import accelerate  # noqa: F401
    import accelerate.big_modeling  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401  (imports are not part of the load time)
    from diffusers import UNet2DConditionModel  # noqa: F401  (diffusers imports its models lazily)

    import shardkit.loading.load  # noqa: F401

    base = _status_bytes("VmRSS")
    start = time.perf_counter()
    loaded = CASES[name](folder, **options)
    if options.get("device_map") == 0:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    loaded_hwm = _status_bytes("VmHWM")
    tensors = loaded.values() if isinstance(loaded, dict) else list(loaded.parameters()) + list(loaded.buffers())
    page = 4096
    for tensor in tensors:  # use every weight once: lazily mapped pages become resident here
        if tensor.is_meta or not tensor.numel():
            continue
        if options.get("touch") == "pages":  # one byte per page: I/O, not arithmetic, is measured
            tensor.reshape(-1).view(torch.uint8)[::page].sum().item()
        else:
            tensor.float().sum().item()
    touched = time.perf_counter() - start
    offload = options.get("offload")
    written = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(offload) for f in fs) if offload else 0
    print(json.dumps({"load_s": seconds, "touch_s": touched, "base": base, "loaded_hwm": loaded_hwm,
                      "hwm": _status_bytes("VmHWM"), "written": written}))
    del loaded


# ------------------------------------------------------------------------- orchestration (parent side)

def prepare(kind: str, work: str, *, dtype: str = "F32", shards: int | None = None) -> tuple[str, int]:
    """The UNet with random weights, sharded by shardkit (5GB/2GB shards, or ``shards`` of them), built once."""
    sys.path.insert(0, HERE)
    import shardkit

    folder = os.path.join(work, f"{kind}-unet-{dtype.lower()}-sharded")
    if not os.path.exists(os.path.join(folder, "config.json")):
        from build_checkpoint import build_unet

        single = os.path.join(work, f"{kind}-unet")
        print(f"building {single} ...", flush=True)
        build_unet(kind, single, dtype=dtype, overwrite=True)
        size = os.path.getsize(os.path.join(single, "diffusion_pytorch_model.safetensors"))
        limit = str(size // shards + (64 << 20)) if shards else "5GB" if kind == "sdxl" else "2GB"
        shardkit.split(single, folder, max_shard_size=limit, overwrite=True)
        shutil.copy(os.path.join(single, "config.json"), folder)
        shutil.rmtree(single)
    with shardkit.open(folder) as ckpt:
        return folder, ckpt.nbytes()


def measure(args: list[str]) -> dict:
    start = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"case failed ({done.returncode}): {' '.join(args)}\n{done.stderr[-3000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if args and args[0] == "dd":  # a floor timed from outside
        return {"load_s": wall, "touch_s": wall, "base": 0, "loaded_hwm": 0, "hwm": 0, "written": 0, "wall_s": wall}
    result = json.loads(lines[-1]) if lines else {}
    result["wall_s"] = wall
    return result


def build_cases(folder: str, model_bytes: int, work: str, *, gpu: bool,
                only: list[str] = ()) -> list[tuple[str, list[str], str | None]]:
    me = [sys.executable, os.path.abspath(__file__), "--case"]
    budget = 4 * 2**30 if model_bytes > 8e9 else int(model_bytes * 4 * 2**30 / 10.3e9)
    cases: list[tuple[str, list[str], str | None]] = [
        ("safetensors load_file (floor)", [*me, "floor", folder, "{}"], None),
        ("meta skeleton + load_file + load_state_dict(assign=True)", [*me, "assign", folder, "{}"], None),
        ("shardkit.load_model cpu", [*me, "shardkit", folder, "{}"], None),
        ("accelerate.load_checkpoint_and_dispatch cpu", [*me, "accelerate", folder, "{}"], None),
        ("diffusers from_pretrained", [*me, "diffusers", folder, "{}"], None),
    ]
    for label, case in (("shardkit.load_model", "shardkit"), ("accelerate", "accelerate")):
        off = os.path.join(work, f"offload-{case}")
        opts = json.dumps({"device_map": "auto", "max_memory": {"cpu": budget}, "offload": off})
        cases.append((f"{label} cpu={budget / 2**30:.2f}GiB + disk", [*me, case, folder, opts], off))
    if gpu:
        for label, case in (("safetensors load_file → cuda:0", "floor"), ("fastsafetensors (nogds) → cuda:0", "fastsafetensors"),
                            ("shardkit.load_model → cuda:0", "shardkit"), ("accelerate → cuda:0", "accelerate")):
            if case == "fastsafetensors" and not _installed("fastsafetensors"):
                print("fastsafetensors is not installed (pip install 'shardkit[bench]'): its GPU row is left out")
                continue
            cases.append((label, [*me, case, folder, json.dumps({"device_map": 0})], None))
    flux = os.path.join(work, "flux-config.json")
    with open(flux, "w") as f:
        json.dump(FLUX_DEV, f)
    cases.append(("shardkit plan Flux 12B (process)", [sys.executable, "-m", "shardkit", "plan", "--model", "diffusers:FluxTransformer2DModel",
                                                        "--config", flux, "--max-memory", "0=16GB,1=16GB", "--dtype", "bf16"], None))
    return [c for c in cases if not only or any(word in c[0] for word in only)]


def _installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def host_to_device_gbps() -> float:
    """The PCIe floor: GB/s of a 1 GiB pinned host → GPU 0 copy, median of 5 after a warm-up."""
    import torch

    src = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:0")
    times = []
    for _ in range(6):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return (1 << 30) / statistics.median(times[1:]) / 1e9


def run_all(cases: list, runs: int) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {name: [] for name, _, _ in cases}
    for r in range(runs):
        order = cases[r % len(cases):] + cases[: r % len(cases)]
        for name, args, cleanup in order:
            if cleanup:
                shutil.rmtree(cleanup, ignore_errors=True)
            if "plan" in name:  # a process measured from outside: its children's peak
                wrapper = ("import resource,subprocess,sys,json,time; t=time.perf_counter(); "
                           "subprocess.run(sys.argv[1:],check=True,stdout=subprocess.DEVNULL); "
                           "s=time.perf_counter()-t; h=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss*1024; "
                           "print(json.dumps({'load_s': s, 'touch_s': s, 'base': 0, 'loaded_hwm': h, 'hwm': h, 'written': 0}))")
                result = measure([sys.executable, "-c", wrapper, *args])
            else:
                try:
                    result = measure(args)
                except SystemExit as failed:  # a miss is reported as a miss, and the other cases go on
                    print(f"  run {r + 1}/{runs} {name}: FAILED\n{failed}", flush=True)
                    continue
            results[name].append(result)
            print(f"  run {r + 1}/{runs} {name}: load {result['load_s']:.2f} s, process {result['wall_s']:.2f} s, "
                  f"peak {result['hwm'] / 2**20:.0f} MB, written {result['written'] / 1e6:.1f} MB", flush=True)
        for _, _, cleanup in cases:
            if cleanup:
                shutil.rmtree(cleanup, ignore_errors=True)
    return results


def table(results: dict[str, list[dict]], model_bytes: int) -> str:
    def med(runs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    floors = results.get("safetensors load_file (floor)")
    floor = med(floors, "load_s") if floors else None
    lines = ["| case | load s | × floor | load + use every weight s | peak RSS after load MB | "
             "peak RSS after use MB (× model) | process s | offload written |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, runs in results.items():
        if not runs:
            lines.append(f"| {name} | failed (see the log) | | | | | | |")
            continue
        if "plan" in name:
            lines.append(f"| {name} | {med(runs, 'load_s'):.2f} | | | | {max(r['hwm'] for r in runs) / 2**20:.0f} "
                         f"(whole process) | {med(runs, 'wall_s'):.2f} | |")
            continue
        loaded = max(r["loaded_hwm"] - r["base"] for r in runs)
        used = max(r["hwm"] - r["base"] for r in runs)
        written = f"{max(r['written'] for r in runs) / 1e6:.2f} MB" if "disk" in name else ""
        times_floor = f"{med(runs, 'load_s') / floor:.1f}×" if floor else ""
        lines.append(f"| {name} | {med(runs, 'load_s'):.2f} | {times_floor} | "
                     f"{med(runs, 'touch_s'):.2f} | {loaded / 2**20:.0f} | {used / 2**20:.0f} ({used / model_bytes:.2f}×) | "
                     f"{med(runs, 'wall_s'):.2f} | {written} |")
    lines.append("")
    lines.append("RSS columns are above the process's RSS after imports (torch, diffusers, accelerate: the same for "
                 "every case); 'use every weight' sums each tensor once, which pages lazily mapped weights in.")
    return "\n".join(lines)


# ------------------------------------------------------------------------- read backends (issue 13)

READ_CASES = [  # (label, child case, options)
    ("safetensors load_file (mmap)", "floor", {}),
    ("safetensors load_file(backend='pread')", "floor", {"backend": "pread"}),
    ("accelerate load_checkpoint_and_dispatch", "accelerate", {}),
    ("diffusers from_pretrained", "diffusers", {}),
    *[(f"shardkit.load_model read={r}", "shardkit", {"read": r}) for r in ("mmap", "pread", "direct", "auto")],
]


def prepare_read(work: str) -> tuple[str, int]:
    """The SD 1.5 UNet in fp16 (~1.7 GB, one file) with random weights, built once."""
    sys.path.insert(0, HERE)
    folder = os.path.join(work, "sd15-fp16")
    if not os.path.exists(os.path.join(folder, "config.json")):
        from build_checkpoint import build_unet

        print(f"building {folder} ...", flush=True)
        build_unet("sd15", folder, dtype="F16", overwrite=True)
    return folder, os.path.getsize(os.path.join(folder, "diffusion_pytorch_model.safetensors"))


def run_read_matrix(folder: str, mount: str, runs: int, only: list[str]) -> dict[tuple[str, str, str], list[dict]]:
    """Every (case, where, cache) ``runs`` times, interleaved; cold runs evict first (and check)."""
    from benchlib import evict

    me = [sys.executable, os.path.abspath(__file__), "--case"]
    weights = "diffusion_pytorch_model.safetensors"
    cells = []
    for where, root in (("local", folder), ("fuse", mount)):
        cells.append((("dd bs=16M (floor)", where), ["dd", f"if={os.path.join(root, weights)}", "of=/dev/null", "bs=16M"]))
        for label, case, opts in READ_CASES:
            if only and not any(word in label for word in only):
                continue
            cells.append(((label, where), [*me, case, root, json.dumps({**opts, "touch": "pages"})]))
    results: dict[tuple[str, str, str], list[dict]] = {}
    for r in range(runs):
        for cache in ("cold", "warm"):
            order = cells[r % len(cells):] + cells[: r % len(cells)]
            for (label, where), args in order:
                root = folder if where == "local" else mount
                if cache == "cold":
                    left = max(evict(os.path.join(folder, weights)), evict(os.path.join(root, weights)))
                else:
                    subprocess.run(["cat", os.path.join(root, weights)], stdout=subprocess.DEVNULL, check=True)
                    left = 1.0
                result = measure(args)
                result["cached"] = left
                results.setdefault((label, where, cache), []).append(result)
                print(f"  run {r + 1}/{runs} {cache} {where} {label}: {result['touch_s']:.2f} s "
                      f"(cached before: {left:.0%}), peak {(result['hwm'] - result['base']) / 2**20:.0f} MB", flush=True)
    return results


def read_table(results: dict[tuple[str, str, str], list[dict]], nbytes: int) -> str:
    """Rows: cases; columns: local/FUSE × cold/warm medians (s, GB/s), × cold dd, peak RSS."""
    cols = [("local", "cold"), ("local", "warm"), ("fuse", "cold"), ("fuse", "warm")]
    labels = list(dict.fromkeys(label for label, _, _ in results))
    med = {k: statistics.median(r["touch_s"] for r in v) for k, v in results.items()}
    head = " | ".join(f"{w} {c} s (GB/s, × dd cold)" for w, c in cols)
    lines = [f"| case | {head} | peak RSS above imports MB |", "|---|" + "---:|" * (len(cols) + 1)]
    for label in labels:
        cells = []
        for where, cache in cols:
            t, dd = med[(label, where, cache)], med[("dd bs=16M (floor)", where, "cold")]
            cells.append(f"{t:.2f} ({nbytes / t / 1e9:.2f}, {dd / t:.2f}×)")
        rss = max(r["hwm"] - r["base"] for (lb, _, _), v in results.items() if lb == label for r in v)
        lines.append(f"| {label} | {' | '.join(cells)} | {rss / 2**20:.0f} |")
    return "\n".join(lines)


def main_read(args: argparse.Namespace) -> int:
    """``--read-backends``: build, mount, run the matrix, print the table."""
    sys.path.insert(0, HERE)
    from benchlib import bindfs_mount, filesystem_line, machine_line

    os.makedirs(args.work, exist_ok=True)
    folder, nbytes = prepare_read(args.work)
    with bindfs_mount(folder) as mount:
        print(f"SD 1.5 UNet fp16: {nbytes / 1e9:.2f} GB in {folder} ({filesystem_line(folder)}), FUSE: {mount}; "
              f"{machine_line()}", flush=True)
        results = run_read_matrix(folder, mount, args.runs, args.only)
    print()
    print(f"SD 1.5 UNet fp16, {nbytes / 1e9:.2f} GB, one file; load + touch every page of every weight, "
          f"median of {args.runs} interleaved runs in fresh processes, imports excluded; {machine_line()}:")
    print()
    print(read_table(results, nbytes))
    if not args.keep:
        shutil.rmtree(args.work, ignore_errors=True)
    return 0


def main() -> int:
    if len(sys.argv) >= 2 and sys.argv[1] == "--case":
        run_case(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="SD 1.5 UNet (3.4 GB) instead of SDXL (10.3 GB)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--work", default="/tmp/shardkit-bench-load", help="scratch folder (checkpoints, offload)")
    parser.add_argument("--keep", action="store_true", help="keep the built checkpoint for the next run")
    parser.add_argument("--read-backends", action="store_true",
                        help="the read-backend matrix (cold/warm, local/FUSE, each backend) instead")
    parser.add_argument("--only", action="append", default=[], metavar="WORDS",
                        help="only cases whose label contains WORDS (repeatable)")
    parser.add_argument("--latency-ms", type=float, nargs="*", metavar="MS",
                        help="the latency benchmark through a FUSE mount adding MS per read request (issue 22)")
    parser.add_argument("--latency-model", default="sd15", choices=["sd15", "tiny"],
                        help="with --latency-ms: the UNet to build (sd15: 1.7 GB fp16)")
    parser.add_argument("--no-local", action="store_true", help="with --latency-ms: skip the local cold-disk rows")
    parser.add_argument("--bindfs", action="store_true",
                        help="with --latency-ms (may be empty): also the zero-latency FUSE case, a cold bindfs mount")
    args = parser.parse_args()
    if args.latency_ms is not None and (args.latency_ms or args.bindfs):
        sys.path.insert(0, HERE)
        from bench_latency import main_latency

        return main_latency(args.latency_ms, runs=args.runs, work=args.work, model=args.latency_model,
                            keep=args.keep, local=not args.no_local, only=args.only, bindfs=args.bindfs)
    if args.read_backends:
        return main_read(args)
    import platform

    import torch

    os.makedirs(args.work, exist_ok=True)
    kind = "sd15" if args.small else "sdxl"
    folder, model_bytes = prepare(kind, args.work)
    gpu = torch.cuda.is_available()
    print(f"{kind} UNet: {model_bytes / 1e9:.2f} GB in {folder}; {os.cpu_count()} cores, "
          f"{platform.machine()}, CUDA: {torch.cuda.get_device_name(0) if gpu else 'none'}", flush=True)
    if gpu:
        print(f"pinned host → GPU 0 copy (the PCIe floor): {host_to_device_gbps():.1f} GB/s", flush=True)
    results = run_all(build_cases(folder, model_bytes, args.work, gpu=gpu, only=args.only), args.runs)
    print()
    print(f"{kind} UNet, {model_bytes / 1e9:.2f} GB fp32, median of {args.runs} interleaved runs:")
    print(table(results, model_bytes))
    if not args.keep:
        shutil.rmtree(args.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
