"""The original (single-file) names of a diffusers model's tensors, per layout, and diffusers' mapping back.

A :class:`Layout` proposes, for every tensor of a diffusers model, the name it has in the
original checkpoint (LDM/SGM for SD 1.x/2.x/XL UNets, VAEs and text encoders, SAI for SD3, BFL
for Flux) and how tensors fuse there (q/k/v into one ``qkv``, a VAE attention matrix as a 1×1
convolution, OpenCLIP's transposed ``text_projection``). Those proposals are checked, and the
exact placement of every element is learnt, by running diffusers' own conversion of that layout
forward (:mod:`shardkit.layouts.single_file_trace`), so the names written are the names
diffusers reads; the top-level tables come from diffusers itself (``DIFFUSERS_TO_LDM_MAPPING``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import InvalidInputError
from ..formats.json_types import Config

if TYPE_CHECKING:
    import torch

__all__ = ["LAYOUTS", "Layout", "original_shapes"]

Shape = tuple[int, ...]
# A state dict as diffusers' conversion functions take and give it (meta-device tensors here).
Tensors = dict[str, "torch.Tensor"]
Rule = tuple[str, str, int]  # (regex on the diffusers name, original name template, place in a fused tensor)
Namer = Callable[[Mapping[str, Shape], Config], Callable[[str], "tuple[str, int] | None"]]


@dataclass(frozen=True)
class Layout:
    """How one kind of diffusers model is laid out in original single-file checkpoints.

    Attributes:
        kind: ``unet``, ``vae``, ``clip``, ``openclip``, ``sd3``, ``flux``.
        namer: ``(shapes, config) → (diffusers name → (original name without prefix, place))``.
        forward: ``(checkpoint, config, prefix, shapes) → diffusers state dict``: diffusers' mapping.
        reshape: original name (without prefix) → its shape given the fused shape, where they differ.
    """

    kind: str
    namer: Namer
    forward: Callable[[Tensors, Config, str, Mapping[str, Shape]], Mapping[str, torch.Tensor]]
    reshape: Callable[[str, Shape], Shape] = lambda name, shape: shape


def original_shapes(layout: Layout, shapes: Mapping[str, Shape], config: Config, prefix: str,
                    *, where: str) -> dict[str, Shape]:
    """The original tensors ``layout`` proposes for a model with these diffusers ``shapes``."""
    name_of = layout.namer(shapes, config)
    groups: dict[str, list[tuple[int, str]]] = {}
    for name in shapes:
        found = name_of(name)
        if found is None:
            raise InvalidInputError(f"{where}: {name} has no place in the original {layout.kind} layout; this model "
                                    "variant cannot be exported to a single file")
        groups.setdefault(found[0], []).append((found[1], name))
    out: dict[str, Shape] = {}
    for original, parts in groups.items():
        first = shapes[min(parts)[1]]
        fused = (sum(shapes[n][0] for _, n in parts), *first[1:]) if first else first
        out[prefix + original] = layout.reshape(original, fused)
    return out


def _by_rules(rules: list[Rule]) -> Namer:
    compiled = [(re.compile(pattern), template, place) for pattern, template, place in rules]

    def namer(shapes: Mapping[str, Shape], config: Config) -> Callable[[str], tuple[str, int] | None]:
        def name_of(name: str) -> tuple[str, int] | None:
            for pattern, template, place in compiled:
                m = pattern.fullmatch(name)
                if m:
                    return m.expand(template), place
            return None

        return name_of

    return namer


def _sfu() -> Any:
    from diffusers.loaders import single_file_utils

    return single_file_utils


# ----------------------------------------------------------------------------- SD UNet (LDM)

_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "norm2": "out_layers.0", "conv2": "out_layers.3",
           "time_emb_proj": "emb_layers.1", "conv_shortcut": "skip_connection"}


def _unet_namer(shapes: Mapping[str, Shape], config: Config) -> Callable[[str], tuple[str, int] | None]:
    sfu = _sfu().DIFFUSERS_TO_LDM_MAPPING["unet"]
    top = dict(sfu["layers"])
    if config.get("class_embed_type") in ("timestep", "projection"):
        top.update(sfu["class_embed_type"])
    if config.get("addition_embed_type") == "text_time":
        top.update(sfu["addition_embed_type"])
    per = config["layers_per_block"]
    if not isinstance(per, int):
        raise InvalidInputError(f"layers_per_block {per!r}: only UNets with one layers_per_block for every block have "
                                "an LDM single-file layout")
    blocks: dict[str, str] = {"mid_block.resnets.0.": "middle_block.0.", "mid_block.attentions.0.": "middle_block.1.",
                              "mid_block.resnets.1.": "middle_block.2."}
    count = len(config["down_block_types"])
    for i in range(count):
        for j in range(per):
            blocks[f"down_blocks.{i}.resnets.{j}."] = f"input_blocks.{(per + 1) * i + j + 1}.0."
            blocks[f"down_blocks.{i}.attentions.{j}."] = f"input_blocks.{(per + 1) * i + j + 1}.1."
        blocks[f"down_blocks.{i}.downsamplers.0.conv."] = f"input_blocks.{(per + 1) * (i + 1)}.0.op."
        for j in range(per + 1):
            blocks[f"up_blocks.{i}.resnets.{j}."] = f"output_blocks.{(per + 1) * i + j}.0."
            blocks[f"up_blocks.{i}.attentions.{j}."] = f"output_blocks.{(per + 1) * i + j}.1."
        attends = any(n.startswith(f"up_blocks.{i}.attentions.") for n in shapes)
        blocks[f"up_blocks.{i}.upsamplers.0."] = f"output_blocks.{(per + 1) * i + per}.{2 if attends else 1}."
    block_of = re.compile(r"((?:down|up)_blocks\.\d+\.(?:resnets|attentions|downsamplers|upsamplers)\.\d+\.(?:conv\.)?"
                          r"|mid_block\.(?:resnets|attentions)\.\d+\.)(.*)")

    def name_of(name: str) -> tuple[str, int] | None:
        if name in top:
            return top[name], 0
        m = block_of.fullmatch(name)
        if not m:
            return None
        prefix, rest = m.groups()
        if prefix not in blocks and prefix.endswith("conv."):
            prefix, rest = prefix[: -len("conv.")], "conv." + rest
        if prefix not in blocks:
            return None
        if ".resnets." in prefix:
            head, _, tail = rest.partition(".")
            rest = f"{_RESNET.get(head, head)}.{tail}"
        return blocks[prefix] + rest, 0

    return name_of


def _unet_forward(checkpoint: Tensors, config: Config, prefix: str,
                  shapes: Mapping[str, Shape]) -> Mapping[str, torch.Tensor]:
    converted: Mapping[str, torch.Tensor] = _sfu().convert_ldm_unet_checkpoint(checkpoint, dict(config))
    return converted


# ----------------------------------------------------------------------------- SD VAE (LDM)

_VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def _vae_namer(shapes: Mapping[str, Shape], config: Config) -> Callable[[str], tuple[str, int] | None]:
    top = _sfu().DIFFUSERS_TO_LDM_MAPPING["vae"]
    ups = len(config["up_block_types"])
    pattern = re.compile(r"(encoder|decoder)\.(?:(down|up)_blocks\.(\d+)\.(resnets\.(\d+)|downsamplers\.0|upsamplers\.0)"
                         r"|mid_block\.(resnets|attentions)\.(\d+))\.(.*)")

    def name_of(name: str) -> tuple[str, int] | None:
        if name in top:
            return top[name], 0
        m = pattern.fullmatch(name)
        if not m:
            return None
        side, way, index, _, resnet, mid, mid_index, rest = m.groups()
        rest = rest.replace("conv_shortcut", "nin_shortcut")
        if mid == "attentions":
            head, _, tail = rest.rpartition(".")
            return f"{side}.mid.attn_1.{_VAE_ATTENTION.get(head, head)}.{tail}", 0
        if mid == "resnets":
            return f"{side}.mid.block_{int(mid_index) + 1}.{rest}", 0
        block = int(index) if way == "down" else ups - 1 - int(index)
        if resnet is not None:
            return f"{side}.{way}.{block}.block.{resnet}.{rest}", 0
        return f"{side}.{way}.{block}.{'downsample' if way == 'down' else 'upsample'}.{rest}", 0

    return name_of


def _vae_reshape(name: str, shape: Shape) -> Shape:
    """LDM's VAE attention projections are 1×1 convolutions."""
    return (*shape, 1, 1) if ".mid.attn_1." in name and len(shape) == 2 else shape


def _vae_forward(checkpoint: Tensors, config: Config, prefix: str,
                 shapes: Mapping[str, Shape]) -> Mapping[str, torch.Tensor]:
    converted: Mapping[str, torch.Tensor] = _sfu().convert_ldm_vae_checkpoint(checkpoint, dict(config))
    return converted


# ----------------------------------------------------------------------------- CLIP text encoders


def _with_text_model(name: str) -> str:
    return name if name.startswith(("text_model.", "text_projection.")) else "text_model." + name


def _clip_namer(shapes: Mapping[str, Shape], config: Config) -> Callable[[str], tuple[str, int] | None]:
    return lambda name: (_with_text_model(name), 0)


def _flattened(converted: Mapping[str, torch.Tensor], shapes: Mapping[str, Shape]) -> Tensors:
    """As ``create_diffusers_clip_model_from_ldm`` does for a model without a ``text_model`` wrapper."""
    if any(name.startswith("text_model.") for name in shapes):
        return dict(converted)
    return {name.removeprefix("text_model."): t for name, t in converted.items()}


def _clip_forward(checkpoint: Tensors, config: Config, prefix: str,
                  shapes: Mapping[str, Shape]) -> Mapping[str, torch.Tensor]:
    return _flattened(_sfu().convert_ldm_clip_checkpoint(checkpoint, prefix), shapes)


_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}


def _openclip_namer(shapes: Mapping[str, Shape], config: Config) -> Callable[[str], tuple[str, int] | None]:
    tables = _sfu().DIFFUSERS_TO_LDM_MAPPING["openclip"]
    top, renames = tables["layers"], list(tables["transformer"].items())
    fused = re.compile(r"(.*)\.self_attn\.(q_proj|k_proj|v_proj)\.(weight|bias)")

    def name_of(name: str) -> tuple[str, int] | None:
        name = _with_text_model(name)
        if name in top:
            return top[name], 0
        if not name.startswith("text_model.encoder.layers."):
            return None
        place = 0
        m = fused.fullmatch(name)
        if m:
            name, place = f"{m.group(1)}.self_attn.in_proj_{m.group(3)}", _QKV[m.group(2)]
        for new, old in reversed(renames):
            name = name.replace(new, old)
        return "transformer." + name, place

    return name_of


def _openclip_reshape(name: str, shape: Shape) -> Shape:
    return tuple(reversed(shape)) if name == "text_projection" else shape


def _openclip_forward(checkpoint: Tensors, config: Config, prefix: str,
                      shapes: Mapping[str, Shape]) -> Mapping[str, torch.Tensor]:
    from types import SimpleNamespace

    hidden = next(s[1] for n, s in shapes.items() if n.endswith("token_embedding.weight"))
    text_model = SimpleNamespace(config=SimpleNamespace(hidden_size=hidden))
    return _flattened(_sfu().convert_open_clip_checkpoint(text_model, checkpoint, prefix=prefix), shapes)


# ----------------------------------------------------------------------------- SD3 (SAI) and Flux.1 (BFL)

_SD3_TOP: list[Rule] = [
    (r"pos_embed\.pos_embed", "pos_embed", 0), (r"pos_embed\.proj\.(.*)", r"x_embedder.proj.\1", 0),
    (r"time_text_embed\.timestep_embedder\.linear_1\.(.*)", r"t_embedder.mlp.0.\1", 0),
    (r"time_text_embed\.timestep_embedder\.linear_2\.(.*)", r"t_embedder.mlp.2.\1", 0),
    (r"time_text_embed\.text_embedder\.linear_1\.(.*)", r"y_embedder.mlp.0.\1", 0),
    (r"time_text_embed\.text_embedder\.linear_2\.(.*)", r"y_embedder.mlp.2.\1", 0),
    (r"context_embedder\.(.*)", r"context_embedder.\1", 0), (r"proj_out\.(.*)", r"final_layer.linear.\1", 0),
    (r"norm_out\.linear\.(.*)", r"final_layer.adaLN_modulation.1.\1", 0),
]
_B = r"transformer_blocks\.(\d+)\."
_SD3_BLOCK: list[Rule] = [
    *((_B + rf"attn\.to_{x}\.(.*)", r"joint_blocks.\1.x_block.attn.qkv.\2", i) for i, x in enumerate("qkv")),
    *((_B + rf"attn\.add_{x}_proj\.(.*)", r"joint_blocks.\1.context_block.attn.qkv.\2", i) for i, x in enumerate("qkv")),
    *((_B + rf"attn2\.to_{x}\.(.*)", r"joint_blocks.\1.x_block.attn2.qkv.\2", i) for i, x in enumerate("qkv")),
    (_B + r"attn\.norm_q\.(.*)", r"joint_blocks.\1.x_block.attn.ln_q.\2", 0),
    (_B + r"attn\.norm_k\.(.*)", r"joint_blocks.\1.x_block.attn.ln_k.\2", 0),
    (_B + r"attn\.norm_added_q\.(.*)", r"joint_blocks.\1.context_block.attn.ln_q.\2", 0),
    (_B + r"attn\.norm_added_k\.(.*)", r"joint_blocks.\1.context_block.attn.ln_k.\2", 0),
    (_B + r"attn2\.norm_q\.(.*)", r"joint_blocks.\1.x_block.attn2.ln_q.\2", 0),
    (_B + r"attn2\.norm_k\.(.*)", r"joint_blocks.\1.x_block.attn2.ln_k.\2", 0),
    (_B + r"attn\.to_out\.0\.(.*)", r"joint_blocks.\1.x_block.attn.proj.\2", 0),
    (_B + r"attn\.to_add_out\.(.*)", r"joint_blocks.\1.context_block.attn.proj.\2", 0),
    (_B + r"attn2\.to_out\.0\.(.*)", r"joint_blocks.\1.x_block.attn2.proj.\2", 0),
    (_B + r"norm1\.linear\.(.*)", r"joint_blocks.\1.x_block.adaLN_modulation.1.\2", 0),
    (_B + r"norm1_context\.linear\.(.*)", r"joint_blocks.\1.context_block.adaLN_modulation.1.\2", 0),
    (_B + r"ff\.net\.0\.proj\.(.*)", r"joint_blocks.\1.x_block.mlp.fc1.\2", 0),
    (_B + r"ff\.net\.2\.(.*)", r"joint_blocks.\1.x_block.mlp.fc2.\2", 0),
    (_B + r"ff_context\.net\.0\.proj\.(.*)", r"joint_blocks.\1.context_block.mlp.fc1.\2", 0),
    (_B + r"ff_context\.net\.2\.(.*)", r"joint_blocks.\1.context_block.mlp.fc2.\2", 0),
]


def _sd3_forward(checkpoint: Tensors, config: Config, prefix: str,
                 shapes: Mapping[str, Shape]) -> Mapping[str, torch.Tensor]:
    converted: Mapping[str, torch.Tensor] = _sfu().convert_sd3_transformer_checkpoint_to_diffusers(checkpoint)
    return converted


_FLUX_TOP: list[Rule] = [
    *((rf"time_text_embed\.{d}_embedder\.linear_1\.(.*)", rf"{o}_in.in_layer.\1", 0)
      for d, o in (("timestep", "time"), ("text", "vector"), ("guidance", "guidance"))),
    *((rf"time_text_embed\.{d}_embedder\.linear_2\.(.*)", rf"{o}_in.out_layer.\1", 0)
      for d, o in (("timestep", "time"), ("text", "vector"), ("guidance", "guidance"))),
    (r"context_embedder\.(.*)", r"txt_in.\1", 0), (r"x_embedder\.(.*)", r"img_in.\1", 0),
    (r"proj_out\.(.*)", r"final_layer.linear.\1", 0), (r"norm_out\.linear\.(.*)", r"final_layer.adaLN_modulation.1.\1", 0),
]
_S = r"single_transformer_blocks\.(\d+)\."
_FLUX_BLOCKS: list[Rule] = [
    (_B + r"norm1\.linear\.(.*)", r"double_blocks.\1.img_mod.lin.\2", 0),
    (_B + r"norm1_context\.linear\.(.*)", r"double_blocks.\1.txt_mod.lin.\2", 0),
    *((_B + rf"attn\.to_{x}\.(.*)", r"double_blocks.\1.img_attn.qkv.\2", i) for i, x in enumerate("qkv")),
    *((_B + rf"attn\.add_{x}_proj\.(.*)", r"double_blocks.\1.txt_attn.qkv.\2", i) for i, x in enumerate("qkv")),
    (_B + r"attn\.norm_q\.weight", r"double_blocks.\1.img_attn.norm.query_norm.scale", 0),
    (_B + r"attn\.norm_k\.weight", r"double_blocks.\1.img_attn.norm.key_norm.scale", 0),
    (_B + r"attn\.norm_added_q\.weight", r"double_blocks.\1.txt_attn.norm.query_norm.scale", 0),
    (_B + r"attn\.norm_added_k\.weight", r"double_blocks.\1.txt_attn.norm.key_norm.scale", 0),
    (_B + r"ff\.net\.0\.proj\.(.*)", r"double_blocks.\1.img_mlp.0.\2", 0),
    (_B + r"ff\.net\.2\.(.*)", r"double_blocks.\1.img_mlp.2.\2", 0),
    (_B + r"ff_context\.net\.0\.proj\.(.*)", r"double_blocks.\1.txt_mlp.0.\2", 0),
    (_B + r"ff_context\.net\.2\.(.*)", r"double_blocks.\1.txt_mlp.2.\2", 0),
    (_B + r"attn\.to_out\.0\.(.*)", r"double_blocks.\1.img_attn.proj.\2", 0),
    (_B + r"attn\.to_add_out\.(.*)", r"double_blocks.\1.txt_attn.proj.\2", 0),
    (_S + r"norm\.linear\.(.*)", r"single_blocks.\1.modulation.lin.\2", 0),
    *((_S + rf"attn\.to_{x}\.(.*)", r"single_blocks.\1.linear1.\2", i) for i, x in enumerate("qkv")),
    (_S + r"proj_mlp\.(.*)", r"single_blocks.\1.linear1.\2", 3),
    (_S + r"attn\.norm_q\.weight", r"single_blocks.\1.norm.query_norm.scale", 0),
    (_S + r"attn\.norm_k\.weight", r"single_blocks.\1.norm.key_norm.scale", 0),
    (_S + r"proj_out\.(.*)", r"single_blocks.\1.linear2.\2", 0),
]


def _flux_forward(checkpoint: Tensors, config: Config, prefix: str,
                  shapes: Mapping[str, Shape]) -> Mapping[str, torch.Tensor]:
    converted: Mapping[str, torch.Tensor] = _sfu().convert_flux_transformer_checkpoint_to_diffusers(checkpoint)
    return converted


LAYOUTS: dict[str, Layout] = {
    "unet": Layout("unet", _unet_namer, _unet_forward),
    "vae": Layout("vae", _vae_namer, _vae_forward, _vae_reshape),
    "clip": Layout("clip", _clip_namer, _clip_forward),
    "openclip": Layout("openclip", _openclip_namer, _openclip_forward, _openclip_reshape),
    "sd3": Layout("sd3", _by_rules(_SD3_TOP + _SD3_BLOCK), _sd3_forward),
    "flux": Layout("flux", _by_rules(_FLUX_TOP + _FLUX_BLOCKS), _flux_forward),
}
