"""fp4 as a strategy of the registry: how ``--quantize nvfp4/mxfp4`` names, shapes and computes its tensors, the
config it writes, and how fp4 checkpoints are read back.

:func:`fp4_target` is the inverse of :func:`shardkit.layouts.fp4.find_fp4_layout` for the two schemes
shardkit writes (compressed-tensors NVFP4, gpt-oss MXFP4); :class:`Fp4Scheme` is the
:class:`~shardkit.layouts.quant.QuantStrategy` over it. The arithmetic is :mod:`shardkit.layouts.fp4_math`.
NVFP4 bands are rows as stored; MXFP4 bands are rows of one expert at a time, as (out, in) rows. The global scale of
an NVFP4 weight needs its absmax first: one extra read of that weight.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..formats.header import TensorEntry
from ..formats.json_types import JsonObject
from ..units import tensor_nbytes
from .fp4 import E4M3, MXFP4, Fp4Layout, find_fp4_layout
from .fp8 import QuantLayout, should_skip_quantize
from .quant import BandBytes, QuantTarget, TensorReader, band_bytes, dequantized_mapped, quantized_mapped
from .table import Mapped

if TYPE_CHECKING:
    import torch

    from .fp4_math import Fp4Dequantizer

__all__ = ["EXPERTS", "FP4_SCHEMES", "NVFP4A16_CONFIG", "Fp4Scheme", "fp4_config", "fp4_target"]


FP4_SCHEMES = ("nvfp4", "mxfp4")
EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")
NVFP4A16_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "format": "nvfp4-pack-quantized", "input_activations": None,
                                  "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16,
                                              "strategy": "tensor_group", "dynamic": False, "observer": "minmax",
                                              "scale_dtype": "torch.float8_e4m3fn"}}},
    "kv_cache_scheme": None,
}


def fp4_target(entry: TensorEntry, scheme: str) -> QuantTarget | None:
    """What ``scheme`` writes for ``entry``, or None when it is kept as it is (the inverse of :func:`find_fp4_layout`).

    - ``nvfp4``: a 2-D float ``X.weight`` that :func:`~shardkit.layouts.fp8.should_skip_quantize` does not keep,
      input dimension a multiple of 16 → compressed-tensors ``X.weight_packed`` U8 (out, in/2),
      ``X.weight_scale`` e4m3 (out, in/16), ``X.weight_global_scale`` F32 ``[1]``;
    - ``mxfp4``: a gpt-oss-style expert tensor ``….experts.gate_up_proj``/``down_proj``, dense (E, in, out),
      in a multiple of 32 → ``X_blocks`` U8 (E, out, in/32, 16) and ``X_scales`` U8 (E, out, in/32).

    >>> [(e.name, e.shape) for e in fp4_target(TensorEntry("l.weight", "BF16", (4, 32), 256), "nvfp4").written]
    [('l.weight_packed', (4, 16)), ('l.weight_scale', (4, 2)), ('l.weight_global_scale', (1,))]
    """
    if scheme == "nvfp4":
        if should_skip_quantize(entry) or entry.shape[1] % 16:
            return None
        rows, cols = entry.shape
        base = entry.name[: -len("weight")]
        packed, scale, global_scale = base + "weight_packed", base + "weight_scale", base + "weight_global_scale"
        return QuantTarget(entry, (
            TensorEntry(packed, "U8", (rows, cols // 2), tensor_nbytes("U8", (rows, cols // 2))),
            TensorEntry(scale, E4M3, (rows, cols // 16), tensor_nbytes(E4M3, (rows, cols // 16))),
            TensorEntry(global_scale, "F32", (1,), 4)))
    if not EXPERTS.search(entry.name) or len(entry.shape) != 3 or entry.shape[1] % 32 or \
            entry.dtype not in ("F32", "F16", "BF16"):
        return None
    experts, cols, rows = entry.shape  # dense (E, in, out)
    blocks, scales = (experts, rows, cols // 32, 16), (experts, rows, cols // 32)
    return QuantTarget(entry, (
        TensorEntry(entry.name + "_blocks", "U8", blocks, tensor_nbytes("U8", blocks)),
        TensorEntry(entry.name + "_scales", "U8", scales, tensor_nbytes("U8", scales))))


def fp4_config(scheme: str, kept: Sequence[str]) -> dict[str, Any]:
    """The ``quantization_config`` ``scheme`` writes, ``kept`` naming the modules left as they were: NVFP4A16
    (compressed-tensors, as vLLM and transformers read it) or gpt-oss's ``{"quant_method": "mxfp4"}``."""
    if scheme == "nvfp4":
        return {**NVFP4A16_CONFIG, "ignore": sorted(kept)}
    return {"quant_method": "mxfp4", "modules_to_not_convert": sorted({re.sub(r"\.\d+\.", ".*.", m) for m in kept})}


@dataclass(frozen=True)
class Fp4Scheme:
    """``--quantize nvfp4`` or ``mxfp4`` as a layout of the registry (:class:`~shardkit.layouts.table.LayoutStrategy`)."""

    scheme: str

    def sample(self) -> Mapped:
        """A small bf16 MoE model: attention and dense MLP weights (NVFP4), experts (MXFP4), norms, embeddings."""
        return Mapped(tuple(TensorEntry(n, "BF16", s, tensor_nbytes("BF16", s)) for n, s in _SAMPLE))

    def forward(self, plain: Mapped) -> Mapped:
        """Each weight the scheme quantizes as its packed tensors, the rest as it is, and the ``quantization_config``."""
        return quantized_mapped(self, plain)

    def inverse(self, stored: Mapped) -> Mapped:
        """What dequantizing to bf16 gives: each packed weight as its dense bf16 tensor, its scales gone."""
        layout = find_fp4_layout(stored.entries, config=stored.config, where=self.scheme)
        if layout is None:
            return stored
        return dequantized_mapped(stored, self.dequantizer(layout, stored.entries), layout.extra)

    kept_to_bf16 = False  # the tensors kept stay as stored

    @property
    def applies_to(self) -> str:
        """What the scheme quantizes: finding nothing is refused (the output would not be fp4)."""
        if self.scheme == "mxfp4":
            return "gpt-oss-style MoE experts (….experts.gate_up_proj / down_proj, 3-D, input dimension a multiple of 32)"
        return "2-D linear weights (input dimension a multiple of 16)"

    def target(self, entry: TensorEntry) -> QuantTarget | None:
        return fp4_target(entry, self.scheme)

    def quantization_config(self, kept: Sequence[str]) -> JsonObject:
        return fp4_config(self.scheme, kept)

    def dequantizer(self, layout: QuantLayout | Fp4Layout, entries: Sequence[TensorEntry]) -> Fp4Dequantizer | None:
        """The dense weights of an fp4 layout this scheme reads (MXFP4; NVFP4: ModelOpt's and compressed-tensors')."""
        from .fp4_math import Fp4Dequantizer

        if not isinstance(layout, Fp4Layout) or (layout.scheme == MXFP4) != (self.scheme == "mxfp4"):
            return None
        return Fp4Dequantizer(layout)

    def prepare(self, reader: TensorReader, target: QuantTarget) -> torch.Tensor | None:
        """NVFP4: compressed-tensors' global scale of the weight (from its absmax, in its stored dtype)."""
        if self.scheme != "nvfp4":
            return None
        import torch

        from .fp4_math import nvfp4_global_scale

        absmax = None
        for band in self.source_bands(reader, target):
            top = torch.max(band.amin().clamp(max=0).abs(), band.amax().clamp(min=0))
            absmax = top if absmax is None else torch.max(absmax, top)
        return nvfp4_global_scale(absmax if absmax is not None else torch.zeros(()))

    def source_bands(self, reader: TensorReader, target: QuantTarget) -> Iterator[torch.Tensor]:
        """Bands of about :data:`~shardkit.layouts.fp4_math.BAND_BYTES` of float32 (one row at least), in the stored
        dtype. NVFP4: rows as stored; MXFP4: one expert at a time, as (out, in) rows, a band of its rows at a time
        (blocks run along a row, so a band quantizes to the very bytes of the whole expert).

        An MXFP4 expert is read whole as stored (``reader.rows`` reads rows of (E, in × out), and each output row
        is a column of the stored expert), then cut into bands.
        """
        from .fp4_math import BAND_BYTES

        name, cols = target.source.name, target.source.shape[1]  # NVFP4 (out, in); MXFP4 (E, in, out)
        step = max(1, BAND_BYTES // (cols * 4))
        if self.scheme == "mxfp4":
            experts, _, rows = target.source.shape
            for expert in range(experts):
                stored = reader.rows(name, expert, expert + 1).reshape(cols, rows)
                for row0 in range(0, rows, step):
                    yield stored[:, row0:row0 + step].transpose(0, 1).contiguous()
            return
        rows = target.source.shape[0]
        for row0 in range(0, rows, step):
            yield reader.rows(name, row0, min(rows, row0 + step))

    def quantize_band(self, band: torch.Tensor, target: QuantTarget,
                      prepared: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        from .fp4_math import quantize_mxfp4, quantize_nvfp4

        return quantize_nvfp4(band, prepared) if prepared is not None else quantize_mxfp4(band)

    def dequantize_band(self, q: torch.Tensor, scale: torch.Tensor, target: QuantTarget,
                        prepared: torch.Tensor | None) -> torch.Tensor:
        import torch

        from .fp4_math import dequantize_mxfp4, dequantize_nvfp4

        if prepared is not None:
            return dequantize_nvfp4(q, scale, prepared, modelopt=False, out_dtype=torch.float32)
        return dequantize_mxfp4(q, scale, torch.float32)

    def side_bytes(self, target: QuantTarget, scales: Sequence[torch.Tensor],
                   prepared: torch.Tensor | None) -> tuple[BandBytes, ...]:
        """The block scales, every band's one after another; NVFP4: then the global scale."""
        joined = b"".join(bytes(band_bytes(s)) for s in scales)
        return (joined,) if prepared is None else (joined, band_bytes(prepared))


_SAMPLE: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("model.embed_tokens.weight", (64, 32)), ("model.layers.0.input_layernorm.weight", (32,)),
    ("model.layers.0.self_attn.q_proj.weight", (64, 32)), ("model.layers.0.self_attn.q_proj.bias", (64,)),
    ("model.layers.0.self_attn.o_proj.weight", (32, 48)),
    ("model.layers.0.mlp.experts.gate_up_proj", (4, 32, 128)), ("model.layers.0.mlp.experts.down_proj", (4, 64, 32)),
    ("model.norm.weight", (32,)), ("lm_head.weight", (64, 32)),
)
