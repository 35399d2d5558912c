#!/usr/bin/env python
"""Peak GPU memory and seconds per denoising step of each single-GPU offload strategy, next to the fit planner's
estimate (one table of cases). Method and results: docs/benchmarks.md, "Offload strategies".

    python scripts/bench_offload.py --model sdxl --gpu 16GB
    python scripts/bench_offload.py --model sd15 --size 512 --batch 2 --dtype fp16 --steps 4   # calibration
    python scripts/bench_offload.py --model flux --checkpoint flux-sharded/transformer --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import benchlib
from build_checkpoint import FLUX_DEV, SD15_UNET, SDXL_UNET

CONFIGS = {"sd15": SD15_UNET, "sdxl": SDXL_UNET, "flux": FLUX_DEV}


def build(model: str, *, meta: bool) -> Any:
    from accelerate import init_empty_weights
    from diffusers import FluxTransformer2DModel, UNet2DConditionModel

    cls = FluxTransformer2DModel if model == "flux" else UNet2DConditionModel
    if meta:
        with init_empty_weights():
            return cls.from_config(CONFIGS[model])
    return cls.from_config(CONFIGS[model])


def inputs(model: str, size: int, batch: int) -> dict[str, Any]:
    """One step's inputs on the CPU (``batch`` 2: classifier-free guidance's two halves)."""
    import torch

    latent = size // 8
    if model == "flux":
        tokens = (latent // 2) ** 2
        return {"hidden_states": torch.randn(batch, tokens, 64), "encoder_hidden_states": torch.randn(batch, 512, 4096),
                "pooled_projections": torch.randn(batch, 768), "timestep": torch.tensor([0.5]),
                "guidance": torch.tensor([3.5]), "img_ids": torch.zeros(tokens, 3), "txt_ids": torch.zeros(512, 3)}
    config = CONFIGS[model]
    feed = {"sample": torch.randn(batch, config["in_channels"], latent, latent), "timestep": torch.tensor([500]),
            "encoder_hidden_states": torch.randn(batch, 77, config["cross_attention_dim"])}
    if model == "sdxl":
        feed["added_cond_kwargs"] = {"text_embeds": torch.randn(batch, 1280), "time_ids": torch.randn(batch, 6)}
    return feed


def _to(value: Any, device: str, dtype: Any) -> Any:
    if isinstance(value, dict):
        return {k: _to(v, device, dtype) for k, v in value.items()}
    return value.to(device, dtype) if value.is_floating_point() else value.to(device)


def weights(args: argparse.Namespace, dtype: Any) -> dict[str, Any]:
    """The model's weights on the CPU, built (or loaded) once; each strategy gets its own copy."""
    import torch

    import shardkit

    if args.checkpoint:
        skeleton = build(args.model, meta=True)
        loaded = shardkit.load_model(type(skeleton), args.checkpoint, config=dict(skeleton.config), dtype=dtype)
        return loaded.state_dict()
    with torch.device("cuda"):  # made on the GPU: seconds (minutes on the CPU)
        model = build(args.model, meta=False).to(dtype)
    state = {k: v.cpu() for k, v in model.state_dict().items()}
    del model
    torch.cuda.empty_cache()
    return state


def measure(args: argparse.Namespace, spec: Any, dtype: Any, state: dict[str, Any]) -> dict[str, Any]:
    import gc

    import torch

    import shardkit

    model = build(args.model, meta=True)
    model.load_state_dict({k: v.clone() for k, v in state.items()}, assign=True, strict=True)  # each starts alike
    model.eval()
    if spec.layerwise_casting:
        shardkit.apply_layerwise_casting(model, spec.layerwise_casting[0], str(dtype).removeprefix("torch."))
    if spec.offload == "none":
        model.to("cuda")
    else:
        shardkit.apply_offload(model, spec.offload, device="cuda", **spec.options)
    feed = _to(inputs(args.model, args.size, args.batch), "cuda", dtype)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    with torch.no_grad():
        for _ in range(args.steps):
            start = time.perf_counter()
            model(**feed)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated()
    del model, feed
    gc.collect()
    torch.cuda.empty_cache()
    return {"measured_peak_bytes": peak, "s_per_step": statistics.median(times[1:] or times)}


def table_line(row: Any, measured: dict[str, Any]) -> str:
    est, peak, seconds = row.peak_bytes, measured["measured_peak_bytes"], measured["s_per_step"]
    if peak is None:
        return f"| {row.spec.name} | {est / 1e9:.2f} | OOM | | |"
    return f"| {row.spec.name} | {est / 1e9:.2f} | {peak / 1e9:.2f} | {est / peak:.2f} | {seconds:.3f} |"


def main(argv: list[str] | None = None) -> int:
    parser = benchlib.parser(__doc__, runs=None, output=False, only=True)
    parser.add_argument("--model", choices=sorted(CONFIGS), default="sdxl")
    parser.add_argument("--gpu", default=None, help="GPU budget to mark fits against, e.g. 16GB")
    parser.add_argument("--size", type=int, default=1024, help="image size in pixels")
    parser.add_argument("--batch", type=int, default=1, help="batch of each step (2: classifier-free guidance)")
    parser.add_argument("--steps", type=int, default=4, help="forward passes per strategy (first one is warm-up)")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--checkpoint", help="fill the model from these shards instead of random weights")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args(argv)

    import torch

    import shardkit
    from shardkit.formats.dtypes import resolve_torch_dtype

    dtype = resolve_torch_dtype(args.dtype)
    gpu_bytes = args.gpu or (torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None)
    # Tokens for the activation allowance follow the image size (Flux packs 2x2 latent patches).
    tokens = (args.size // 16) ** 2 if args.model == "flux" else (args.size // 8) ** 2 // 4
    estimate = shardkit.estimate_memory(build(args.model, meta=True), gpu_bytes=gpu_bytes, dtype=dtype, tokens=tokens,
                                        compute_dtype=dtype)
    if not torch.cuda.is_available():
        print("no CUDA device: running the estimator only (no measured peaks or step times)")
        print(estimate.table())
        return 0
    print(f"{torch.cuda.get_device_name(0)}; {args.model} {args.dtype}, {args.size}², batch {args.batch}\n")
    print("| strategy | est. peak GB | measured peak GB | est/meas | s/step |\n|---|---:|---:|---:|---:|", flush=True)
    rows, state = [], weights(args, dtype)
    for row in [r for r in estimate.rows if r.spec.name in benchlib.picked([r.spec.name], args.only)]:
        try:
            measured = measure(args, row.spec, dtype, state)
        except torch.cuda.OutOfMemoryError:
            measured = {"measured_peak_bytes": None, "s_per_step": None, "error": "out of memory"}
        rows.append({**row.to_dict(), **measured})
        print(table_line(row, measured), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "size": args.size, "batch": args.batch, "dtype": args.dtype,
                       "device": torch.cuda.get_device_name(0), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
