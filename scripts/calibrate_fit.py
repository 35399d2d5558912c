#!/usr/bin/env python
"""The fit planner's estimates against torch.cuda-free accounting on the CPU, small UNets; a markdown table.
Method: docs/benchmarks.md, "The fit planner against measured peaks" (the GPU peaks: scripts/bench_offload.py).

    .venv/bin/python scripts/calibrate_fit.py --height 256
"""

from __future__ import annotations

import weakref
from typing import Any

import benchlib
from build_checkpoint import TINY_UNET

SMALL_UNETS = {
    "tiny (32,64)": {k: v for k, v in TINY_UNET.items() if k != "_class_name"},
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


def main() -> None:
    parser = benchlib.parser(__doc__, runs=None, output=False)
    parser.add_argument("--height", type=int, default=256)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    print(f"CPU accounting (fp32, batch 2 for CFG), {args.height}x{args.width}\n")
    print("\n".join(cpu_rows(args.height, args.width)))


if __name__ == "__main__":
    main()
