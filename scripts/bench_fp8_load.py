#!/usr/bin/env python3
"""Benchmark a Flux-shaped transformer as bf16 vs fp8-block on disk: bytes, load time, peak RSS (issue 23).

Builds a FluxTransformer2DModel of the real width (24 heads × 128, 3072) with ``--double`` double and
``--single`` single blocks (default 2 and 4: ~1.3B parameters) from its config, random bf16 weights,
saves it, and writes its ``shardkit convert --quantize fp8-block`` copy. Then, each in a fresh
process, interleaved, ``--runs`` times (median reported):

* ``shardkit.load_model(..., device_map="cpu")`` of each (the fp8 copy stays fp8 in memory), and
* the same plus one forward pass (every weight touched: the fp8 copy dequantizes layer by layer).

"load s" is measured inside the child (imports excluded); peak RSS is the child's high-water mark
(VmHWM: ru_maxrss would carry the RSS of this parent, which built the model, across exec).

    .venv/bin/python scripts/bench_fp8_load.py --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = r"""
import json, sys, time, torch, shardkit
path, forward = sys.argv[1], sys.argv[2] == "1"
start = time.perf_counter()
model = shardkit.load_model("diffusers:FluxTransformer2DModel", path, device_map="cpu")
loaded = time.perf_counter() - start
if forward:
    g = torch.Generator().manual_seed(0)
    inner = model.config.num_attention_heads * model.config.attention_head_dim
    inputs = {"hidden_states": torch.randn(1, 64, model.config.in_channels, generator=g, dtype=torch.bfloat16),
              "encoder_hidden_states": torch.randn(1, 16, model.config.joint_attention_dim, generator=g, dtype=torch.bfloat16),
              "pooled_projections": torch.randn(1, model.config.pooled_projection_dim, generator=g, dtype=torch.bfloat16),
              "timestep": torch.tensor([0.5]), "img_ids": torch.zeros(64, 3), "txt_ids": torch.zeros(16, 3)}
    with torch.no_grad():
        model(**inputs)
total = time.perf_counter() - start
held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
hwm_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"load_s": loaded, "total_s": total, "held_bytes": held, "rss_mb": hwm_kb / 1024}))
"""


def build(work: str, double: int, single: int) -> tuple[str, str]:
    import torch
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import save_file

    import shardkit

    bf16, fp8 = os.path.join(work, "bf16"), os.path.join(work, "fp8")
    if not os.path.exists(os.path.join(bf16, "diffusion_pytorch_model.safetensors")):
        with torch.device("meta"):
            model = FluxTransformer2DModel(num_layers=double, num_single_layers=single)
        os.makedirs(bf16, exist_ok=True)
        g = torch.Generator().manual_seed(0)
        state = {n: (torch.randn(t.shape, generator=g) * 0.02).to(torch.bfloat16) for n, t in model.state_dict().items()}
        save_file(state, os.path.join(bf16, "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
        model.save_config(bf16)
        del state
    if not os.path.exists(os.path.join(fp8, "config.json")):
        shardkit.convert(bf16, fp8, quantize="fp8-block", max_shard_size="100GB")
    return bf16, fp8


def disk_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder) if n.endswith(".safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="/tmp/shardkit-bench-fp8")
    parser.add_argument("--double", type=int, default=2)
    parser.add_argument("--single", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    bf16, fp8 = build(args.work, args.double, args.single)
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for r in range(args.runs):
        for name, path in (("bf16", bf16), ("fp8-block", fp8))[:: 1 if r % 2 == 0 else -1]:
            for forward in ("0", "1"):
                subprocess.run(["sync"], check=True)
                out = subprocess.run([sys.executable, "-c", CHILD, path, forward], check=True, capture_output=True,
                                     text=True)
                data = json.loads(out.stdout.strip().splitlines()[-1])
                results.setdefault((name, forward), []).append(data)
                print(f"  run {r + 1} {name} {'load+forward' if forward == '1' else 'load'}: {data}", flush=True)
    print(f"\nFluxTransformer2DModel, width 3072, {args.double} double + {args.single} single blocks, random weights, "
          f"CPU, median of {args.runs}")
    print("| checkpoint | on disk | held in memory | load_model s | peak RSS | load + 1 forward s | peak RSS |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, path in (("bf16", bf16), ("fp8-block", fp8)):
        load, run = results[(name, "0")], results[(name, "1")]
        med = lambda rows, key: statistics.median(row[key] for row in rows)  # noqa: E731
        print(f"| {name} | {disk_bytes(path) / 1e9:.2f} GB | {med(load, 'held_bytes') / 1e9:.2f} GB | "
              f"{med(load, 'load_s'):.2f} | {med(load, 'rss_mb') / 1024:.2f} GiB | {med(run, 'total_s'):.2f} | "
              f"{med(run, 'rss_mb') / 1024:.2f} GiB |")


if __name__ == "__main__":
    main()
