#!/usr/bin/env python3
"""Benchmark loading sharded checkpoints: shardkit.load_model against the floor and the incumbents (the cases of
:func:`build_cases`); through mounts with :mod:`bench_latency`.
Method: docs/benchmarks.md, "How each benchmark measures".

    .venv/bin/python scripts/bench_load.py --small --runs 3
    .venv/bin/python scripts/bench_load.py --read-backends --runs 3
    .venv/bin/python scripts/bench_load.py --latency-ms 0.5 2 5 --runs 3
    .venv/bin/python scripts/bench_load.py --latency-ms 0 2 --bindfs --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from typing import Any

import benchlib
from benchlib import med, shard_files, status_bytes
from build_checkpoint import FLUX_DEV, diffusers_model, sharded_unet

# ------------------------------------------------------------------------- loaders (child side)
# Each loads ``folder`` (its shards, or a UNet from them) and returns a dict, a model or an iterable of tensors.


def _skeleton(folder: str) -> Any:
    from diffusers import UNet2DConditionModel

    return diffusers_model(UNet2DConditionModel.load_config(folder))


def _floor(folder: str, *, backend: str = "mmap", device_map: Any = "cpu", **_: Any) -> dict[str, Any]:
    from safetensors.torch import load_file

    state = {}
    for path in shard_files(folder):
        state.update(load_file(path, device="cuda:0" if device_map == 0 else "cpu", backend=backend))
    return state


def _assign(folder: str, **_: Any) -> Any:
    model = _skeleton(folder)
    model.load_state_dict(_floor(folder), assign=True, strict=True)
    return model


def _fastsafetensors(folder: str, *, device_map: Any = "cpu", **_: Any) -> Any:
    """fastsafetensors (no GDS) into a meta skeleton; its buffers back the tensors, so it stays open with the model."""
    from fastsafetensors import fastsafe_open

    opened = fastsafe_open(filenames=shard_files(folder), nogds=True, device="cuda:0" if device_map == 0 else "cpu")
    reader = opened.__enter__()
    model = _skeleton(folder)
    model.load_state_dict({k: reader.get_tensor(k) for k in reader.keys()}, assign=True, strict=True)
    model._bench_reader = opened
    return model


def _shardkit(folder: str, *, device_map: Any = "cpu", max_memory: Any = None, offload: str | None = None,
              read: str = "auto", **_: Any) -> Any:
    from diffusers import UNet2DConditionModel

    import shardkit

    return shardkit.load_model(UNet2DConditionModel, folder, config=folder, device_map=device_map,
                               max_memory=max_memory, offload_folder=offload, read=read)


def _accelerate(folder: str, *, device_map: Any = "cpu", max_memory: Any = None, offload: str | None = None,
                **_: Any) -> Any:
    from accelerate import load_checkpoint_and_dispatch

    files = shard_files(folder)
    single = len(files) == 1 and not any(f.endswith(".index.json") for f in os.listdir(folder))
    return load_checkpoint_and_dispatch(_skeleton(folder), files[0] if single else folder,
                                        device_map={"": device_map} if device_map in ("cpu", 0) else device_map,
                                        max_memory=max_memory, offload_folder=offload)


def _diffusers(folder: str, **_: Any) -> Any:
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel.from_pretrained(folder)


def _open(folder: str, *, read: str = "auto", **_: Any) -> Any:
    """``shardkit.open`` then ``ck[k]`` for every key, one at a time (a generator: the touch drives it)."""
    import shardkit

    with shardkit.open(folder, read=read) as ckpt:
        yield from (ckpt[k] for k in ckpt)


def _state_dict(folder: str, **_: Any) -> dict[str, Any]:
    import shardkit

    with shardkit.open(folder) as ckpt:
        return ckpt.to_state_dict()


def _odirect(folder: str, **_: Any) -> list[Any]:
    """A mount's practical ceiling: 16 threads of 4 MiB O_DIRECT reads into reused buffers, no tensors
    (requests as large as the mount takes, nothing done with the bytes)."""
    import mmap
    import threading
    from concurrent.futures import ThreadPoolExecutor

    chunk = 4 << 20
    fds = {p: os.open(p, os.O_RDONLY | os.O_DIRECT) for p in shard_files(folder)}
    local = threading.local()

    def read(job: tuple[str, int]) -> None:
        if not hasattr(local, "buf"):
            local.buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs; one per thread
        os.preadv(fds[job[0]], [local.buf], job[1])

    try:
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(read, [(p, off) for p in fds for off in range(0, os.path.getsize(p), chunk)]))
    finally:
        for fd in fds.values():
            os.close(fd)
    return []


LOADERS = {"floor": _floor, "assign": _assign, "shardkit": _shardkit, "accelerate": _accelerate,
           "diffusers": _diffusers, "fastsafetensors": _fastsafetensors, "open": _open, "state_dict": _state_dict,
           "odirect": _odirect}


def run_case(name: str, folder: str, options_json: str) -> dict[str, Any]:
    """Child process: import, load, use every weight; the times, peaks and bytes written."""
    import accelerate.big_modeling  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch
    from diffusers import UNet2DConditionModel  # noqa: F401  (diffusers imports its models lazily)

    import shardkit.loading.load  # noqa: F401  (imports are not part of the load time)

    options = json.loads(options_json)
    base, cpu = status_bytes("VmRSS"), time.process_time()  # CPU of every thread: on a shared machine it moves less
    start = time.perf_counter()
    loaded = LOADERS[name](folder, **options)
    if options.get("device_map") == 0:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    loaded_hwm = status_bytes("VmHWM")
    if isinstance(loaded, torch.nn.Module):
        loaded = [*loaded.parameters(), *loaded.buffers()]
    for tensor in loaded.values() if isinstance(loaded, dict) else loaded:  # use every weight once
        if tensor.is_meta or not tensor.numel():
            continue
        if options.get("touch") == "pages":  # one byte per page: I/O, not arithmetic, is measured
            tensor.reshape(-1).view(torch.uint8)[::4096].sum().item()
        else:
            tensor.float().sum().item()
    offload = options.get("offload")
    return {"load_s": seconds, "touch_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu,
            "base": base, "loaded_hwm": loaded_hwm, "hwm": status_bytes("VmHWM"),
            "written": benchlib.tree_bytes(offload) if offload else 0}


# ------------------------------------------------------------------------- orchestration (parent side)

def load(name: str, folder: str, options: dict[str, Any] | None = None, *, check: bool = True) -> dict[str, Any]:
    """One loader in a fresh process: its JSON line, plus ``wall_s`` (the whole process)."""
    start = time.perf_counter()
    result = benchlib.child(__file__, "--child", "case", name, folder, json.dumps(options or {}), check=check)
    return {**result, "wall_s": time.perf_counter() - start}


def outside(command: str) -> dict[str, Any]:
    """A command timed from outside (dd, the plan CLI): seconds and the process tree's peak."""
    usage = benchlib.measure(command)
    return {"load_s": usage.seconds, "touch_s": usage.seconds, "wall_s": usage.seconds, "base": 0, "loaded_hwm": 0,
            "hwm": int(usage.rss_mb * 2**20), "written": 0}


Cases = dict[str, tuple[str, dict[str, Any]]]  # label: (loader or shell command, options)


def build_cases(model_bytes: int, work: str, *, gpu: bool, only: list[str]) -> Cases:
    """Every case; an offload case's folder (its option ``offload``) is cleared before each run."""
    import importlib.util

    budget = 4 * 2**30 if model_bytes > 8e9 else int(model_bytes * 4 * 2**30 / 10.3e9)
    cases: Cases = {
        "safetensors load_file (floor)": ("floor", {}),
        "meta skeleton + load_file + load_state_dict(assign=True)": ("assign", {}),
        "shardkit.load_model cpu": ("shardkit", {}),
        "accelerate.load_checkpoint_and_dispatch cpu": ("accelerate", {}),
        "diffusers from_pretrained": ("diffusers", {}),
    }
    for label, name in (("shardkit.load_model", "shardkit"), ("accelerate", "accelerate")):
        cases[f"{label} cpu={budget / 2**30:.2f}GiB + disk"] = (name, {
            "device_map": "auto", "max_memory": {"cpu": budget}, "offload": os.path.join(work, f"offload-{name}")})
    if gpu:
        for label, name in (("safetensors load_file → cuda:0", "floor"), ("fastsafetensors (nogds) → cuda:0", "fastsafetensors"),
                            ("shardkit.load_model → cuda:0", "shardkit"), ("accelerate → cuda:0", "accelerate")):
            if name == "fastsafetensors" and importlib.util.find_spec("fastsafetensors") is None:
                print("fastsafetensors is not installed (pip install 'shardkit[bench]'): its GPU row is left out")
                continue
            cases[label] = (name, {"device_map": 0})
    flux = os.path.join(work, "flux-config.json")
    with open(flux, "w") as f:
        json.dump(FLUX_DEV, f)
    cases["shardkit plan Flux 12B (process)"] = (f"{sys.executable} -m shardkit plan --model diffusers:"
                                                 f"FluxTransformer2DModel --config {flux} --max-memory 0=16GB,1=16GB "
                                                 "--dtype bf16 >/dev/null", {})
    return {label: cases[label] for label in benchlib.picked(cases, only)}


def run_all(cases: Cases, folder: str, runs: int) -> dict[str, list[dict[str, Any]]]:
    def one(label: str, r: int) -> dict[str, Any] | None:
        name, options = cases[label]
        shutil.rmtree(options.get("offload", ""), ignore_errors=True)
        result = outside(name) if name not in LOADERS else load(name, folder, options, check=False)
        return None if "error" in result else result  # a miss is reported as a miss, and the other cases go on

    results = benchlib.rounds(list(cases), runs, one, line=lambda d: (
        f"load {d['load_s']:.2f} s, process {d['wall_s']:.2f} s, peak {d['hwm'] / 2**20:.0f} MB, "
        f"written {d['written'] / 1e6:.1f} MB"))
    for _, options in cases.values():
        shutil.rmtree(options.get("offload", ""), ignore_errors=True)
    return results


def table(results: dict[str, list[dict[str, Any]]], model_bytes: int) -> str:
    floors = results.get("safetensors load_file (floor)")
    floor = med(floors, "load_s") if floors else None
    rows = []
    for name, runs in results.items():
        if not runs:
            rows.append([name, "failed (see the log)", *[""] * 6])
        elif "plan" in name:
            rows.append([name, f"{med(runs, 'load_s'):.2f}", "", "", "",
                         f"{max(r['hwm'] for r in runs) / 2**20:.0f} (whole process)", f"{med(runs, 'wall_s'):.2f}", ""])
        else:
            loaded = max(r["loaded_hwm"] - r["base"] for r in runs)
            used = max(r["hwm"] - r["base"] for r in runs)
            rows.append([name, f"{med(runs, 'load_s'):.2f}", f"{med(runs, 'load_s') / floor:.1f}×" if floor else "",
                         f"{med(runs, 'touch_s'):.2f}", f"{loaded / 2**20:.0f}",
                         f"{used / 2**20:.0f} ({used / model_bytes:.2f}×)", f"{med(runs, 'wall_s'):.2f}",
                         f"{max(r['written'] for r in runs) / 1e6:.2f} MB" if "disk" in name else ""])
    return (benchlib.markdown(["case", "load s", "× floor", "load + use every weight s", "peak RSS after load MB",
                      "peak RSS after use MB (× model)", "process s", "offload written"], rows)
            + "\n\nRSS columns are above the process's RSS after imports (torch, diffusers, accelerate: the same for "
            "every case); 'use every weight' sums each tensor once, which pages lazily mapped weights in.")


def main() -> int:
    benchlib.serve_child({"case": run_case})
    p = benchlib.parser(__doc__, work="/tmp/shardkit-bench-load", output=False, only=True)
    p.add_argument("--small", action="store_true", help="SD 1.5 UNet (3.4 GB) instead of SDXL (10.3 GB)")
    p.add_argument("--tiny", action="store_true", help="a few MB, to check the script itself")
    p.add_argument("--keep", action="store_true", help="keep the built checkpoint for the next run")
    p.add_argument("--read-backends", action="store_true",
                   help="the read-backend matrix (cold/warm, local/FUSE, each backend) instead")
    p.add_argument("--latency-ms", type=float, nargs="*", metavar="MS",
                   help="the latency benchmark through a FUSE mount adding MS per read request (issue 22)")
    p.add_argument("--latency-model", default="sd15", choices=["sd15", "tiny"],
                   help="with --latency-ms: the UNet to build (sd15: 1.7 GB fp16)")
    p.add_argument("--no-local", action="store_true", help="with --latency-ms: skip the local cold-disk rows")
    p.add_argument("--bindfs", action="store_true",
                   help="with --latency-ms (may be empty): also the zero-latency FUSE case, a cold bindfs mount")
    args = p.parse_args()
    os.makedirs(args.work, exist_ok=True)
    if args.read_backends or args.latency_ms is not None and (args.latency_ms or args.bindfs):
        import bench_latency

        (bench_latency.main_read if args.read_backends else bench_latency.main_latency)(args)
    else:
        bench_unets(args)
    if not args.keep:
        shutil.rmtree(args.work, ignore_errors=True)
    return 0


def bench_unets(args: argparse.Namespace) -> None:
    """The UNet in shards on the local disk: every loader against the floor."""
    import torch

    kind = "tiny" if args.tiny else "sd15" if args.small else "sdxl"
    folder, model_bytes = sharded_unet(kind, args.work)
    gpu = torch.cuda.is_available()
    print(f"{kind} UNet: {model_bytes / 1e9:.2f} GB in {folder}; {benchlib.machine_line()}, "
          f"CUDA: {torch.cuda.get_device_name(0) if gpu else 'none'}", flush=True)
    if gpu:
        print(f"pinned host → GPU 0 copy (the PCIe floor): {benchlib.pinned_copy_gbps():.1f} GB/s", flush=True)
    results = run_all(build_cases(model_bytes, args.work, gpu=gpu, only=args.only), folder, args.runs)
    print(f"\n{kind} UNet, {model_bytes / 1e9:.2f} GB fp32, median of {args.runs} interleaved runs:")
    print(table(results, model_bytes))


if __name__ == "__main__":
    sys.exit(main())
