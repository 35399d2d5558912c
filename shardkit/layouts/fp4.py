"""fp4 checkpoints (NVFP4, MXFP4): which layout a checkpoint uses, from names, shapes, dtypes and config alone.

Two e2m1 values per byte, low nibble first, one scale per block of the input dimension:

==========================================  ===========================  ==============================  =========================================  ==============================================
layout                                      packed weight (U8)           block scale                     global scale                               recipe (config)
==========================================  ===========================  ==============================  =========================================  ==============================================
NVIDIA ModelOpt NVFP4                       ``X.weight`` (out, in/2)     ``X.weight_scale`` e4m3, 16     ``X.weight_scale_2`` F32 ``[]``, multiplies  ``hf_quant_config.json`` / ``quant_method: modelopt``
compressed-tensors nvfp4-pack-quantized     ``X.weight_packed``          ``X.weight_scale`` e4m3, 16     ``X.weight_global_scale`` F32 ``[1]``, divides  ``format: nvfp4-pack-quantized``
gpt-oss MXFP4 (MoE experts)                 ``X_blocks`` (E, out, in/32, 16)  ``X_scales`` e8m0 (E, out, in/32)  none                                 ``quant_method: mxfp4``
==========================================  ===========================  ==============================  =========================================  ==============================================

Input scales (``input_scale``, ``input_global_scale``) and kv-cache scales are not weights: they go
when the checkpoint is dequantized. gpt-oss experts dequantize to dense names, transposed:
``X_blocks`` (E, out, in/32, 16) → ``X`` (E, in, out). :func:`find_fp4_layout` never raises: what is
missing or misshapen is listed in :attr:`Fp4Layout.problems` (one line each, naming the tensor), for
``verify`` to report and ``convert``/``split`` to refuse. This module is pure (stdlib only): the
arithmetic lives in :mod:`shardkit.layouts.fp4_math`.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ..errors import Option, Part
from ..formats.header import TensorEntry
from ..formats.json_types import Config

__all__ = ["COMPRESSED_NVFP4", "E4M3", "FP4_FINDERS", "HF_QUANT_CONFIG", "MODELOPT_NVFP4", "MXFP4", "Fp4Layout",
           "PackedWeight", "find_fp4_layout"]

MODELOPT_NVFP4 = "NVIDIA ModelOpt NVFP4"
COMPRESSED_NVFP4 = "compressed-tensors nvfp4-pack-quantized"
MXFP4 = "gpt-oss MXFP4"
HF_QUANT_CONFIG = "hf_quant_config.json"  # ModelOpt's recipe, beside config.json
NVFP4_FORMAT = "nvfp4-pack-quantized"
E4M3 = "F8_E4M3"
E8M0 = ("U8", "F8_E8M0")
SHOWN = 3


@dataclass(frozen=True)
class PackedWeight:
    """One packed fp4 weight and its scales.

    Attributes:
        packed: the stored U8 tensor's name.
        output: the dense tensor's name once dequantized (``X.weight``; gpt-oss: ``X`` of ``X_blocks``).
        scale: the block scales' name.
        global_scale: the per-tensor scale's name (NVFP4), or None (MXFP4).
        shape: the dense tensor's shape (transposed already for gpt-oss experts).
        transposed: gpt-oss experts: stored (E, out, in), dense (E, in, out).
    """

    packed: str
    output: str
    scale: str
    global_scale: str | None
    shape: tuple[int, ...]
    transposed: bool = False


@dataclass(frozen=True)
class Fp4Layout:
    """How a checkpoint stores fp4 weights (see the module docstring).

    Attributes:
        scheme: :data:`MODELOPT_NVFP4`, :data:`COMPRESSED_NVFP4` or :data:`MXFP4`.
        block: values per block scale (16 or 32).
        weights: every packed weight whose scales are present and fit, in the source's order.
        extra: the scales of ``weights`` and their modules' input and kv-cache scales: not weights, gone once
            dequantized (the packed tensors are replaced by their dense ``output``).
        scale_dtype: the block scales' dtype code.
        problems: one line per missing, misshapen or unrecorded scale or recipe, naming the tensor.
    """

    scheme: str
    block: int
    weights: tuple[PackedWeight, ...]
    extra: frozenset[str]
    scale_dtype: str
    problems: tuple[str, ...] = ()
    weight_dtype: str = field(default="U8")

    def describe(self) -> str:
        """``"nvfp4 (e2m1), 16-value blocks, fp8 (e4m3) scales + float32 global scale (NVIDIA ModelOpt NVFP4)"``."""
        if self.scheme == MXFP4:
            return f"mxfp4 (e2m1), {self.block}-value blocks, e8m0 scales ({self.scheme})"
        return f"nvfp4 (e2m1), {self.block}-value blocks, fp8 (e4m3) scales + float32 global scale ({self.scheme})"

    def dense_parameters(self) -> int:
        """Elements of the dequantized weights."""
        return sum(math.prod(w.shape) for w in self.weights)

    def to_dict(self) -> dict[str, object]:
        """What ``info --json`` shows: the layout, block size, scale dtype, each weight with its scales and
        dense shape, and the dequantized sizes of those weights."""
        dense = self.dense_parameters()
        return {"description": self.describe(), "scheme": self.scheme, "block_size": self.block,
                "scaled_weights": len(self.weights), "extra_tensors": len(self.extra), "weight_dtype": self.weight_dtype,
                "scale_dtype": self.scale_dtype, "dequantized_bytes": {"fp32": dense * 4, "bf16": dense * 2},
                "weights": [{"weight": w.packed, "scales": [s for s in (w.scale, w.global_scale) if s],
                             "dequantized": w.output, "shape": list(w.shape)} for w in self.weights],
                **({"problems": list(self.problems)} if self.problems else {})}

    def refusal(self, where: str) -> tuple[Part, ...] | None:
        """The one-line refusal of an inconsistent checkpoint, or None when nothing is wrong."""
        if not self.problems:
            return None
        more = f" (and {len(self.problems) - SHOWN} more)" if len(self.problems) > SHOWN else ""
        return (f"{where}: {self.scheme} checkpoint is inconsistent: {'; '.join(self.problems[:SHOWN])}{more}; "
                "every fp4 weight needs its scales and the quantization config (re-export it, or pass ",
                Option("allow_lossy", True), " to copy such tensors as they are)")


def find_fp4_layout(entries: Sequence[TensorEntry], *, config: Config | None = None,
                    where: str = "checkpoint") -> Fp4Layout | None:
    """The fp4 layout of a checkpoint, or None when it holds no fp4 weight (problems are listed, not raised).

    Args:
        entries: the checkpoint's tensors (names, dtypes, shapes).
        config: its ``config.json`` (with ``hf_quant_config.json`` folded into ``quantization_config``:
            :func:`shardkit.layouts.registry.quant_config`).
        where: the checkpoint, for messages.

    >>> e = [TensorEntry("l.weight", "U8", (4, 8), 32), TensorEntry("l.weight_scale", "F8_E4M3", (4, 1), 4),
    ...      TensorEntry("l.weight_scale_2", "F32", (), 4)]
    >>> layout = find_fp4_layout(e, config={"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}})
    >>> layout.scheme, layout.weights[0].shape, layout.problems
    ('NVIDIA ModelOpt NVFP4', (4, 16), ())
    """
    by_name = {e.name: e for e in entries}
    qconfig = dict((config or {}).get("quantization_config") or {})
    for finder in FP4_FINDERS:
        layout = finder(by_name, qconfig)
        if layout is not None:
            return layout
    return None


def _modelopt(by_name: Mapping[str, TensorEntry], qconfig: Config) -> Fp4Layout | None:
    recorded = str(qconfig.get("quant_algo", "")).upper() == "NVFP4" or (
        qconfig.get("quant_method") == "modelopt" and "NVFP4" in str(qconfig.get("quant_algo", "NVFP4")).upper())
    excluded = [str(p) for p in qconfig.get("exclude_modules") or qconfig.get("ignore") or [] if isinstance(p, str)]
    modules = {n[: -len(".weight_scale_2")] for n in by_name if n.endswith(".weight_scale_2")}
    modules |= {n[: -len(".weight")] for n, e in by_name.items() if n.endswith(".weight") and e.dtype == "U8"
                and (f"{n[: -len('.weight')]}.weight_scale" in by_name or recorded)
                and not any(fnmatch.fnmatchcase(n[: -len(".weight")], p) for p in excluded)}
    if not modules:
        return None
    problems = [] if recorded else ["no quantization metadata: hf_quant_config.json (quant_algo NVFP4) or config.json "
                                    "quantization_config (quant_method modelopt) is missing"]
    weights = []
    for module in sorted(modules, key=_order(by_name, ".weight")):
        found = _nvfp4_weight(by_name, f"{module}.weight", f"{module}.weight_scale", f"{module}.weight_scale_2",
                              problems)
        if found is not None:
            weights.append(found)
    extra = _scales_of(weights, by_name, (".input_scale", ".k_scale", ".v_scale"))
    return Fp4Layout(MODELOPT_NVFP4, 16, tuple(weights), frozenset(extra), E4M3, tuple(problems))


def _compressed(by_name: Mapping[str, TensorEntry], qconfig: Config) -> Fp4Layout | None:
    formats = {str(qconfig.get("format"))} | {str(g.get("format")) for g in (qconfig.get("config_groups") or {}).values()
                                              if isinstance(g, Mapping)}
    recorded = qconfig.get("quant_method") == "compressed-tensors" and NVFP4_FORMAT in formats
    modules = {n[: -len(".weight_global_scale")] for n in by_name if n.endswith(".weight_global_scale")}
    if recorded:
        modules |= {n[: -len(".weight_packed")] for n in by_name if n.endswith(".weight_packed")}
    if not modules:
        return None
    problems = [] if recorded else ["no quantization metadata: config.json quantization_config (quant_method "
                                    f"compressed-tensors, format {NVFP4_FORMAT}) is missing"]
    weights = []
    for module in sorted(modules, key=_order(by_name, ".weight_packed")):
        found = _nvfp4_weight(by_name, f"{module}.weight_packed", f"{module}.weight_scale",
                              f"{module}.weight_global_scale", problems, output=f"{module}.weight")
        if found is not None:
            weights.append(found)
    extra = _scales_of(weights, by_name, (".input_global_scale", ".input_scale", ".weight_zero_point", ".k_scale",
                                          ".v_scale"))
    return Fp4Layout(COMPRESSED_NVFP4, 16, tuple(weights), frozenset(extra), E4M3, tuple(problems))


def _nvfp4_weight(by_name: Mapping[str, TensorEntry], packed_name: str, scale_name: str, global_name: str,
                  problems: list[str], *, output: str | None = None) -> PackedWeight | None:
    packed, scale, global_scale = by_name.get(packed_name), by_name.get(scale_name), by_name.get(global_name)
    if packed is None:
        problems.append(f"scales {scale_name} have no packed weight {packed_name}")
        return None
    if packed.dtype != "U8" or len(packed.shape) != 2:
        problems.append(f"packed weight {packed_name} is {packed.dtype} {list(packed.shape)}, expected U8 (out, in/2)")
        return None
    rows, cols = packed.shape[0], packed.shape[1] * 2
    want = [rows, cols // 16]
    if scale is None or global_scale is None:
        problems.append(f"packed weight {packed_name} has no {'scale ' + scale_name if scale is None else ''}"
                        f"{' and no ' if scale is None and global_scale is None else ''}"
                        f"{'global scale ' + global_name if global_scale is None else ''}")
        return None
    if cols % 16 or scale.dtype != E4M3 or list(scale.shape) != want:
        problems.append(f"scale {scale_name} is {scale.dtype} {list(scale.shape)}, expected F8_E4M3 {want} "
                        f"for {packed_name} {list(packed.shape)}")
        return None
    if global_scale.dtype != "F32" or math.prod(global_scale.shape) != 1:
        problems.append(f"global scale {global_name} is {global_scale.dtype} {list(global_scale.shape)}, expected "
                        "one F32 value")
        return None
    return PackedWeight(packed_name, output or packed_name, scale_name, global_name, (rows, cols))


def _mxfp4(by_name: Mapping[str, TensorEntry], qconfig: Config) -> Fp4Layout | None:
    recorded = qconfig.get("quant_method") == "mxfp4"
    prefixes = {n[: -len("_blocks")] for n, e in by_name.items() if n.endswith("_blocks") and e.dtype == "U8"}
    if recorded:  # scales without their blocks: only where the recipe says MXFP4 (other formats name scales so)
        prefixes |= {n[: -len("_scales")] for n, e in by_name.items() if n.endswith("_scales") and e.dtype in E8M0}
    if not prefixes:
        return None
    problems = [] if recorded else ["no quantization metadata: config.json quantization_config (quant_method "
                                    "mxfp4) is missing"]
    weights = []
    for prefix in sorted(prefixes, key=_order(by_name, "_blocks")):
        blocks, scales = by_name.get(prefix + "_blocks"), by_name.get(prefix + "_scales")
        if blocks is None or scales is None:
            problems.append(f"scales {prefix}_scales have no blocks {prefix}_blocks" if blocks is None
                            else f"MXFP4 blocks {prefix}_blocks have no scales {prefix}_scales")
            continue
        if blocks.dtype != "U8" or len(blocks.shape) != 4 or blocks.shape[3] != 16:
            problems.append(f"MXFP4 blocks {prefix}_blocks are {blocks.dtype} {list(blocks.shape)}, expected U8 "
                            "(experts, out, in/32, 16)")
            continue
        if scales.dtype not in E8M0 or tuple(scales.shape) != tuple(blocks.shape[:3]):
            problems.append(f"scales {prefix}_scales are {scales.dtype} {list(scales.shape)}, expected U8 "
                            f"{list(blocks.shape[:3])} for {prefix}_blocks")
            continue
        experts, rows, groups, _ = blocks.shape
        weights.append(PackedWeight(prefix + "_blocks", prefix, prefix + "_scales", None, (experts, groups * 32, rows),
                                    transposed=True))
    extra = _scales_of(weights, by_name, ())
    scale_dtype = next((by_name[w.scale].dtype for w in weights), "U8")
    return Fp4Layout(MXFP4, 32, tuple(weights), frozenset(extra), scale_dtype, tuple(problems))


def _scales_of(weights: list[PackedWeight], by_name: Mapping[str, TensorEntry], suffixes: tuple[str, ...]) -> set[str]:
    """The scales of ``weights`` and their modules' ``suffixes`` (input scales...): a broken weight's stay."""
    modules = {w.output.rpartition(".")[0] for w in weights}
    found = {s for w in weights for s in (w.scale, w.global_scale) if s}
    return found | {n for n in by_name if n.endswith(suffixes) and n.rpartition(".")[0] in modules} if suffixes else found


def _order(by_name: Mapping[str, TensorEntry], suffix: str) -> Callable[[str], tuple[int, str]]:
    """Sort modules in the checkpoint's order (where ``module + suffix`` is), then by name."""
    position = {name: i for i, name in enumerate(by_name)}
    return lambda module: (position.get(module + suffix, len(position)), module)


FP4_FINDERS: tuple[Callable[[Mapping[str, TensorEntry], Config], Fp4Layout | None], ...] = (
    _modelopt, _compressed, _mxfp4)
