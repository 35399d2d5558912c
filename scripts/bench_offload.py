#!/usr/bin/env python
"""Peak GPU memory and seconds per denoising step of each single-GPU offload strategy, next to the fit planner's
estimate (one table of cases). ``--cpu-accounting``: no GPU, the planner's weight and activation estimates of two
small UNets against the bytes counted on the CPU. Method and results: docs/benchmarks.md, "Offload strategies" and
"The fit planner against measured peaks".

    python scripts/bench_offload.py --model sdxl --gpu 16GB
    python scripts/bench_offload.py --model sd15 --size 512 --batch 2 --dtype fp16 --steps 4   # calibration
    python scripts/bench_offload.py --cpu-accounting --size 256   # calibration on the CPU
    python scripts/bench_offload.py --model flux --checkpoint flux-sharded/transformer --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import weakref
from typing import Any

import benchlib
from build_checkpoint import FLUX_DEV, SD15_UNET, SDXL_UNET, TINY_UNET, diffusers_model

CONFIGS = {"sd15": SD15_UNET, "sdxl": SDXL_UNET, "flux": FLUX_DEV}
SMALL_UNETS = {  # --cpu-accounting: small enough for fp32 forward passes on the CPU
    "tiny (32,64)": TINY_UNET,
    "small (64,128,256)": {"_class_name": "UNet2DConditionModel", "block_out_channels": [64, 128, 256],
                           "layers_per_block": 2, "in_channels": 4, "cross_attention_dim": 128,
                           "attention_head_dim": 8, "norm_num_groups": 32,
                           "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
                           "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"]},
}


def inputs(config: dict[str, Any], size: int, batch: int) -> dict[str, Any]:
    """One step's inputs on the CPU (``batch`` 2: classifier-free guidance's two halves)."""
    import torch

    latent = size // 8
    if config["_class_name"] == "FluxTransformer2DModel":
        tokens = (latent // 2) ** 2
        return {"hidden_states": torch.randn(batch, tokens, 64), "encoder_hidden_states": torch.randn(batch, 512, 4096),
                "pooled_projections": torch.randn(batch, 768), "timestep": torch.tensor([0.5]),
                "guidance": torch.tensor([3.5]), "img_ids": torch.zeros(tokens, 3), "txt_ids": torch.zeros(512, 3)}
    feed = {"sample": torch.randn(batch, config["in_channels"], latent, latent), "timestep": torch.tensor([500]),
            "encoder_hidden_states": torch.randn(batch, 77, config["cross_attention_dim"])}
    if config.get("addition_embed_type") == "text_time":  # SDXL
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
        skeleton = diffusers_model(CONFIGS[args.model])
        loaded = shardkit.load_model(type(skeleton), args.checkpoint, config=dict(skeleton.config), dtype=dtype)
        return loaded.state_dict()
    with torch.device("cuda"):  # made on the GPU: seconds (minutes on the CPU)
        model = diffusers_model(CONFIGS[args.model], meta=False).to(dtype)
    state = {k: v.cpu() for k, v in model.state_dict().items()}
    del model
    torch.cuda.empty_cache()
    return state


def measure(args: argparse.Namespace, spec: Any, dtype: Any, state: dict[str, Any]) -> dict[str, Any]:
    import gc

    import torch

    import shardkit

    model = diffusers_model(CONFIGS[args.model])
    model.load_state_dict({k: v.clone() for k, v in state.items()}, assign=True, strict=True)  # each starts alike
    model.eval()
    if spec.layerwise_casting:
        shardkit.apply_layerwise_casting(model, spec.layerwise_casting[0], str(dtype).removeprefix("torch."))
    if spec.offload == "none":
        model.to("cuda")
    else:
        shardkit.apply_offload(model, spec.offload, device="cuda", **spec.options)
    feed = _to(inputs(CONFIGS[args.model], args.size, args.batch), "cuda", dtype)
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


def live_bytes_mode() -> Any:
    """A dispatch mode tracking the peak of live CPU tensor-storage bytes created by ops."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class LiveBytes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.live = self.peak = 0
            self.seen: set[int] = set()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    storage = t.untyped_storage()
                    key, size = storage.data_ptr(), storage.nbytes()
                    if size and key not in self.seen:
                        self.seen.add(key)
                        self.live += size
                        self.peak = max(self.peak, self.live)
                        weakref.finalize(t, self._free, key, size)
            return out

        def _free(self, key: int, size: int) -> None:
            if key in self.seen:
                self.seen.discard(key)
                self.live -= size

    return LiveBytes()


def cpu_accounting(size: int) -> None:
    """Print the planner's weight and activation bytes of the small UNets next to the parameter bytes resident after
    building each and the peak of live tensor bytes in one forward pass (fp32, batch 2)."""
    import torch

    from shardkit.fitting.activations import Workload
    from shardkit.fitting.profile import profile_module

    print(f"CPU accounting (fp32, batch 2 for CFG), {size}x{size}\n")
    print("| UNet | image | est. weights B | resident B | est. activations B | measured activations B | est/meas |\n"
          "|---|---|---:|---:|---:|---:|---:|")
    for name, config in SMALL_UNETS.items():
        torch.manual_seed(0)
        model = diffusers_model(config, meta=False).eval()
        resident = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        profile = profile_module(model, Workload(size, size, 1, True, "sdpa"), name="unet", role="denoiser",
                                 config=dict(model.config))
        feed = inputs(config, size, 2)  # made before the accounting starts
        with torch.no_grad(), live_bytes_mode() as mode:
            model(**feed)
        est = profile.activation_bytes[""]
        print(f"| {name} | {size}x{size} | {profile.weight_bytes:,} | {resident:,} | {est:,} | {mode.peak:,} | "
              f"{est / max(mode.peak, 1):.2f} |")


def main(argv: list[str] | None = None) -> int:
    parser = benchlib.parser(__doc__, runs=None, output=False, only=True)
    parser.add_argument("--model", choices=sorted(CONFIGS), default="sdxl")
    parser.add_argument("--gpu", default=None, help="GPU budget to mark fits against, e.g. 16GB")
    parser.add_argument("--size", type=int, help="image size in pixels (default 1024; 256 with --cpu-accounting)")
    parser.add_argument("--batch", type=int, default=1, help="batch of each step (2: classifier-free guidance)")
    parser.add_argument("--steps", type=int, default=4, help="forward passes per strategy (first one is warm-up)")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--checkpoint", help="fill the model from these shards instead of random weights")
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--cpu-accounting", action="store_true",
                        help="instead: two small UNets' estimates against the bytes counted on the CPU (fp32, batch 2)")
    args = parser.parse_args(argv)
    if args.cpu_accounting:
        cpu_accounting(args.size or 256)
        return 0
    args.size = args.size or 1024

    import torch

    import shardkit
    from shardkit.formats.dtypes import resolve_torch_dtype

    dtype = resolve_torch_dtype(args.dtype)
    gpu_bytes = args.gpu or (torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None)
    # Tokens for the activation allowance follow the image size (Flux packs 2x2 latent patches).
    tokens = (args.size // 16) ** 2 if args.model == "flux" else (args.size // 8) ** 2 // 4
    skeleton = diffusers_model(CONFIGS[args.model])
    estimate = shardkit.estimate_memory(skeleton, gpu_bytes=gpu_bytes, dtype=dtype, tokens=tokens, compute_dtype=dtype)
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
