"""Peak activation bytes of one component, from its ``config.json`` and the workload.

Activation estimates (bytes, inference without autograd, compute dtype of ``e`` bytes; ``B`` is
the batch size, doubled for classifier-free guidance when the denoiser uses it):

* UNet: skip tensors ``Σ_i (layers_per_block+1)·N_i·C_i`` plus the widest working set
  ``max_i k_i·N_i·C_i`` (``k=20`` at levels with attention — q/k/v/out, the GEGLU 8× feed-forward,
  norms —, ``k=8`` for resnet-only levels; calibrated on CPU by ``scripts/bench_offload.py --cpu-accounting``), where
  ``N_i = (H/f)(W/f)/4^i`` latent pixels and ``C_i`` the level's channels; eager attention adds ``heads·N_i²`` score bytes (``slice_size`` heads at a
  time with attention slicing), SDPA adds none;
* transformer (DiT/MMDiT/Flux): ``14·T·D`` with ``T = (H/f/p)(W/f/p) + text tokens``, ``D`` the
  hidden width; eager attention adds ``heads·T²``;
* VAE decoder: ``6·H_t·W_t·C_0`` at full resolution plus its single-head mid attention
  ``(H_t/f·W_t/f)²`` when eager, for ``B`` images at once (1 with slicing) and ``H_t×W_t`` the
  whole image (one tile with tiling);
* text encoders: ``T·(4·D + 2·D_ff)`` plus eager ``heads·T²``.

The constants are coarse on purpose: ``scripts/bench_offload.py --cpu-accounting`` (CPU) and ``--model sd15``
(GPU) compare them with measured peaks, and the planner adds a safety margin on top.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..formats.json_types import Config

# Switch sets a component's activation table may contain (sorted names joined with "+").
NO_SWITCH = ""
DEFAULT_TEXT_TOKENS = {"clip": 77, "t5": 512}


@dataclass(frozen=True)
class Workload:
    """What one pipeline call computes: image size, batch, guidance and the attention kernel."""

    height: int | None = None  # None: the denoiser's default (sample_size x VAE scale), else 1024
    width: int | None = None
    batch_size: int = 1
    guidance: bool | None = None  # None: classifier-free guidance unless the denoiser embeds guidance
    attention: str = "sdpa"  # "sdpa" (memory-efficient kernels) or "eager" (materialised scores)


def switch_key(switches: Iterable[str]) -> str:
    """The activation-table key of a switch set: sorted names joined with ``+``."""
    return "+".join(sorted(s for s in switches if s))


@dataclass(frozen=True)
class Context:
    """Pipeline-wide facts the activation formulas need."""

    workload: Workload
    dtype_bytes: int
    vae_scale: int = 8
    cfg: bool = True

    @property
    def image_size(self) -> tuple[int, int]:
        """``(height, width)`` of the workload, which the profiler resolves before any formula runs."""
        height, width = self.workload.height, self.workload.width
        assert height is not None and width is not None, "resolve the workload's image size first"
        return height, width


def _cfg_batch(ctx: Context) -> int:
    guidance = ctx.cfg if ctx.workload.guidance is None else ctx.workload.guidance
    return ctx.workload.batch_size * (2 if guidance else 1)


def _as_list(value: Any, n: int) -> list[int]:
    return list(value) if isinstance(value, (list, tuple)) else [int(value)] * n


def unet_activations(config: Config, ctx: Context, *, sliceable: bool) -> dict[str, int]:
    """UNet peak activation bytes, plain and (when eager attention makes it matter) sliced."""
    channels = list(config.get("block_out_channels") or [320, 640, 1280, 1280])
    levels = len(channels)
    heads = _as_list(config.get("num_attention_heads") or config.get("attention_head_dim") or 8, levels)
    down_types = list(config.get("down_block_types") or ["CrossAttnDownBlock2D"] * levels)
    given_layers = config.get("layers_per_block")
    layers = given_layers if isinstance(given_layers, int) else 2
    height, width = ctx.image_size
    pixels = (height // ctx.vae_scale) * (width // ctx.vae_scale)
    skips = work = 0
    scores = [0]
    for i, c in enumerate(channels):
        n = pixels // 4**i
        attn = "Attn" in down_types[i] if i < len(down_types) else False
        skips += (layers + 1) * n * c
        work = max(work, (20 if attn else 8) * n * c)
        if attn:
            scores.append(heads[i] * n * n)
    plain = skips + work
    out = {NO_SWITCH: plain}
    if ctx.workload.attention == "eager":
        # diffusers' "auto" slice size runs half the heads at a time.
        out[NO_SWITCH] = plain + max(scores)
        if sliceable:
            out["attention_slicing"] = plain + max(scores) // 2
    elif sliceable:
        # Sliced attention replaces SDPA by a sliced eager kernel: never lower than plain SDPA.
        out["attention_slicing"] = plain + max(scores) // 2
    return {k: v * _cfg_batch(ctx) * ctx.dtype_bytes for k, v in out.items()}


def transformer_activations(config: Config, ctx: Context) -> dict[str, int]:
    """DiT/MMDiT/Flux peak activation bytes."""
    heads = int(config.get("num_attention_heads") or 16)
    width = heads * int(config.get("attention_head_dim") or 64)
    patch = int(config.get("patch_size") or 1)
    patch = patch if patch > 1 else 2  # Flux packs 2x2 latents into one token
    image_h, image_w = ctx.image_size
    tokens = (image_h // ctx.vae_scale // patch) * (image_w // ctx.vae_scale // patch)
    if config.get("joint_attention_dim"):
        tokens += DEFAULT_TEXT_TOKENS["t5"]
    plain = 14 * tokens * width
    if ctx.workload.attention == "eager":
        plain += heads * tokens * tokens
    return {NO_SWITCH: plain * _cfg_batch(ctx) * ctx.dtype_bytes}


def vae_activations(config: Config, ctx: Context, *, tiling: bool, slicing: bool) -> dict[str, int]:
    """VAE decode peak activation bytes for every supported tiling/slicing combination."""
    channels: list[int] = list(config.get("block_out_channels") or [128, 256, 512, 512])
    tile = int(config.get("sample_size") or 512)
    if isinstance(config.get("sample_size"), (list, tuple)):
        tile = int(config["sample_size"][0])
    h, w = ctx.image_size
    batch = ctx.workload.batch_size

    def decode(images: int, height: int, width: int) -> int:
        pixels = height * width
        latent = pixels // (ctx.vae_scale * ctx.vae_scale)
        scores = latent * latent if ctx.workload.attention == "eager" else 0
        return images * (6 * pixels * channels[0] + scores) * ctx.dtype_bytes

    th, tw = min(h, tile), min(w, tile)
    out = {NO_SWITCH: decode(batch, h, w)}
    if slicing:
        out["vae_slicing"] = decode(1, h, w)
    if tiling:
        out["vae_tiling"] = decode(batch, th, tw)
    if tiling and slicing:
        out["vae_slicing+vae_tiling"] = decode(1, th, tw)
    return out


def text_encoder_activations(config: Config, ctx: Context) -> dict[str, int]:
    """CLIP/T5-style encoder peak activation bytes."""
    cfg = dict(config.get("text_config") or config)
    width = int(cfg.get("hidden_size") or cfg.get("d_model") or 768)
    ff = int(cfg.get("intermediate_size") or cfg.get("d_ff") or 4 * width)
    heads = int(cfg.get("num_attention_heads") or cfg.get("num_heads") or 12)
    tokens = int(cfg.get("max_position_embeddings") or 0) or DEFAULT_TEXT_TOKENS["t5"]
    tokens = min(tokens, DEFAULT_TEXT_TOKENS["t5"])
    plain = tokens * (4 * width + 2 * ff)
    if ctx.workload.attention == "eager":
        plain += heads * tokens * tokens
    return {NO_SWITCH: plain * _cfg_batch(ctx) * ctx.dtype_bytes}


def activations_for(role: str, config: Config, ctx: Context, *, features: set[str]) -> dict[str, int]:
    """The activation table of one component (see the module docstring for the formulas)."""
    if role == "denoiser":
        if "down_block_types" in config:
            return unet_activations(config, ctx, sliceable="attention_slicing" in features)
        return transformer_activations(config, ctx)
    if role == "vae":
        return vae_activations(config, ctx, tiling="vae_tiling" in features, slicing="vae_slicing" in features)
    return text_encoder_activations(config, ctx)
