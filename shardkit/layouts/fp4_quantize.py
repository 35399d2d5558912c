"""fp4, the writing side: how ``--quantize nvfp4/mxfp4`` names and shapes its tensors, and the config it writes.

:func:`fp4_target` is the inverse of :func:`shardkit.layouts.fp4.find_fp4_layout` for the two schemes
shardkit writes (compressed-tensors NVFP4, gpt-oss MXFP4); the arithmetic is
:mod:`shardkit.layouts.fp4_math`, and the view that computes the bytes is
:class:`shardkit.sources.quantized_fp4.Fp4QuantizedSource`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..formats.header import TensorEntry
from ..units import tensor_nbytes
from .fp4 import E4M3, find_fp4_layout
from .fp8 import should_skip_quantize
from .table import Mapped

__all__ = ["EXPERTS", "FP4_SCHEMES", "NVFP4A16_CONFIG", "Fp4Scheme", "Fp4Target", "fp4_config", "fp4_target"]


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


@dataclass(frozen=True)
class Fp4Target:
    """One weight ``--quantize nvfp4/mxfp4`` quantizes: its source entry and the names written for it.

    Attributes:
        source: the dense weight.
        packed, scale, global_scale: the names written (``global_scale`` None for MXFP4).
        written: the entries written for it (packed, scale, and global scale), in order.
    """

    source: TensorEntry
    packed: str
    scale: str
    global_scale: str | None
    written: tuple[TensorEntry, ...]


def fp4_target(entry: TensorEntry, scheme: str) -> Fp4Target | None:
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
        return Fp4Target(entry, packed, scale, global_scale, (
            TensorEntry(packed, "U8", (rows, cols // 2), tensor_nbytes("U8", (rows, cols // 2))),
            TensorEntry(scale, E4M3, (rows, cols // 16), tensor_nbytes(E4M3, (rows, cols // 16))),
            TensorEntry(global_scale, "F32", (1,), 4)))
    if not EXPERTS.search(entry.name) or len(entry.shape) != 3 or entry.shape[1] % 32 or \
            entry.dtype not in ("F32", "F16", "BF16"):
        return None
    experts, cols, rows = entry.shape  # dense (E, in, out)
    blocks, scales = (experts, rows, cols // 32, 16), (experts, rows, cols // 32)
    return Fp4Target(entry, entry.name + "_blocks", entry.name + "_scales", None, (
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
        entries: list[TensorEntry] = []
        kept: list[str] = []
        for entry in plain.entries:
            target = fp4_target(entry, self.scheme)
            if target is None:
                entries.append(entry)
                if entry.name.endswith(".weight") and len(entry.shape) >= 2:
                    kept.append(entry.name[: -len(".weight")])
            else:
                entries += target.written
        return Mapped(tuple(entries), {**plain.config, "quantization_config": fp4_config(self.scheme, kept)})

    def inverse(self, stored: Mapped) -> Mapped:
        """What dequantizing to bf16 gives: each packed weight as its dense bf16 tensor, its scales gone."""
        layout = find_fp4_layout(stored.entries, config=stored.config, where=self.scheme)
        if layout is None:
            return stored
        dense = {w.packed: w for w in layout.weights}
        out = []
        for e in stored.entries:
            if e.name in dense:
                w = dense[e.name]
                out.append(TensorEntry(w.output, "BF16", w.shape, tensor_nbytes("BF16", w.shape)))
            elif e.name not in layout.extra:
                out.append(e)
        return Mapped(tuple(out), {k: v for k, v in stored.config.items() if k != "quantization_config"})


_SAMPLE: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("model.embed_tokens.weight", (64, 32)), ("model.layers.0.input_layernorm.weight", (32,)),
    ("model.layers.0.self_attn.q_proj.weight", (64, 32)), ("model.layers.0.self_attn.q_proj.bias", (64,)),
    ("model.layers.0.self_attn.o_proj.weight", (32, 48)),
    ("model.layers.0.mlp.experts.gate_up_proj", (4, 32, 128)), ("model.layers.0.mlp.experts.down_proj", (4, 64, 32)),
    ("model.norm.weight", (32,)), ("lm_head.weight", (64, 32)),
)
