"""Tiny models shared by the offload/casting/estimate/pipeline tests (real classes, toy sizes)."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

_SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "examples", "staged_multi_gpu.py")
needs_cuda = torch.cuda.is_available()


def staged_script() -> Any:
    """docs/examples/staged_multi_gpu.py as a module: it owns the tiny Flux pipeline builder."""
    spec = importlib.util.spec_from_file_location("staged_multi_gpu", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_flux_transformer(dtype: torch.dtype = torch.float32, seed: int = 0) -> Any:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                                   num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                                   axes_dims_rope=[4, 4, 8])
    return model.to(dtype).eval()


def flux_inputs(dtype: torch.dtype = torch.float32, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(1, 16, 16, generator=g).to(dtype),
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=g).to(dtype),
        "pooled_projections": torch.randn(1, 32, generator=g).to(dtype),
        "timestep": torch.tensor([0.5]), "img_ids": torch.zeros(16, 3), "txt_ids": torch.zeros(8, 3),
    }


def run_flux(model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample.float().cpu()


class PlainNet(torch.nn.Module):
    """Plain torch: an embedding, a ModuleList of blocks (group offload units), a norm and a head."""

    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))
            for _ in range(depth)
        )
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x))


def plain_net(seed: int = 0) -> PlainNet:
    torch.manual_seed(seed)
    return PlainNet().eval()
