#!/usr/bin/env python3
"""Benchmark a Flux-shaped transformer as bf16 vs fp8-block on disk: bytes, load time (and one forward pass), peak RSS
(issue 23). Method: docs/benchmarks.md, "How each benchmark measures".

    .venv/bin/python scripts/bench_fp8_load.py --runs 3
"""

from __future__ import annotations

import json
import os
import sys

import benchlib
from benchlib import med, shard_files
from build_checkpoint import random_source

CHILD = r"""
import json, sys, time, torch, shardkit
sys.path.insert(0, sys.argv[1])  # benchlib
path, forward = sys.argv[2], sys.argv[3] == "1"
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
from benchlib import peak_rss_mb
print(json.dumps({"load_s": loaded, "total_s": total, "held_bytes": held, "rss_mb": peak_rss_mb()}))
"""


def build(work: str, double: int, single: int) -> tuple[str, str]:
    """The bf16 transformer (random weights, one file) and its fp8-block copy, built once."""
    import torch
    from diffusers import FluxTransformer2DModel

    import shardkit

    bf16, fp8 = os.path.join(work, "bf16"), os.path.join(work, "fp8")
    if not os.path.exists(os.path.join(bf16, "config.json")):
        with torch.device("meta"):
            model = FluxTransformer2DModel(num_layers=double, num_single_layers=single)
        shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
        os.makedirs(work, exist_ok=True)
        shardkit.split(random_source(shapes, dtype="BF16", prefix="diffusion_pytorch_model"), bf16,
                       max_shard_size="100GB", overwrite=True)
        model.save_config(bf16)
    if not os.path.exists(os.path.join(fp8, "config.json")):
        shardkit.convert(bf16, fp8, quantize="fp8-block", max_shard_size="100GB")
    return bf16, fp8


def main() -> None:
    p = benchlib.parser(__doc__, work="/tmp/shardkit-bench-fp8")
    p.add_argument("--double", type=int, default=2)
    p.add_argument("--single", type=int, default=4)
    args = p.parse_args()
    paths = dict(zip(("bf16", "fp8-block"), build(args.work, args.double, args.single), strict=True))

    def one(key: tuple[str, str], r: int) -> dict[str, float]:  # key: (checkpoint, "1" with a forward pass)
        return benchlib.child("-c", CHILD, benchlib.HERE, paths[key[0]], key[1])

    loads: list[tuple[float, float]] = []
    results = benchlib.rounds([(name, forward) for name in paths for forward in ("0", "1")], args.runs, one,
                              loads=loads, line=json.dumps)
    rows = []
    for name, path in paths.items():
        load, run = results[(name, "0")], results[(name, "1")]
        rows.append([name, f"{sum(os.path.getsize(f) for f in shard_files(path)) / 1e9:.2f} GB",
                     f"{med(load, 'held_bytes') / 1e9:.2f} GB", f"{med(load, 'load_s'):.2f}",
                     f"{med(load, 'rss_mb') / 1024:.2f} GiB", f"{med(run, 'total_s'):.2f}",
                     f"{med(run, 'rss_mb') / 1024:.2f} GiB"])
    head = benchlib.report_head(f"FluxTransformer2DModel, width 3072, {args.double} double + {args.single} single "
                                "blocks, random weights, CPU", runs=args.runs, loads=loads)
    table = benchlib.markdown(["checkpoint", "on disk", "held in memory", "load_model s", "peak RSS",
                               "load + 1 forward s", "peak RSS"], rows)
    benchlib.publish_report(head + table, args.output)


if __name__ == "__main__":
    sys.exit(main())
