"""fp8 checkpoints with scales: which layout a checkpoint uses, from names, shapes, dtypes and config alone.

Quantized checkpoints carry their scales as ordinary tensors beside the fp8 weights; a tool that
treats them as plain tensors casts the scales, drops them, or upcasts fp8 without them. Every
reader (``info``, ``split``/``convert``, loading) asks :func:`find_layout` first. Layouts known:

============================  =======================  ==================================  ==========================
scheme                        scale of ``X.weight``    input scale / markers               recipe
============================  =======================  ==================================  ==========================
transformers FineGrainedFP8   ``X.weight_scale_inv``   ``X.activation_scale``              config ``quant_method: fp8``
compressed-tensors            ``X.weight_scale``       ``X.input_scale``                   config ``compressed-tensors``
ComfyUI scaled_fp8            ``X.scale_weight``       ``X.scale_input``, ``scaled_fp8``   the marker tensor
ComfyUI quantized             ``X.weight_scale``       ``X.input_scale``, ``X.comfy_quant``  header ``_quantization_metadata``
============================  =======================  ==================================  ==========================

Every scheme dequantizes as ``weight.float() × scale`` (FineGrainedFP8's ``scale_inv`` is already the
multiplier), the scale broadcast per tensor (one value), per output channel (``(out, 1)``) or per block
(``(ceil(out/b0), ceil(in/b1))``). A scale that fits none of these, a scale whose weight is missing,
and an fp8 weight without a scale in a scaled checkpoint are errors that name the tensors.

This module is pure (stdlib only): the arithmetic lives in :mod:`shardkit.layouts.fp8_math`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import InvalidInputError, Option, Part
from ..formats.header import TensorEntry
from ..formats.json_types import Config, JsonObject

__all__ = ["FP8_DTYPES", "QUANTIZE_SCHEMES", "QUANTIZE_SKIP_PATTERNS", "QuantLayout", "ScaledWeight", "find_layout",
           "matrix_shape", "should_skip_quantize"]

FP8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ"})
DEFAULT_BLOCK = (128, 128)
QUANTIZE_SCHEMES = ("fp8-block", "fp8-channel", "fp8-tensor")  # their recipes: shardkit.layouts.fp8_quantize
SHOWN = 3
MAX_FUSED = 4  # per-tensor scales of one fused layer: qkv (3), gate_up (2)

# Modules kept in their dtype by ``--quantize``: diffusers' layerwise-casting defaults
# (``DEFAULT_SKIP_MODULES_PATTERN``), the modulation/embedding patterns of
# :data:`shardkit.runtime.casting.EXTRA_SKIP_PATTERNS`, and the language-model head. A test keeps this
# table a superset of both, so the two skip rules cannot drift apart.
QUANTIZE_SKIP_PATTERNS: tuple[str, ...] = (
    "pos_embed", "patch_embed", "norm", "^proj_in$", "^proj_out$",
    "embed", "time_emb", "emb_proj", "modulation", "adaln", "ada_ln", "scale_shift", "lm_head",
)


@dataclass(frozen=True)
class _Scheme:
    """One layout: the suffix of its weight scales, its input scales and marker names, how to describe it."""

    name: str
    scale_suffix: str
    input_suffixes: tuple[str, ...]
    marker_suffixes: tuple[str, ...] = ()


FINEGRAINED = _Scheme("transformers FineGrainedFP8", ".weight_scale_inv", (".activation_scale", ".input_scale"))
COMPRESSED = _Scheme("compressed-tensors float-quantized", ".weight_scale", (".input_scale",))
COMFY_SCALED = _Scheme("ComfyUI scaled_fp8", ".scale_weight", (".scale_input",), ("scaled_fp8",))
COMFY_QUANT = _Scheme("ComfyUI quantized", ".weight_scale", (".input_scale",), (".comfy_quant",))
COMFY_METADATA_KEY = "_quantization_metadata"
_NAMES = {"fp8": FINEGRAINED, "compressed-tensors": COMPRESSED}
_SCALE_DTYPE_NAMES = {"F32": "float32", "BF16": "bf16", "F16": "fp16", "F8_E8M0": "e8m0", "U8": "e8m0 (uint8)"}
_WEIGHT_DTYPE_NAMES = {"F8_E4M3": "fp8", "F8_E4M3FNUZ": "fp8 (e4m3fnuz)", "F8_E5M2": "fp8 (e5m2)",
                       "F8_E5M2FNUZ": "fp8 (e5m2fnuz)"}


@dataclass(frozen=True)
class ScaledWeight:
    """One weight and the scale it is multiplied by.

    Attributes:
        weight: the weight tensor's name.
        scale: the scale tensor's name.
        granularity: ``"tensor"``, ``"channel"``, ``"block"`` or ``"fused"`` (several per-tensor
            scales of a fused layer, e.g. qkv: usable only when they agree, which needs their values).
        block: rows × columns one scale covers (``(rows, cols)`` of the weight seen as 2-D for
            ``"tensor"``, ``(1, cols)`` for ``"channel"``).
    """

    weight: str
    scale: str
    granularity: str
    block: tuple[int, int]


def _grain_words(weight: ScaledWeight) -> str:
    """``"128×128 blocks"``, ``"per-channel scales"``, ``"fused per-tensor scales"``..."""
    if weight.granularity == "block":
        return f"{weight.block[0]}×{weight.block[1]} blocks"
    return "fused per-tensor scales" if weight.granularity == "fused" else f"per-{weight.granularity} scales"


@dataclass(frozen=True)
class QuantLayout:
    """How a checkpoint stores fp8 weights with scales (see the module docstring).

    Attributes:
        scheme: the layout's name, e.g. ``"transformers FineGrainedFP8"``.
        weights: every scaled weight, in the source's order.
        extra: names that are not weights (scales, input scales, markers): dropped on dequantization.
        weight_dtype: the stored dtype code of the quantized weights (the most common one).
        scale_dtype: the scale tensors' dtype code (the most common one).
    """

    scheme: str
    weights: tuple[ScaledWeight, ...]
    extra: frozenset[str]
    weight_dtype: str
    scale_dtype: str

    def describe(self) -> str:
        """``"fp8, 128×128 blocks, float32 scales (transformers FineGrainedFP8)"`` and the like."""
        grains = ", ".join(sorted({_grain_words(w) for w in self.weights}))
        weight = _WEIGHT_DTYPE_NAMES.get(self.weight_dtype, self.weight_dtype)
        scale = _SCALE_DTYPE_NAMES.get(self.scale_dtype, self.scale_dtype)
        return f"{weight}, {grains}, {scale} scales ({self.scheme})"

    def to_dict(self) -> dict[str, object]:
        grains: dict[str, int] = {}
        for w in self.weights:
            grains[w.granularity] = grains.get(w.granularity, 0) + 1
        return {"description": self.describe(), "scheme": self.scheme, "scaled_weights": len(self.weights),
                "extra_tensors": len(self.extra), "granularity": grains, "weight_dtype": self.weight_dtype,
                "scale_dtype": self.scale_dtype}

    @property
    def problems(self) -> tuple[str, ...]:
        """None: :func:`find_layout` refuses an inconsistent fp8 checkpoint (as :attr:`Fp4Layout.problems` reads)."""
        return ()

    def refusal(self, where: str) -> tuple[Part, ...] | None:
        """None: a layout found is consistent (as :meth:`Fp4Layout.refusal` reads)."""
        return None


def find_layout(entries: Sequence[TensorEntry], *, config: Config | None = None,
                metadata: Mapping[str, str] | None = None, where: str = "checkpoint") -> QuantLayout | None:
    """The fp8-with-scales layout of a checkpoint, or None when it holds no scale tensors.

    Args:
        entries: the checkpoint's tensors (names, dtypes, shapes).
        config: its ``config.json`` (``quantization_config`` gives the scheme and block size).
        metadata: its safetensors header metadata (ComfyUI's ``_quantization_metadata``).
        where: the checkpoint, for messages.

    Raises:
        InvalidInputError: a scale without its weight, a scale of a shape that fits no granularity,
            or an fp8 weight without a scale (unless ``modules_to_not_convert``/``ignore`` lists its
            module); the message names the tensors.

    >>> e = [TensorEntry("l.weight", "F8_E4M3", (256, 128), 32768), TensorEntry("l.weight_scale_inv", "F32", (2, 1), 8)]
    >>> find_layout(e).describe()
    'fp8, 128×128 blocks, float32 scales (transformers FineGrainedFP8)'
    """
    by_name = {e.name: e for e in entries}
    qconfig = _quant_config(config, where)
    scheme = _scheme(by_name, qconfig, metadata or {})
    if scheme is None:
        return None
    block = _block_size(qconfig, where)
    weights, extra, problems = [], set(), []
    for entry in entries:
        if _is_extra(entry.name, scheme):
            extra.add(entry.name)
        if not entry.name.endswith(scheme.scale_suffix):
            continue
        weight = by_name.get(entry.name[: -len(scheme.scale_suffix)] + ".weight")
        if weight is None:
            problems.append(f"scale {entry.name} has no weight {entry.name[: -len(scheme.scale_suffix)]}.weight")
            continue
        found = _granularity(weight, entry, block)
        if entry.dtype not in _SCALE_DTYPE_NAMES:
            problems.append(f"scale {entry.name} is {entry.dtype}; scales are float32, bf16, fp16 or e8m0")
            continue
        if found is None:
            problems.append(f"scale {entry.name} of shape {list(entry.shape)} fits no per-tensor, per-channel or "
                            f"block scaling of {weight.name} {list(weight.shape)}")
            continue
        weights.append(ScaledWeight(weight.name, entry.name, *found))
    scaled = {w.weight for w in weights}
    ignored = _ignored_modules(qconfig)
    problems += [f"fp8 weight {e.name} has no scale {e.name[: -len('.weight')]}{scheme.scale_suffix}"
                 for e in entries if e.dtype in FP8_DTYPES and e.name.endswith(".weight") and e.name not in scaled
                 and e.name[: -len(".weight")] not in ignored]
    if problems:
        more = f" (and {len(problems) - SHOWN} more)" if len(problems) > SHOWN else ""
        raise InvalidInputError(f"{where}: {scheme.name} checkpoint is inconsistent: {'; '.join(problems[:SHOWN])}"
                                f"{more}; every fp8 weight needs its scale (re-export it, or leave such layers out "
                                "with ", Option("exclude"), ")")
    return QuantLayout(scheme.name, tuple(weights), frozenset(extra),
                       _most_common([by_name[w.weight].dtype for w in weights]),
                       _most_common([by_name[w.scale].dtype for w in weights]))


MAX_BLOCK = 1 << 16  # a scale block larger than this is no recipe any library writes


def _quant_config(config: Config | None, where: str) -> JsonObject:
    """``config.json``'s ``quantization_config`` (an object, or absent): anything else is one line naming it."""
    qconfig = (config or {}).get("quantization_config") or {}
    if not isinstance(qconfig, Mapping):
        raise InvalidInputError(f"{where}: config.json field quantization_config must be an object, got "
                                f"{type(qconfig).__name__}")
    return dict(qconfig)


def _block_size(qconfig: Config, where: str) -> tuple[int, int]:
    """``weight_block_size``: two integers in 1..65536, checked before any scale is expanded."""
    value = qconfig.get("weight_block_size") or DEFAULT_BLOCK
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= MAX_BLOCK for b in value)):
        raise InvalidInputError(f"{where}: config.json field quantization_config.weight_block_size must be two "
                                f"integers from 1 to {MAX_BLOCK}, got {str(value)[:80]}")
    return int(value[0]), int(value[1])


def _scheme(by_name: Mapping[str, TensorEntry], qconfig: Config,
            metadata: Mapping[str, str]) -> _Scheme | None:
    names = list(by_name)
    if any(n == "scaled_fp8" or n.endswith(".scaled_fp8") for n in names) or any(n.endswith(".scale_weight")
                                                                                for n in names):
        return COMFY_SCALED
    if any(n.endswith(FINEGRAINED.scale_suffix) for n in names):
        return FINEGRAINED
    if not any(n.endswith(".weight_scale") for n in names):
        return None
    if COMFY_METADATA_KEY in metadata or any(n.endswith(".comfy_quant") for n in names):
        return COMFY_QUANT
    return _NAMES.get(str(qconfig.get("quant_method")), COMPRESSED)


def _is_extra(name: str, scheme: _Scheme) -> bool:
    return (name.endswith(scheme.scale_suffix) or name.endswith(scheme.input_suffixes)
            or any(name == m.lstrip(".") or name.endswith("." + m.lstrip(".")) for m in scheme.marker_suffixes))


def _granularity(weight: TensorEntry, scale: TensorEntry,
                 block: tuple[int, int]) -> tuple[str, tuple[int, int]] | None:
    """(granularity, block) of ``scale`` over ``weight`` seen as rows × columns, or None if it fits none."""
    rows, cols = matrix_shape(weight.shape)
    numel, dims = math.prod(scale.shape), [d for d in scale.shape if d != 1]
    if numel == 0 or rows == 0 or cols == 0:  # an empty scale (0×0) scales nothing
        return None
    if numel == 1:
        return "tensor", (rows, cols)
    if len(weight.shape) >= 2 and dims == [rows] and (scale.shape[-1] == 1 or len(scale.shape) == 1) and rows > 1:
        return "channel", (1, cols)
    if len(scale.shape) == 2 and len(weight.shape) == 2:
        s_rows, s_cols = scale.shape
        if math.ceil(rows / block[0]) == s_rows and math.ceil(cols / block[1]) == s_cols:
            return "block", (block[0], block[1])
        if rows % s_rows == 0 and cols % s_cols == 0:
            return "block", (rows // s_rows, cols // s_cols)
    if len(scale.shape) == 1 and 1 < numel <= MAX_FUSED < rows:  # q/k/v or gate/up scales side by side
        return "fused", (rows, cols)
    return None


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """A tensor seen as a matrix: (first dimension, product of the others); a scalar is 1 × 1.

    >>> matrix_shape((64, 4, 3, 3)), matrix_shape(())
    ((64, 36), (1, 1))
    """
    return (shape[0] if shape else 1), (math.prod(shape[1:]) if len(shape) > 1 else 1)


def _ignored_modules(qconfig: Config) -> set[str]:
    names = qconfig.get("modules_to_not_convert") or qconfig.get("ignore") or []
    return {str(n) for n in names if isinstance(n, str)}


def _most_common(values: list[str]) -> str:
    return max(sorted(set(values)), key=values.count) if values else ""


def should_skip_quantize(entry: TensorEntry) -> bool:
    """Whether ``--quantize`` keeps ``entry`` as it is: not a ≥2-D float ``.weight``, or a module that
    :data:`QUANTIZE_SKIP_PATTERNS` names (embeddings, norms, modulation, ``lm_head``...).

    >>> should_skip_quantize(TensorEntry("model.layers.0.mlp.up_proj.weight", "BF16", (512, 256), 262144))
    False
    >>> should_skip_quantize(TensorEntry("model.embed_tokens.weight", "BF16", (512, 256), 262144))
    True
    """
    if not entry.name.endswith(".weight") or len(entry.shape) != 2 or entry.dtype not in ("F32", "F16", "BF16", "F64"):
        return True
    module = entry.name[: -len(".weight")]
    return any(re.search(p, module) for p in QUANTIZE_SKIP_PATTERNS)  # on the module's name, as diffusers matches
