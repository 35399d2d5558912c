#!/usr/bin/env python
"""Peak GPU memory and seconds per denoising step for each offload strategy, next to the estimate.

With CUDA: builds a real-size denoiser (SDXL UNet or Flux transformer; random weights, or
filled from shards with ``--checkpoint``), then for every strategy of
:func:`shardkit.fitting.estimate.strategy_specs` (the single-GPU rows of :data:`shardkit.fitting.peaks.STRATEGIES`,
named as ``shardkit fit`` names them) installs it with ``apply_offload`` /
``apply_layerwise_casting``, runs ``--steps`` forward passes at ``--size`` pixels and records
``torch.cuda.max_memory_allocated`` and the median step time. Without CUDA it says so and prints
the estimator's table for the real-size meta skeleton only.

    python scripts/bench_offload.py --model sdxl --gpu 16GB
    python scripts/bench_offload.py --model flux --checkpoint flux-sharded/transformer --json out.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from typing import Any

from benchlib import fresh_copy, gpu_weights, timed_steps
from build_checkpoint import FLUX_DEV, SDXL_UNET


def build(model: str, *, meta: bool) -> Any:
    from accelerate import init_empty_weights
    from diffusers import FluxTransformer2DModel, UNet2DConditionModel

    cls, config = (UNet2DConditionModel, SDXL_UNET) if model == "sdxl" else (FluxTransformer2DModel, FLUX_DEV)
    if meta:
        with init_empty_weights():
            return cls.from_config(config)
    return cls.from_config(config)


def inputs(model: str, size: int, dtype: Any, device: str) -> dict[str, Any]:
    import torch

    latent = size // 8
    if model == "sdxl":
        return {"sample": torch.randn(1, 4, latent, latent), "timestep": torch.tensor([500]),
                "encoder_hidden_states": torch.randn(1, 77, 2048),
                "added_cond_kwargs": {"text_embeds": torch.randn(1, 1280), "time_ids": torch.randn(1, 6)}}
    tokens = (latent // 2) ** 2
    cast = {k: v.to(dtype) for k, v in {"hidden_states": torch.randn(1, tokens, 64),
                                         "encoder_hidden_states": torch.randn(1, 512, 4096),
                                         "pooled_projections": torch.randn(1, 768)}.items()}
    return {**cast, "timestep": torch.tensor([0.5]), "guidance": torch.tensor([3.5]),
            "img_ids": torch.zeros(tokens, 3), "txt_ids": torch.zeros(512, 3)}


def _to(value: Any, device: str, dtype: Any) -> Any:

    if isinstance(value, dict):
        return {k: _to(v, device, dtype) for k, v in value.items()}
    return value.to(device, dtype) if value.is_floating_point() else value.to(device)


def weights(args: argparse.Namespace, dtype: Any) -> dict[str, Any]:
    """The model's weights on the CPU, built (or loaded) once; each strategy gets its own copy."""
    import shardkit

    if args.checkpoint:
        skeleton = build(args.model, meta=True)
        return shardkit.load_model(type(skeleton), args.checkpoint, config=dict(skeleton.config), dtype=dtype).state_dict()
    return gpu_weights(lambda: build(args.model, meta=False), dtype)


def measure(args: argparse.Namespace, spec: Any, dtype: Any, state: dict[str, Any]) -> dict[str, Any]:
    import gc

    import torch

    import shardkit

    model = fresh_copy(build(args.model, meta=True), state)
    if spec.layerwise_casting:
        shardkit.apply_layerwise_casting(model, spec.layerwise_casting[0], str(dtype).removeprefix("torch."))
    if spec.offload == "none":
        model.to("cuda")
    else:
        shardkit.apply_offload(model, spec.offload, device="cuda", **spec.options)
    feed = _to(inputs(args.model, args.size, dtype, "cuda"), "cuda", dtype)
    times, peak = timed_steps(functools.partial(model, **feed), args.steps)
    del model, feed
    gc.collect()
    torch.cuda.empty_cache()
    return {"measured_peak_bytes": peak, "s_per_step": statistics.median(times[1:] or times)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["sdxl", "flux"], default="sdxl")
    parser.add_argument("--gpu", default=None, help="GPU budget to mark fits against, e.g. 16GB")
    parser.add_argument("--size", type=int, default=1024, help="image size in pixels")
    parser.add_argument("--steps", type=int, default=4, help="forward passes per strategy (first one is warm-up)")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--checkpoint", help="fill the model from these shards instead of random weights")
    parser.add_argument("--only", nargs="*", help="strategy names to run (default: all)")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args(argv)

    import torch

    import shardkit
    from shardkit.formats.dtypes import resolve_torch_dtype
    from shardkit.units import format_size

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
    rows = []
    state = weights(args, dtype)
    for row in estimate.rows:
        spec = row.spec
        if args.only and spec.name not in args.only:
            continue
        try:
            measured = measure(args, spec, dtype, state)
        except torch.cuda.OutOfMemoryError:
            measured = {"measured_peak_bytes": None, "s_per_step": None, "error": "out of memory"}
        rows.append({**row.to_dict(), **measured})
        peak = measured["measured_peak_bytes"]
        print(f"{spec.name:<26} est {format_size(row.peak_bytes):>10}  measured "
              f"{format_size(peak) if peak else 'OOM':>10}  {measured['s_per_step'] or float('nan'):.3f} s/step", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "size": args.size, "dtype": args.dtype, "device": torch.cuda.get_device_name(0),
                       "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
