"""fp8 with scales as a strategy of the registry: how ``--quantize fp8-block/fp8-channel/fp8-tensor`` names, shapes
and computes its tensors, and how fp8 checkpoints are read back.

Each recipe (:class:`Fp8Recipe`) is the inverse of :func:`shardkit.layouts.fp8.find_layout` for one
scheme: which weights it quantizes, the scale written beside each one (name, shape, dtype) and the
``quantization_config`` loaders read; as a :class:`~shardkit.layouts.quant.QuantStrategy` it quantizes
band by band and dequantizes every fp8 layout :func:`find_layout` recognises. The arithmetic is
:mod:`shardkit.layouts.fp8_math`; the stages that use it are
:class:`shardkit.sources.quantized.QuantizedSource`, :class:`shardkit.sources.dequantized.DequantizedSource`
and :mod:`shardkit.runtime.scaled_fp`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..formats.header import TensorEntry
from ..formats.json_types import JsonObject
from ..units import tensor_nbytes
from .fp4 import Fp4Layout
from .fp8 import (
    COMPRESSED,
    DEFAULT_BLOCK,
    FINEGRAINED,
    QUANTIZE_SCHEMES,
    QuantLayout,
    ScaledWeight,
    find_layout,
    matrix_shape,
    should_skip_quantize,
)
from .quant import BandBytes, QuantTarget, TensorReader, band_bytes, dequantized_mapped, quantized_mapped
from .table import Mapped

if TYPE_CHECKING:
    import torch

    from .fp8_math import Fp8Dequantizer

__all__ = ["QUANTIZE_RECIPES", "Fp8Recipe"]




def _finegrained_config(ignored: list[str], granularity: str) -> dict[str, Any]:
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(DEFAULT_BLOCK),
            "modules_to_not_convert": ignored}


def _compressed_config(ignored: list[str], granularity: str) -> dict[str, Any]:
    weights = {"num_bits": 8, "type": "float", "strategy": granularity, "symmetric": True, "dynamic": False,
               "group_size": None, "block_structure": None, "observer": "minmax"}
    group = {"targets": ["Linear"], "weights": weights, "input_activations": None, "output_activations": None,
             "format": "float-quantized"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": ignored, "kv_cache_scheme": None}


@dataclass(frozen=True)
class Fp8Recipe:
    """How ``--quantize`` writes one fp8 scheme in a layout that loaders read (the inverse of :func:`find_layout`).

    Attributes:
        scheme: ``"fp8-block"``, ``"fp8-channel"`` or ``"fp8-tensor"``.
        granularity: ``"block"`` (128×128, transformers FineGrainedFP8), ``"channel"`` or ``"tensor"``
            (compressed-tensors ``float-quantized``).
        scale_suffix: the scale's name after the module's: ``X.weight_scale_inv`` / ``X.weight_scale``.
        config: ``(kept modules, granularity) → quantization_config``.
        scale_like_weight: scales in the weight's bf16/fp16 (what compressed-tensors loads them as), else float32.
    """

    scheme: str
    granularity: str
    scale_suffix: str
    config: Callable[[list[str], str], dict[str, Any]]
    scale_like_weight: bool

    def quantizes(self, entry: TensorEntry) -> bool:
        """Whether ``entry`` is quantized: a ≥2-D float ``.weight`` not kept by :func:`should_skip_quantize`; for
        blocks, whole 128×128 blocks only (transformers' loader derives the block from the scale grid)."""
        if should_skip_quantize(entry):
            return False
        rows, cols = matrix_shape(entry.shape)
        return self.granularity != "block" or (rows % DEFAULT_BLOCK[0] == 0 and cols % DEFAULT_BLOCK[1] == 0)

    def target(self, entry: TensorEntry) -> QuantTarget | None:
        """``entry`` quantized: the fp8 weight's and the scale's entries; None when kept.

        >>> t = QUANTIZE_RECIPES["fp8-block"].target(TensorEntry("l.weight", "BF16", (256, 128), 65536))
        >>> [(e.name, e.dtype, e.shape) for e in t.written]
        [('l.weight', 'F8_E4M3', (256, 128)), ('l.weight_scale_inv', 'F32', (2, 1))]
        """
        if not self.quantizes(entry):
            return None
        rows, cols = matrix_shape(entry.shape)
        scale_name = entry.name[: -len(".weight")] + self.scale_suffix
        shape = {"block": (rows // DEFAULT_BLOCK[0], cols // DEFAULT_BLOCK[1]), "channel": (rows, 1),
                 "tensor": (1,)}[self.granularity]
        scale_dtype = entry.dtype if self.scale_like_weight and entry.dtype in ("BF16", "F16") else "F32"
        return QuantTarget(entry, (TensorEntry(entry.name, "F8_E4M3", entry.shape, tensor_nbytes("F8_E4M3", entry.shape)),
                                   TensorEntry(scale_name, scale_dtype, shape, tensor_nbytes(scale_dtype, shape))))

    def scaled(self, target: QuantTarget) -> ScaledWeight:
        """The :class:`ScaledWeight` ``target`` is written as (its scale's name, granularity and block)."""
        rows, cols = matrix_shape(target.source.shape)
        block = {"block": DEFAULT_BLOCK, "channel": (1, cols), "tensor": (rows, cols)}[self.granularity]
        return ScaledWeight(target.source.name, target.written[1].name, self.granularity, block)

    def sample(self) -> Mapped:
        """A small bf16 model: linear weights (some quantized, an odd-sized one kept for blocks), norms, embeddings."""
        return Mapped(tuple(TensorEntry(n, "BF16", s, tensor_nbytes("BF16", s)) for n, s in _SAMPLE))

    def forward(self, plain: Mapped) -> Mapped:
        """Every weight this recipe quantizes as fp8 + scale, the rest as it is, and the ``quantization_config``."""
        return quantized_mapped(self, plain)

    def inverse(self, stored: Mapped) -> Mapped:
        """What dequantizing to bf16 gives: each scaled weight in bf16, its scale gone (as ``convert --dtype bf16``)."""
        layout = find_layout(stored.entries, config=stored.config, where=self.scheme)
        if layout is None:
            return stored
        return dequantized_mapped(stored, self.dequantizer(layout, stored.entries), layout.extra)

    kept_to_bf16 = True  # fp8 output smaller than a bf16 copy: fp32 norms and embeddings go to bf16
    applies_to = None  # a model with nothing to quantize is written as it is

    def quantization_config(self, kept: Sequence[str]) -> JsonObject:
        return self.config(sorted(kept), self.granularity)

    def dequantizer(self, layout: QuantLayout | Fp4Layout, entries: Sequence[TensorEntry]) -> Fp8Dequantizer | None:
        """Every fp8 layout's dense weights (any recipe reads them all: the scale's shape gives its granularity)."""
        from .fp8_math import Fp8Dequantizer

        return Fp8Dequantizer(layout, entries) if isinstance(layout, QuantLayout) else None

    def prepare(self, reader: TensorReader, target: QuantTarget) -> torch.Tensor | None:
        """Per-tensor scales: the weight's absmax (float32), one pass of bands first."""
        if self.granularity != "tensor":
            return None
        import torch

        found = torch.zeros((), dtype=torch.float32)
        for band in self.source_bands(reader, target):
            found = torch.maximum(found, band.abs().amax())
        return found

    def source_bands(self, reader: TensorReader, target: QuantTarget) -> Iterator[torch.Tensor]:
        """Bands of rows in float32, a whole number of scale blocks each (one block at least, however wide)."""
        import torch

        from .fp8_math import band_rows

        rows, cols = matrix_shape(target.source.shape)
        step = band_rows(self.scaled(target), cols, whole_blocks=True)
        for row0 in range(0, rows, step):
            yield reader.rows(target.source.name, row0, min(rows, row0 + step)).to(torch.float32)

    def quantize_band(self, band: torch.Tensor, target: QuantTarget,
                      prepared: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        from ..formats.dtypes import to_torch
        from .fp8_math import quantize_band

        return quantize_band(band, self.granularity, block=self.scaled(target).block, absmax=prepared,
                             scale_dtype=to_torch(target.written[1].dtype))

    def dequantize_band(self, q: torch.Tensor, scale: torch.Tensor, target: QuantTarget,
                        prepared: torch.Tensor | None) -> torch.Tensor:
        import torch

        from .fp8_math import dequantize_band

        return dequantize_band(q, scale, self.scaled(target), 0, torch.float32)

    def side_bytes(self, target: QuantTarget, scales: Sequence[torch.Tensor],
                   prepared: torch.Tensor | None) -> tuple[BandBytes, ...]:
        """The scale: every band's, one after another (per tensor: the first, which every band shares)."""
        import torch

        return (band_bytes(scales[0] if self.granularity == "tensor" else torch.cat(list(scales))),)


QUANTIZE_RECIPES: dict[str, Fp8Recipe] = {
    "fp8-block": Fp8Recipe("fp8-block", "block", FINEGRAINED.scale_suffix, _finegrained_config, False),
    "fp8-channel": Fp8Recipe("fp8-channel", "channel", COMPRESSED.scale_suffix, _compressed_config, True),
    "fp8-tensor": Fp8Recipe("fp8-tensor", "tensor", COMPRESSED.scale_suffix, _compressed_config, True),
}
assert tuple(QUANTIZE_RECIPES) == QUANTIZE_SCHEMES
_SAMPLE: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("model.embed_tokens.weight", (64, 128)), ("model.layers.0.input_layernorm.weight", (128,)),
    ("model.layers.0.self_attn.q_proj.weight", (256, 128)), ("model.layers.0.self_attn.q_proj.bias", (256,)),
    ("model.layers.0.mlp.up_proj.weight", (128, 256)), ("model.layers.0.mlp.down_proj.weight", (96, 128)),
    ("model.norm.weight", (128,)), ("lm_head.weight", (64, 128)),
)
