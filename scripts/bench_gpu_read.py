#!/usr/bin/env python3
"""Host → GPU reads (issue 46): shardkit's pinned ring against safetensors, fastsafetensors, the Run:ai
streamer and InstantTensor, with the pinned-copy floor measured in the same run.

Checkpoints (bf16, random weights, real architectures' names and shapes, built on the GPU once):
the SDXL UNet (5.1 GB, 1680 tensors, many small) and a Llama-3.2-3B-shaped decoder (6.4 GB, 255
tensors). Every case runs in a fresh process, interleaved, ``--runs`` times (median); the time is
the read alone (imports and CUDA start-up excluded, ``torch.cuda.synchronize`` included). Warm: the
files are in the page cache (checked with mincore). Cold: each file evicted (``POSIX_FADV_DONTNEED``,
checked) before every run, against ``dd iflag=direct`` of the same files (the disk's O_DIRECT rate).
Each case prints a byte checksum of what it loaded: every case must agree.

``--sweep`` times shardkit's ring with other slot counts, slot sizes and thread counts (how the
default was chosen); ``--tp`` reads the Llama as 4 tensor-parallel ranks on one GPU, counting each
rank's bytes read (``/proc/self/io`` rchar) and checking its tensors against slices of the full ones.

    python3 scripts/bench_gpu_read.py --work /tmp/gpu-read --runs 3 --cold --sweep --tp
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from benchlib import child as run_child
from benchlib import markdown, pinned_copy_gbps, set_cache, shard_files, status_bytes
from benchlib import parser as bench_parser
from build_checkpoint import SDXL_UNET

LLAMA_3B = {"vocab_size": 128256, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
            "num_attention_heads": 24, "num_key_value_heads": 8, "tie_word_embeddings": True, "head_dim": 128}
TINY = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 4, "tie_word_embeddings": True}
CONFIGS = {"llama3b": LLAMA_3B, "tiny": TINY}
DEVICE = os.environ.get("BENCH_DEVICE", "cuda:0")  # "cpu": a smoke test of the script itself
PEERS = ["shardkit", "shardkit-mapped", "safetensors", "safetensors-prefetch", "fastsafetensors", "runai", "instanttensor"]


# ------------------------------------------------------------------------- building (parent)

def _shapes(model: str) -> dict[str, tuple[tuple[int, ...], object]]:
    import torch
    from accelerate import init_empty_weights

    with init_empty_weights():
        if model == "sdxl":
            from diffusers import UNet2DConditionModel

            net = UNet2DConditionModel.from_config(SDXL_UNET)
        else:
            from transformers import LlamaConfig, LlamaForCausalLM

            net = LlamaForCausalLM(LlamaConfig(**CONFIGS[model]))
    return {n: (tuple(t.shape), torch.bfloat16) for n, t in net.state_dict().items() if n != "lm_head.weight"}


def build(model: str, work: str) -> str:
    """The checkpoint in 2-3 GB shards, random bf16 values made on the GPU."""
    import torch

    import shardkit

    folder = os.path.join(work, model)
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    state = {n: torch.randn(shape, dtype=torch.float32, device=DEVICE, generator=gen).to(dtype).cpu()  # type: ignore[arg-type]
             for n, (shape, dtype) in _shapes(model).items()}
    shardkit.save_sharded(state, folder, max_shard_size="3GB")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(CONFIGS.get(model, {}), f)
    return folder


# ------------------------------------------------------------------------- cases (child)

def _shardkit(folder: str) -> dict:
    import shardkit

    with shardkit.open(folder) as ckpt:
        return ckpt.to(DEVICE)


def _safetensors(folder: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for path in shard_files(folder):
        out.update(load_file(path, device=DEVICE))
    return out


def _safetensors_prefetch(folder: str) -> dict:
    from safetensors import safe_open

    out = {}
    for path in shard_files(folder):
        with safe_open(path, framework="pt", device=DEVICE, prefetch=True) as f:  # type: ignore[call-arg]
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _fastsafetensors(folder: str) -> dict:
    from fastsafetensors import fastsafe_open

    with fastsafe_open(filenames=shard_files(folder), nogds=True, device=DEVICE) as f:
        return {k: f.get_tensor(k).clone() for k in f.keys()}  # its buffers die with the context


def _runai(folder: str) -> dict:
    from runai_model_streamer import SafetensorsStreamer

    with SafetensorsStreamer() as streamer:
        streamer.stream_files(shard_files(folder), device=DEVICE)
        return {name: t.to(DEVICE, non_blocking=True) for name, t in streamer.get_tensors()}


def _instanttensor(folder: str) -> dict:
    from instanttensor import safe_open

    with safe_open(shard_files(folder), framework="pt", device=DEVICE) as f:
        return dict(f.tensors())


REGISTER_READ_ONLY = 8     # cudaHostRegisterReadOnly: pin read-only pages (a file's page cache) for DMA
MAPPED_CHUNK = 64 << 20    # bytes registered and copied at once by one thread


def _map_file(path: str) -> tuple[int, int]:
    """A read-only shared mapping of ``path``: (address, length); never written, unmapped at exit."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
    finally:
        os.close(fd)
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
    return address, size


def _host_tensor(address: int, nbytes: int):
    import ctypes

    import numpy as np
    import torch

    return torch.from_numpy(np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(address)))


def _mapped(folder: str, window_mib: int = 64, threads: int = 8) -> dict:
    """Prototype, not shardkit's path: DMA straight from the page cache. Thread k takes windows k, k + T,
    ... of the files' read-only mappings: registers one (``cudaHostRegister``, read-only), queues the
    copies of the tensor bytes in it on its own stream, then unregisters the window before it once that
    window's copies are done (so registering overlaps copying). No host copy at all."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    import shardkit
    from shardkit.loading.ring_plan import byte_view

    cudart, window = torch.cuda.cudart(), window_mib << 20
    with shardkit.open(folder) as ckpt:
        names = list(ckpt)
        dests = {n: torch.empty(ckpt.shape_of(n), dtype=ckpt.dtype_of(n), device=DEVICE) for n in names}
        windows: dict[tuple[str, int], list[tuple[torch.Tensor, int, int, int]]] = {}
        for n in names:  # (dest view, its byte offset, the window's byte offset, bytes)
            e = ckpt.entry(n)
            view, at, end = byte_view(dests[n]), e.offset, e.offset + e.nbytes
            while at < end:
                start = at // window * window
                take = min(end, start + window) - at
                windows.setdefault((str(e.file), start), []).append((view, at - e.offset, at - start, take))
                at += take
        maps = {path: _map_file(path) for path, _ in windows}
        keys = sorted(windows)

        def register(key: tuple[str, int]) -> int:
            address, size = maps[key[0]]
            err = cudart.cudaHostRegister(address + key[1], min(window, size - key[1]), REGISTER_READ_ONLY)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {key} failed: {err}")
            return address + key[1]

        def worker(k: int) -> None:
            stream, pending = torch.cuda.Stream(), []
            try:
                for key in keys[k::threads]:
                    at = register(key)
                    src = _host_tensor(at, min(window, maps[key[0]][1] - key[1]))
                    with torch.cuda.stream(stream):
                        for view, dest_at, src_at, n in windows[key]:
                            view[dest_at:dest_at + n].copy_(src[src_at:src_at + n], non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                    pending.append((event, at))
                    if len(pending) > 1:
                        done, old = pending.pop(0)
                        done.synchronize()
                        cudart.cudaHostUnregister(old)
            finally:
                stream.synchronize()
                for _, old in pending:
                    cudart.cudaHostUnregister(old)

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(worker, range(threads)))
    return dests


CASES = {"shardkit": _shardkit, "shardkit-mapped": _mapped, "safetensors": _safetensors, "safetensors-prefetch": _safetensors_prefetch,
         "fastsafetensors": _fastsafetensors, "runai": _runai, "instanttensor": _instanttensor}


def _sync() -> None:
    import torch

    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


def run_case(name: str, folder: str, ring: str | None) -> None:
    import torch

    import shardkit.api.loading  # noqa: F401  (imports are not part of the read time)
    import shardkit.loading.device_reads as device_reads
    from shardkit.loading.pipeline_copy import RingTuning

    if ring and name == "shardkit-mapped":  # "MiB per window,threads"
        mib, threads = (int(x) for x in ring.split(","))
        CASES[name] = lambda folder: _mapped(folder, mib, threads)
    elif ring:  # "slots,MiB,threads[,eager]"
        slots, mib, threads, *rest = ring.split(",")
        device_reads.LOCAL = RingTuning(slots=int(slots), slot_bytes=int(mib) << 20, threads=int(threads),
                                        grow=rest != ["eager"])
    torch.zeros(1, device=DEVICE)
    _sync()
    base = status_bytes("VmRSS") / 1024
    start = time.perf_counter()
    state = CASES[name](folder)
    _sync()
    seconds = time.perf_counter() - start
    hwm = status_bytes("VmHWM") / 1024
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    checksum = int(sum(int(t.reshape(-1).view(torch.uint8).sum(dtype=torch.int64)) for t in state.values()))
    print(json.dumps({"load_s": seconds, "bytes": nbytes, "checksum": checksum, "tensors": len(state),
                      "peak_rss_mb": hwm / 1024, "above_base_mb": (hwm - base) / 1024}))


def run_floor() -> None:
    """The PCIe floor: a 1 GiB pinned host → GPU copy, median of 5 after a warm-up."""
    print(json.dumps({"gbps": pinned_copy_gbps(DEVICE)}))


def run_tp(folder: str) -> None:
    """4 ranks on one GPU: bytes each reads (kernel-counted), GB/s of what it keeps, tensors checked."""
    import torch

    import shardkit
    from shardkit.loading.tensor_parallel import TensorParallelPlan, rules_for

    def rchar() -> int:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))

    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    torch.zeros(1, device=DEVICE)
    with shardkit.open(folder) as ckpt:
        total = ckpt.nbytes()
        plan = TensorParallelPlan(ckpt, world=4, rules=rules_for(config))
        ckpt.open_shards()
        full = ckpt.to(DEVICE)
        for rank in range(4):
            before, start = rchar(), time.perf_counter()
            got = plan.read(rank, device=DEVICE)
            _sync()
            seconds, read = time.perf_counter() - start, rchar() - before
            kept = sum(t.numel() * t.element_size() for t in got.values())
            equal = all(torch.equal(t, _rank_slice(full[n], plan.specs[n], rank, 4)) for n, t in got.items())
            print(json.dumps({"rank": rank, "read_bytes": read, "fraction": read / total, "kept_bytes": kept,
                              "seconds": seconds, "gbps": kept / seconds / 1e9, "equal": equal}))
            del got


def run_profile(folder: str) -> None:
    """Where the time of one ``.to(device)`` goes: headers, the pinned ring's allocation, the device
    allocations, the page-cache reads alone (no copies) and the ring run; then a second ``.to`` in the
    same process (the pinned block reused from torch's cache), for 4, 8 and 16 reader threads."""
    import torch

    import shardkit
    from shardkit.loading.device_reads import FileReaders
    from shardkit.loading.pipeline_copy import (
        BufferRing,
        CopyJob,
        CudaCopyStage,
        HostCopyStage,
        RingTuning,
        byte_view,
        run_ring,
    )

    class NoCopy(HostCopyStage):
        def submit(self, slot, copies):
            return None

    torch.zeros(1, device=DEVICE)
    stamp = time.perf_counter()
    ckpt = shardkit.open(folder)
    ckpt.open_shards()
    names = list(ckpt)
    row = {"headers_s": time.perf_counter() - stamp}
    stamp = time.perf_counter()
    with shardkit.open(folder) as again:
        again.open_shards()
    row["headers_again_s"] = time.perf_counter() - stamp
    stamp = time.perf_counter()
    def stage():
        return CudaCopyStage(torch.device(DEVICE)) if DEVICE.startswith("cuda") else HostCopyStage()

    ring = BufferRing.for_tuning(stage(), RingTuning(slots=16, slot_bytes=16 << 20, threads=8, grow=False))
    row["pin_256MiB_s"] = time.perf_counter() - stamp
    del ring  # back to torch's pinned cache: the runs below reuse it
    if DEVICE.startswith("cuda"):
        row.update(_pin_probes(folder))
    stamp = time.perf_counter()
    dests = {n: torch.empty(ckpt.shape_of(n), dtype=ckpt.dtype_of(n), device=DEVICE) for n in names}
    _sync()
    row["device_alloc_s"] = time.perf_counter() - stamp
    nbytes = sum(ckpt.nbytes(n) for n in names)
    from contextlib import ExitStack

    for threads in (4, 8, 16):
        tuning = RingTuning(slots=max(16, 2 * threads), slot_bytes=16 << 20, threads=threads)
        with ExitStack() as stack:
            readers = FileReaders(ckpt, stack)
            by_file: dict[int, list] = {}
            for n in names:
                e = ckpt.entry(n)
                by_file.setdefault(readers.index_of(n), []).append(CopyJob(byte_view(dests[n]), 0, e.offset, e.nbytes, n))
            sources = [(readers.readers[i], jobs) for i, jobs in by_file.items()]
            stamp = time.perf_counter()
            run_ring(sources, stage=NoCopy(), tuning=tuning, ring=BufferRing.for_tuning(HostCopyStage(), tuning))
            row[f"reads_only_{threads}t_gbps"] = nbytes / (time.perf_counter() - stamp) / 1e9
            stamp = time.perf_counter()
            run_ring(sources, stage=stage(), tuning=tuning)
            _sync()
            row[f"ring_{threads}t_gbps"] = nbytes / (time.perf_counter() - stamp) / 1e9
    stamp = time.perf_counter()
    again = ckpt.to(DEVICE)
    _sync()
    row["second_to_gbps"] = nbytes / (time.perf_counter() - stamp) / 1e9
    del again
    print(json.dumps(row))


def _pin_probes(folder: str) -> dict:
    """What pinning costs each way: 16 separate 16 MiB slots, registering touched pageable memory, and
    registering 1 GiB of a file's page cache read-only, then the DMA rate straight from it."""
    import numpy as np
    import torch

    cudart, row = torch.cuda.cudart(), {}
    stamp = time.perf_counter()
    slots = [torch.empty(16 << 20, dtype=torch.uint8, pin_memory=True) for _ in range(16)]
    row["pin_16x16MiB_s"] = time.perf_counter() - stamp
    del slots
    stamp = time.perf_counter()
    host = np.ones(256 << 20, dtype=np.uint8)
    row["malloc_touch_256MiB_s"] = time.perf_counter() - stamp
    stamp = time.perf_counter()
    row["register_256MiB_err"] = int(cudart.cudaHostRegister(host.ctypes.data, host.nbytes, 0))
    row["register_256MiB_s"] = time.perf_counter() - stamp
    cudart.cudaHostUnregister(host.ctypes.data)
    address, size = _map_file(shard_files(folder)[0])
    nbytes = min(1 << 30, size // 4096 * 4096)
    stamp = time.perf_counter()
    err = row["register_pagecache_err"] = int(cudart.cudaHostRegister(address, nbytes, REGISTER_READ_ONLY))
    row["register_pagecache_1GiB_s"] = time.perf_counter() - stamp
    if err == 0:
        src, dst = _host_tensor(address, nbytes), torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
        for _ in range(3):
            torch.cuda.synchronize()
            stamp = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            row["dma_from_pagecache_gbps"] = nbytes / (time.perf_counter() - stamp) / 1e9
        stamp = time.perf_counter()
        cudart.cudaHostUnregister(address)
        row["unregister_1GiB_s"] = time.perf_counter() - stamp
    return row


def _rank_slice(full, spec, rank: int, world: int):
    import torch

    if spec.dim is None:
        return full
    parts = full.split(list(spec.sections), dim=spec.dim) if spec.sections else (full,)
    return torch.cat([p.chunk(world, dim=spec.dim)[rank] for p in parts], dim=spec.dim)


# ------------------------------------------------------------------------- orchestration (parent)

def child(*args: str) -> dict:
    return run_child(__file__, *args, check=False, timeout=300)


def dd_direct_gbps(files: list[str]) -> float:
    start, nbytes = time.perf_counter(), 0
    for path in files:
        subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct"], check=True, capture_output=True)
        nbytes += os.path.getsize(path)
    return nbytes / (time.perf_counter() - start) / 1e9


def _available(name: str) -> bool:
    import importlib.util

    module = {"shardkit": "shardkit", "shardkit-mapped": "shardkit", "safetensors": "safetensors", "fastsafetensors": "fastsafetensors",
              "runai": "runai_model_streamer", "instanttensor": "instanttensor"}.get(name)
    if name == "shardkit-mapped":
        return DEVICE.startswith("cuda")
    if name == "safetensors-prefetch":
        import safetensors

        return tuple(int(x) for x in safetensors.__version__.split(".")[:2]) >= (0, 9)
    return module is not None and importlib.util.find_spec(module) is not None


def bench(folder: str, cases: list[tuple[str, str | None]], runs: int, *, cold: bool) -> dict[str, list[dict]]:
    files = shard_files(folder)
    results: dict[str, list[dict]] = {label: [] for label, _ in cases}
    results["floor"] = []
    for _ in range(runs):
        results["floor"].append(dd_direct_gbps(files) if cold else child("--floor").get("gbps", float("nan")))
        for label, ring in cases:
            resident = set_cache(files, cold=cold)
            name = label.split("@")[0]
            result = child("--case", name, folder, *(["--ring", ring] if ring else []))
            result["resident"] = resident
            results[label].append(result)
            print(f"  {label:<28} {json.dumps(result)}", flush=True)
    return results


def table(results: dict[str, list[dict]], title: str, *, cold: bool) -> str:
    floor = statistics.median(results.pop("floor"))  # type: ignore[type-var]
    rows = []
    for label, runs in results.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            rows.append([label, f"error: {runs[0].get('error') if runs else 'not run'}", "", "", "", ""])
            continue
        load = statistics.median(r["load_s"] for r in ok)
        gbps = ok[0]["bytes"] / load / 1e9
        sums = {r["checksum"] for r in ok}
        each = ", ".join(f"{r['load_s']:.3f}" for r in ok)
        rows.append([label, f"{load:.3f} ({each})",
                     f"{gbps:.1f}", f"{gbps / floor:.2f}", f"{statistics.median(r['peak_rss_mb'] for r in ok):.0f}",
                     f"{'ok' if len(sums) == 1 else 'DIFFERS'} {min(sums) % 10**6:06d}"])
    what = "dd iflag=direct, the disk" if cold else "pinned 1 GiB host → GPU copy, PCIe"
    return (f"### {title}\n\nfloor ({what}): {floor:.1f} GB/s\n\n"
            + markdown(["case", "load s (runs)", "GB/s", "× floor", "peak RSS MB", "checksum"], rows, align="lrrrrl"))


def main() -> int:
    parser = bench_parser(__doc__, work="/tmp/shardkit-gpu-read", output=False)
    parser.add_argument("--models", default="sdxl,llama3b")
    parser.add_argument("--cold", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--tp", action="store_true")
    parser.add_argument("--mapped-sweep", action="store_true")
    parser.add_argument("--peers", default=",".join(PEERS), help="the cases of the warm table")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--skip-warm", action="store_true")
    parser.add_argument("--case", nargs=2)
    parser.add_argument("--ring")
    parser.add_argument("--floor", action="store_true")
    parser.add_argument("--tp-child")
    parser.add_argument("--profile-child")
    args = parser.parse_args()
    if args.case:
        run_case(args.case[0], args.case[1], args.ring)
        return 0
    if args.floor:
        run_floor()
        return 0
    if args.tp_child:
        run_tp(args.tp_child)
        return 0
    if args.profile_child:
        run_profile(args.profile_child)
        return 0
    os.makedirs(args.work, exist_ok=True)
    peers = [p for p in args.peers.split(",") if _available(p)]
    print("peers:", peers, "| missing:", [p for p in PEERS if p not in peers], flush=True)
    out = []
    folders = {}
    for model in args.models.split(","):
        start = time.perf_counter()
        folders[model] = build(model, args.work)
        print(f"built {folders[model]} in {time.perf_counter() - start:.1f} s", flush=True)
    for model, folder in folders.items() if not args.skip_warm else ():
        out.append(table(bench(folder, [(p, None) for p in peers], args.runs, cold=False), f"{model}, warm", cold=False))
        print(out[-1], flush=True)
    if args.tp and "llama3b" in folders:
        print("### TP=4 on one GPU (llama3b)", flush=True)
        subprocess.run([sys.executable, os.path.abspath(__file__), "--tp-child", folders["llama3b"]], timeout=300)
    if args.profile:
        for model, folder in folders.items():
            print(f"### where the time goes ({model})", flush=True)
            subprocess.run([sys.executable, os.path.abspath(__file__), "--profile-child", folder], timeout=300)
    if args.cold:
        folder = folders[next(iter(folders))]
        cold_cases = [(p, None) for p in ("shardkit", "safetensors") if p in peers] + [("shardkit@16,16,4", "16,16,4")]
        out.append(table(bench(folder, cold_cases, args.runs, cold=True), "cold", cold=True))
        print(out[-1], flush=True)
    if args.sweep:
        rings = ["16,16,8,eager", "16,16,8", "32,16,16"]   # 2026-11-28, H200: 24,16,12 and 16,32,8 were slower
        folder = folders[next(iter(folders))]
        out.append(table(bench(folder, [(f"shardkit@{r}", r) for r in rings], 2, cold=False),
                         "ring sweep (slots, MiB per slot, threads; 2 runs)", cold=False))
        print(out[-1], flush=True)
    if args.mapped_sweep:
        folder = folders[next(iter(folders))]
        cases = [("shardkit", None)] + [(f"shardkit-mapped@{m}", m) for m in ("64,8", "256,8", "64,4", "128,16")]
        out.append(table(bench(folder, cases, args.runs, cold=False),
                         "DMA from the page cache (MiB per window, threads)", cold=False))
        print(out[-1], flush=True)
    print("\n\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
