#!/usr/bin/env python
"""Calibrate the fit planner's estimates against measurements; prints a markdown table.

With CUDA: a real-size UNet (SD 1.5 config, fp16) — filled from ``--checkpoint`` shards when
given (a shardkit/diffusers ``unet/`` folder), else random weights — runs one denoising step per
candidate setup (all on GPU, model offload, group offload block/leaf with and without streams,
sequential offload, each ± fp8 layerwise casting) and records the measured peak
(``torch.cuda.max_memory_allocated``) and step time next to the planner's estimate.

Without CUDA: the estimates are checked against torch.cuda-free accounting on the CPU: parameter
bytes actually resident after building the model (sum of ``numel × element_size``), and the
activation bytes of a forward pass, measured as the peak of live tensor-storage bytes seen by a
``TorchDispatchMode`` (every op output is counted until its tensor is freed).

    .venv/bin/python scripts/calibrate_fit.py                 # CPU accounting, small UNets
    .venv/bin/python scripts/calibrate_fit.py --checkpoint sd15-sharded/unet --height 512
"""

from __future__ import annotations

import argparse
import functools
import weakref
from collections.abc import Iterator
from typing import Any

from benchlib import fresh_copy, gpu_weights, timed_steps
from build_checkpoint import SD15_UNET

SMALL_UNETS = {
    "tiny (32,64)": {"block_out_channels": [32, 64], "layers_per_block": 1, "cross_attention_dim": 32,
                     "attention_head_dim": 4, "norm_num_groups": 8,
                     "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
                     "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"]},
    "small (64,128,256)": {"block_out_channels": [64, 128, 256], "layers_per_block": 2, "cross_attention_dim": 128,
                           "attention_head_dim": 8, "norm_num_groups": 32,
                           "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
                           "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"]},
}


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


def unet_inputs(model: Any, height: int, width: int, batch: int, device: str, dtype: Any) -> tuple:
    import torch

    latent = torch.randn(batch, model.config.in_channels, height // 8, width // 8, device=device, dtype=dtype)
    context = torch.randn(batch, 77, model.config.cross_attention_dim, device=device, dtype=dtype)
    return latent, torch.tensor([10], device=device), context


def cpu_rows(height: int, width: int) -> list[str]:
    import torch
    from diffusers import UNet2DConditionModel

    from shardkit.fitting.activations import Workload
    from shardkit.fitting.profile import profile_module

    rows = []
    for name, config in SMALL_UNETS.items():
        torch.manual_seed(0)
        model = UNet2DConditionModel(**config).eval()
        resident = sum(p.numel() * p.element_size() for p in model.parameters())
        resident += sum(b.numel() * b.element_size() for b in model.buffers())
        profile = profile_module(model, Workload(height, width, 1, True, "sdpa"), name="unet", role="denoiser",
                                 config=dict(model.config))
        inputs = unet_inputs(model, height, width, 2, "cpu", torch.float32)  # batch 2 = CFG
        with torch.no_grad(), live_bytes_mode() as mode:
            model(*inputs)
        est_act = profile.activation_bytes[""]
        rows.append(f"| {name} | {height}x{width} | {profile.weight_bytes:,} | {resident:,} | "
                    f"{est_act:,} | {mode.peak:,} | {est_act / max(mode.peak, 1):.2f} |")
    return ["| UNet | image | est. weights B | resident B | est. activations B | measured activations B | est/meas |",
            "|---|---|---:|---:|---:|---:|---:|", *rows]


def unet_copy(config: Any, state: dict[str, Any]) -> Any:
    """A UNet skeleton given its own copy of ``state`` (filled outside init_empty_weights, which would
    move the assigned tensors to the meta device)."""
    from accelerate import init_empty_weights
    from diffusers import UNet2DConditionModel

    with init_empty_weights():
        skeleton = UNet2DConditionModel.from_config(config)
    return fresh_copy(skeleton, state)


def gpu_rows(checkpoint: str | None, height: int, width: int, steps: int) -> Iterator[str]:
    """The table's lines, each yielded as soon as it is measured (a long run shows its progress)."""
    import torch
    from diffusers import UNet2DConditionModel

    from shardkit.fitting.activations import Workload
    from shardkit.fitting.candidates import Budget, Margin, evaluate
    from shardkit.fitting.peaks import STRATEGIES
    from shardkit.fitting.profile import profile_module

    if checkpoint:
        import shardkit

        probe = shardkit.load_model(UNet2DConditionModel, checkpoint, config=checkpoint, device_map="cpu",
                                    dtype=torch.float16).eval()
        weights = probe.state_dict()
    else:
        weights = gpu_weights(lambda: UNet2DConditionModel.from_config(SD15_UNET), torch.float16)
        probe = unet_copy(SD15_UNET, weights)

    def build() -> Any:  # each setup gets its own copy of the weights (built or loaded once)
        return unet_copy(probe.config, weights)

    profile = profile_module(probe, Workload(height, width, 1, True, "sdpa"), name="unet", role="denoiser",
                             config=dict(probe.config))
    budget = Budget((torch.cuda.get_device_properties(0).total_memory,))
    yield "| setup | est. peak GB | measured peak GB | est/meas | s/step |"
    yield "|---|---:|---:|---:|---:|"
    for strategy in [s for s in STRATEGIES if s.min_gpus == 1]:
        for fp8 in (False, True):
            cand = evaluate(strategy, fp8, [profile], budget, Margin(0.0, 0))
            model = build()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            from shardkit.fitting.autofit import apply_plan  # noqa: F401  (same code path as fit="auto")
            from shardkit.runtime.casting import apply_layerwise_casting
            from shardkit.runtime.offload import apply_offload

            if fp8:
                apply_layerwise_casting(model, "float8_e4m3fn", "float16")
            if strategy.offload:
                apply_offload(model, strategy.offload, device="cuda", **dict(strategy.offload_options))
            else:
                model.to("cuda")
            inputs = unet_inputs(model, height, width, 2, "cuda", torch.float16)
            times, peak_bytes = timed_steps(functools.partial(model, *inputs), steps + 1, reset_peak=False)  # 1 warm-up
            seconds = sum(times[1:]) / steps
            peak = peak_bytes - base
            est = max(cand.peaks.gpu)
            yield f"| {cand.label} | {est / 1e9:.2f} | {peak / 1e9:.2f} | {est / max(peak, 1):.2f} | {seconds:.3f} |"
            del model, inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="a unet/ folder of shards (GPU mode); default: random SD 1.5 UNet")
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cpu", action="store_true", help="CPU accounting even when CUDA is present")
    args = parser.parse_args()
    import torch

    if torch.cuda.is_available() and not args.cpu:
        h, w = args.height or 512, args.width or 512
        print(f"CUDA: {torch.cuda.get_device_name(0)}; SD 1.5 UNet fp16, {h}x{w}, batch 2 (CFG)\n")
        for line in gpu_rows(args.checkpoint, h, w, args.steps):
            print(line, flush=True)
    else:
        h, w = args.height or 256, args.width or 256
        print(f"no CUDA: CPU accounting (fp32, batch 2 for CFG), {h}x{w}\n")
        print("\n".join(cpu_rows(h, w)))


if __name__ == "__main__":
    main()
