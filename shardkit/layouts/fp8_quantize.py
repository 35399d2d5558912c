"""fp8 with scales, the writing side: how ``--quantize fp8-block/fp8-channel/fp8-tensor`` names and shapes its tensors.

Each recipe (:class:`Fp8Recipe`) is the inverse of :func:`shardkit.layouts.fp8.find_layout` for one
scheme: which weights it quantizes, the scale written beside each one (name, shape, dtype) and the
``quantization_config`` loaders read. The arithmetic is :mod:`shardkit.layouts.fp8_math`; the view that
computes the bytes is :class:`shardkit.sources.quantized.QuantizedSource`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..formats.header import TensorEntry
from ..units import tensor_nbytes
from .fp8 import (
    COMPRESSED,
    DEFAULT_BLOCK,
    FINEGRAINED,
    QUANTIZE_SCHEMES,
    ScaledWeight,
    find_layout,
    matrix_shape,
    should_skip_quantize,
)
from .table import Mapped

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

    def target(self, entry: TensorEntry) -> tuple[ScaledWeight, TensorEntry, TensorEntry] | None:
        """``entry`` quantized: its :class:`ScaledWeight`, the fp8 weight's and the scale's entries; None when kept.

        >>> w, q, s = QUANTIZE_RECIPES["fp8-block"].target(TensorEntry("l.weight", "BF16", (256, 128), 65536))
        >>> q.dtype, s.name, s.shape, w.granularity
        ('F8_E4M3', 'l.weight_scale_inv', (2, 1), 'block')
        """
        if not self.quantizes(entry):
            return None
        rows, cols = matrix_shape(entry.shape)
        block = {"block": DEFAULT_BLOCK, "channel": (1, cols), "tensor": (rows, cols)}[self.granularity]
        scale_name = entry.name[: -len(".weight")] + self.scale_suffix
        shape = {"block": (rows // block[0], cols // block[1]), "channel": (rows, 1), "tensor": (1,)}[self.granularity]
        scale_dtype = entry.dtype if self.scale_like_weight and entry.dtype in ("BF16", "F16") else "F32"
        return (ScaledWeight(entry.name, scale_name, self.granularity, block),
                TensorEntry(entry.name, "F8_E4M3", entry.shape, tensor_nbytes("F8_E4M3", entry.shape)),
                TensorEntry(scale_name, scale_dtype, shape, tensor_nbytes(scale_dtype, shape)))

    def sample(self) -> Mapped:
        """A small bf16 model: linear weights (some quantized, an odd-sized one kept for blocks), norms, embeddings."""
        return Mapped(tuple(TensorEntry(n, "BF16", s, tensor_nbytes("BF16", s)) for n, s in _SAMPLE))

    def forward(self, plain: Mapped) -> Mapped:
        """Every weight this recipe quantizes as fp8 + scale, the rest as it is, and the ``quantization_config``."""
        entries: list[TensorEntry] = []
        kept: list[str] = []
        for entry in plain.entries:
            target = self.target(entry)
            if target is None:
                entries.append(entry)
                if entry.name.endswith(".weight") and len(entry.shape) >= 2:
                    kept.append(entry.name[: -len(".weight")])
            else:
                entries += target[1:]
        return Mapped(tuple(entries), {**plain.config, "quantization_config": self.config(sorted(kept),
                                                                                          self.granularity)})

    def inverse(self, stored: Mapped) -> Mapped:
        """What dequantizing to bf16 gives: each scaled weight in bf16, its scale gone (as ``convert --dtype bf16``)."""
        layout = find_layout(stored.entries, config=stored.config, where=self.scheme)
        if layout is None:
            return stored
        scaled = {w.weight for w in layout.weights}
        return Mapped(tuple(TensorEntry(e.name, "BF16", e.shape, tensor_nbytes("BF16", e.shape)) if e.name in scaled
                            else e for e in stored.entries if e.name not in layout.extra),
                      {k: v for k, v in stored.config.items() if k != "quantization_config"})


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
