#!/usr/bin/env python3
"""Host → GPU reads (issue 46): shardkit's pinned ring against safetensors, fastsafetensors, the Run:ai
streamer and InstantTensor, with the pinned-copy floor measured in the same run.
Method: docs/benchmarks.md, "How each benchmark measures".

    python3 scripts/bench_gpu_read.py --work /tmp/gpu-read --runs 3 --cold --sweep --tp
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
import time

import benchlib
from benchlib import shard_files, timed
from build_checkpoint import SDXL_UNET, unet_shapes

LLAMA_3B = {"vocab_size": 128256, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
            "num_attention_heads": 24, "num_key_value_heads": 8, "tie_word_embeddings": True, "head_dim": 128}
TINY = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 4, "tie_word_embeddings": True}
CONFIGS = {"llama3b": LLAMA_3B, "tiny": TINY}
DEVICE = os.environ.get("BENCH_DEVICE", "cuda:0")  # "cpu": a smoke test of the script itself


# ------------------------------------------------------------------------- building (parent)

def _shapes(model: str) -> dict[str, tuple[int, ...]]:
    if model == "sdxl":
        return unet_shapes(SDXL_UNET)
    from accelerate import init_empty_weights
    from transformers import LlamaConfig, LlamaForCausalLM

    with init_empty_weights():
        net = LlamaForCausalLM(LlamaConfig(**CONFIGS[model]))
    return {n: tuple(t.shape) for n, t in net.state_dict().items() if n != "lm_head.weight"}


def build(model: str, work: str) -> str:
    """The checkpoint in 2-3 GB shards, random bf16 values made on the GPU."""
    import torch

    import shardkit

    folder = os.path.join(work, model)
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    state = {n: torch.randn(shape, dtype=torch.float32, device=DEVICE, generator=gen).to(torch.bfloat16).cpu()
             for n, shape in _shapes(model).items()}
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


# Every reader of the warm table: its loader and the module it needs (None: a condition of its own, see available).
PEERS = {"shardkit": (_shardkit, "shardkit"), "shardkit-mapped": (_mapped, None),
         "safetensors": (_safetensors, "safetensors"), "safetensors-prefetch": (_safetensors_prefetch, None),
         "fastsafetensors": (_fastsafetensors, "fastsafetensors"), "runai": (_runai, "runai_model_streamer"),
         "instanttensor": (_instanttensor, "instanttensor")}


def _sync() -> None:
    import torch

    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


def run_case(name: str, folder: str, ring: str = "") -> dict:
    """Child process: one reader's time (after imports and CUDA start-up), bytes, checksum and peak RSS."""
    import torch

    import shardkit.api.loading  # noqa: F401  (imports are not part of the read time)
    import shardkit.loading.device_reads as device_reads
    from shardkit.loading.pipeline_copy import RingTuning

    read = PEERS[name][0]
    if ring and name == "shardkit-mapped":  # "MiB per window,threads"
        mib, threads = (int(x) for x in ring.split(","))
        read = functools.partial(_mapped, window_mib=mib, threads=threads)
    elif ring:  # "slots,MiB,threads[,eager]"
        slots, mib, threads, *rest = ring.split(",")
        device_reads.LOCAL = RingTuning(slots=int(slots), slot_bytes=int(mib) << 20, threads=int(threads),
                                        grow=rest != ["eager"])
    torch.zeros(1, device=DEVICE)
    _sync()
    base = benchlib.status_bytes("VmRSS") / 1024
    start = time.perf_counter()
    state = read(folder)
    _sync()
    seconds = time.perf_counter() - start
    hwm = benchlib.status_bytes("VmHWM") / 1024
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    checksum = int(sum(int(t.reshape(-1).view(torch.uint8).sum(dtype=torch.int64)) for t in state.values()))
    return {"load_s": seconds, "bytes": nbytes, "checksum": checksum, "tensors": len(state),
            "peak_rss_mb": hwm / 1024, "above_base_mb": (hwm - base) / 1024}


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

    def stage():
        return CudaCopyStage(torch.device(DEVICE)) if DEVICE.startswith("cuda") else HostCopyStage()

    torch.zeros(1, device=DEVICE)
    row: dict = {}
    with timed(row, "headers_s"):
        ckpt = shardkit.open(folder)
        ckpt.open_shards()
        names = list(ckpt)
    with timed(row, "headers_again_s"), shardkit.open(folder) as again:
        again.open_shards()
    with timed(row, "pin_256MiB_s"):
        ring = BufferRing.for_tuning(stage(), RingTuning(slots=16, slot_bytes=16 << 20, threads=8, grow=False))
    del ring  # back to torch's pinned cache: the runs below reuse it
    if DEVICE.startswith("cuda"):
        row.update(_pin_probes(folder))
    with timed(row, "device_alloc_s"):
        dests = {n: torch.empty(ckpt.shape_of(n), dtype=ckpt.dtype_of(n), device=DEVICE) for n in names}
        _sync()
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
            with timed(row, f"reads_only_{threads}t_gbps", nbytes):
                run_ring(sources, stage=NoCopy(), tuning=tuning, ring=BufferRing.for_tuning(HostCopyStage(), tuning))
            with timed(row, f"ring_{threads}t_gbps", nbytes):
                run_ring(sources, stage=stage(), tuning=tuning)
                _sync()
    with timed(row, "second_to_gbps", nbytes):
        again = ckpt.to(DEVICE)
        _sync()
    del again
    print(json.dumps(row))


def _pin_probes(folder: str) -> dict:
    """What pinning costs each way: 16 separate 16 MiB slots, registering touched pageable memory, and
    registering 1 GiB of a file's page cache read-only, then the DMA rate straight from it."""
    import numpy as np
    import torch

    cudart, row = torch.cuda.cudart(), {}
    with timed(row, "pin_16x16MiB_s"):
        slots = [torch.empty(16 << 20, dtype=torch.uint8, pin_memory=True) for _ in range(16)]
    del slots
    with timed(row, "malloc_touch_256MiB_s"):
        host = np.ones(256 << 20, dtype=np.uint8)
    with timed(row, "register_256MiB_s"):
        row["register_256MiB_err"] = int(cudart.cudaHostRegister(host.ctypes.data, host.nbytes, 0))
    cudart.cudaHostUnregister(host.ctypes.data)
    address, size = _map_file(shard_files(folder)[0])
    nbytes = min(1 << 30, size // 4096 * 4096)
    with timed(row, "register_pagecache_1GiB_s"):
        err = row["register_pagecache_err"] = int(cudart.cudaHostRegister(address, nbytes, REGISTER_READ_ONLY))
    if err == 0:
        src, dst = _host_tensor(address, nbytes), torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
        for _ in range(3):
            torch.cuda.synchronize()
            with timed(row, "dma_from_pagecache_gbps", nbytes):
                dst.copy_(src, non_blocking=True)
                torch.cuda.synchronize()
        with timed(row, "unregister_1GiB_s"):
            cudart.cudaHostUnregister(address)
    return row


def _rank_slice(full, spec, rank: int, world: int):
    import torch

    if spec.dim is None:
        return full
    parts = full.split(list(spec.sections), dim=spec.dim) if spec.sections else (full,)
    return torch.cat([p.chunk(world, dim=spec.dim)[rank] for p in parts], dim=spec.dim)


# ------------------------------------------------------------------------- orchestration (parent)

def child(*args: str) -> dict:
    return benchlib.child(__file__, "--child", *args, check=False, timeout=300)


def dd_direct_gbps(files: list[str]) -> float:
    start, nbytes = time.perf_counter(), 0
    for path in files:
        subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct"], check=True, capture_output=True)
        nbytes += os.path.getsize(path)
    return nbytes / (time.perf_counter() - start) / 1e9


def available(name: str) -> bool:
    if name == "shardkit-mapped":
        return DEVICE.startswith("cuda")
    if name == "safetensors-prefetch":
        import safetensors

        return tuple(int(x) for x in safetensors.__version__.split(".")[:2]) >= (0, 9)
    return importlib.util.find_spec(PEERS[name][1] or name) is not None


def bench(folder: str, cases: list[tuple[str, str]], runs: int, *, cold: bool) -> dict[str, list[dict]]:
    """Every case (label, ring) and the floor (the disk's O_DIRECT rate cold, the pinned copy warm) in each round,
    the order rotating; the page cache evicted (cold) or filled (warm) before each case, and checked."""
    files, rings = shard_files(folder), dict(cases)

    def one(label: str, r: int) -> dict:
        if label == "floor":
            return {"gbps": dd_direct_gbps(files)} if cold else child("floor")
        resident = benchlib.set_cache(files, cold=cold)
        return {**child("case", label.split("@")[0], folder, rings[label]), "resident": resident}

    return benchlib.rounds(["floor", *rings], runs, one, line=json.dumps)


def table(results: dict[str, list[dict]], title: str, *, cold: bool) -> str:
    floor = benchlib.med(results.pop("floor"), "gbps") or float("nan")
    rows = []
    for label, runs in results.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            rows.append([label, f"error: {runs[0].get('error') if runs else 'not run'}", "", "", "", ""])
            continue
        load, sums = benchlib.med(ok, "load_s"), {r["checksum"] for r in ok}
        gbps, each = ok[0]["bytes"] / load / 1e9, ", ".join(f"{r['load_s']:.3f}" for r in ok)
        rows.append([label, f"{load:.3f} ({each})", f"{gbps:.1f}",
                     f"{gbps / floor:.2f}", f"{benchlib.med(ok, 'peak_rss_mb'):.0f}",
                     f"{'ok' if len(sums) == 1 else 'DIFFERS'} {min(sums) % 10**6:06d}"])
    what = "dd iflag=direct, the disk" if cold else "pinned 1 GiB host → GPU copy, PCIe"
    return (f"### {title}\n\nfloor ({what}): {floor:.1f} GB/s\n\n"
            + benchlib.markdown(["case", "load s (runs)", "GB/s", "× floor", "peak RSS MB", "checksum"], rows,
                                align="lrrrrl"))


def main() -> None:
    benchlib.serve_child({"case": run_case, "floor": lambda: {"gbps": benchlib.pinned_copy_gbps(DEVICE)},
                          "tp": run_tp, "profile": run_profile})
    p = benchlib.parser(__doc__, work="/tmp/shardkit-gpu-read", output=False)
    p.add_argument("--models", default="sdxl,llama3b", help="of sdxl, " + ", ".join(CONFIGS))
    p.add_argument("--peers", default=",".join(PEERS), help="the cases of the warm table")
    for flag, what in (("--cold", "the cold table"), ("--sweep", "ring sizes"), ("--tp", "4 TP ranks of llama3b"),
                       ("--mapped-sweep", "DMA from the page cache"), ("--profile", "where the time goes"),
                       ("--skip-warm", "no warm table")):
        p.add_argument(flag, action="store_true", help=what)
    args = p.parse_args()
    os.makedirs(args.work, exist_ok=True)
    peers = [name for name in args.peers.split(",") if available(name)]
    print("peers:", peers, "| missing:", [name for name in PEERS if name not in peers], flush=True)
    folders, out = {}, []
    for model in args.models.split(","):
        start = time.perf_counter()
        folders[model] = build(model, args.work)
        print(f"built {folders[model]} in {time.perf_counter() - start:.1f} s", flush=True)

    def report(title: str, folder: str, cases: list[tuple[str, str]], runs: int, cold: bool = False) -> None:
        out.append(table(bench(folder, cases, runs, cold=cold), title, cold=cold))
        print(out[-1], flush=True)

    for model, folder in folders.items() if not args.skip_warm else ():
        report(f"{model}, warm", folder, [(name, "") for name in peers], args.runs)
    if args.tp and "llama3b" in folders:
        print("### TP=4 on one GPU (llama3b)", flush=True)
        subprocess.run([sys.executable, __file__, "--child", "tp", folders["llama3b"]], timeout=300)
    for model, folder in folders.items() if args.profile else ():
        print(f"### where the time goes ({model})", flush=True)
        subprocess.run([sys.executable, __file__, "--child", "profile", folder], timeout=300)
    first = folders[next(iter(folders))]
    if args.cold:
        cases = [(name, "") for name in ("shardkit", "safetensors") if name in peers]
        report("cold", first, [*cases, ("shardkit@16,16,4", "16,16,4")], args.runs, cold=True)
    if args.sweep:  # 2026-11-28, H200: 24,16,12 and 16,32,8 were slower
        rings = ("16,16,8,eager", "16,16,8", "32,16,16")
        report("ring sweep (slots, MiB per slot, threads; 2 runs)", first, [(f"shardkit@{r}", r) for r in rings], 2)
    if args.mapped_sweep:
        windows = [(f"shardkit-mapped@{m}", m) for m in ("64,8", "256,8", "64,4", "128,16")]
        report("DMA from the page cache (MiB per window, threads)", first, [("shardkit", ""), *windows], args.runs)
    print("\n\n".join(out))


if __name__ == "__main__":
    main()
