"""Where a diffusers-named LoRA target lies in an original (BFL) Flux file: its rows in a fused tensor.

A diffusion LoRA is read in diffusers' names (:mod:`shardkit.sharding.lora_diffusers`):
``transformer_blocks.0.attn.to_q`` and so on. An original Flux.1 checkpoint (``flux1-dev.safetensors``,
BFL's names, ``model.diffusion_model.`` in ComfyUI's files) fuses several of those into one tensor
(q, k and v in ``img_attn.qkv``; q, k, v and the MLP's input in ``single_blocks.N.linear1``) and swaps
the halves of ``final_layer.adaLN_modulation.1``. Which rows of which original tensor each diffusers
tensor is, is learnt by running diffusers' own single-file conversion forward on the file's shapes
(:func:`~shardkit.layouts.single_file_trace.trace_conversion`, meta tensors: no memory), so a LoRA
merged here changes exactly the rows ``from_single_file`` would load into that diffusers module.
diffusers' conversion is written for Flux.1's width (3072); a file of another width is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import InvalidInputError, Option
from ..formats.header import TensorEntry
from ..layouts.single_file import LAYOUTS, Tensors
from ..layouts.single_file_trace import contiguous_strides, trace_conversion

if TYPE_CHECKING:
    import torch

__all__ = ["FLUX_WIDTH", "Placement", "is_original_flux", "original_placements"]

FLUX_WIDTH = 3072  # diffusers' convert_flux_transformer_checkpoint_to_diffusers hard-codes it
_COMFY = "model.diffusion_model."


@dataclass(frozen=True)
class Placement:
    """Rows ``start:start + rows`` of a diffusers tensor are rows ``row0:row0 + rows`` of original tensor ``name``."""

    name: str
    row0: int
    start: int
    rows: int


def is_original_flux(names: Sequence[str]) -> bool:
    """Whether tensor names are an original (BFL) Flux transformer's.

    >>> is_original_flux(["double_blocks.0.img_attn.qkv.weight"]), is_original_flux(["transformer_blocks.0.x"])
    (True, False)
    """
    return any(n.removeprefix(_COMFY).startswith("double_blocks.") for n in names)


def original_placements(base: Sequence[TensorEntry], *, where: str) -> dict[str, tuple[Placement, ...]]:
    """Diffusers tensor name → the original rows it is, for every tensor diffusers' conversion places by rows.

    Raises:
        InvalidInputError: a width other than Flux.1's, or a file diffusers' conversion does not read.
    """
    shapes = {e.name: tuple(e.shape) for e in base}
    width = next((s[0] for n, s in shapes.items() if n.removeprefix(_COMFY) == "img_in.weight"), None)
    if width != FLUX_WIDTH:
        raise InvalidInputError(f"{where}: an original-layout (BFL) Flux file of width {width}; diffusers maps those "
                                f"at Flux.1's width {FLUX_WIDTH} only, so a diffusers-named LoRA cannot be placed in it: "
                                "convert it with ", Option("to", "diffusers"), " first and merge into that folder")

    def convert(checkpoint: Tensors) -> Mapping[str, torch.Tensor]:
        return LAYOUTS["flux"].forward(checkpoint, {}, "", shapes)  # diffusers' own mapping

    placed: dict[str, list[Placement]] = {}
    for original in trace_conversion(convert, shapes, where=where).values():
        cols = 1 if len(original.shape) < 2 else original.shape[1]
        for piece in original.pieces:
            rows_only = len(original.shape) <= 2 and piece.dim == 0 and piece.offset % cols == 0 and \
                piece.strides == contiguous_strides(piece.shape)
            if rows_only:
                placed.setdefault(piece.target, []).append(Placement(original.name, piece.offset // cols, piece.start,
                                                                     piece.length))
    return {name: tuple(p) for name, p in placed.items()}
