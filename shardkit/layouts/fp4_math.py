"""fp4 arithmetic: unpack e2m1, dequantize a band of NVFP4/MXFP4 rows, quantize one (torch imported lazily).

Each function performs the reference's operations in the reference's order and dtypes, so its output
is bit-equal to it:

- ModelOpt NVFP4 (``NVFP4QTensor.dequantize``): ``e2m1 × (f32(weight_scale) × weight_scale_2)`` in
  float32 per 16-value block, then the output dtype.
- compressed-tensors NVFP4 (``NVFP4PackedCompressor.decompress``): the e2m1 values in bf16, the fp8 scale
  in bf16 divided by ``weight_global_scale`` (float32 for a ``[1]`` global scale, bf16 for a 0-dim one:
  torch's promotion), their product, then the output dtype.
- gpt-oss MXFP4 (transformers' ``convert_moe_packed_tensors``): the e2m1 values looked up in the output
  dtype, then ``ldexp`` by ``scale - 127``.

Quantization mirrors compressed-tensors' observers and compressors (``generate_gparam``,
``calculate_qparams``, ``quantize_and_pack_fp4``; ``generate_mx_scales`` for MXFP4), computed in the
weight's own dtype as llm-compressor observes it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from ..errors import InvalidInputError, Option
from .fp4 import COMPRESSED_NVFP4, HF_QUANT_CONFIG, MODELOPT_NVFP4, MXFP4, Fp4Layout, PackedWeight
from .quant import DenseWeight, TensorReader

if TYPE_CHECKING:
    import torch

__all__ = ["BAND_BYTES", "E2M1_VALUES", "Fp4Dequantizer", "dequantize_mxfp4", "dequantize_nvfp4", "quantize_mxfp4", "quantize_nvfp4",
           "nvfp4_global_scale", "scale_problems", "unpack_e2m1"]

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
BAND_BYTES = 16 * 2**20  # float32 bytes of one band's temporaries


def unpack_e2m1(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``packed`` (..., n) uint8 as (..., 2n) values in ``dtype``: low nibble first (one lookup per byte in a
    256-entry table of value pairs)."""
    import torch

    lut = torch.tensor(E2M1_VALUES, dtype=dtype, device=packed.device)
    codes = torch.arange(256, dtype=torch.int32, device=packed.device)
    pairs = torch.stack((lut[codes & 0x0F], lut[codes >> 4]), dim=-1)
    out = torch.index_select(pairs, 0, packed.reshape(-1).to(torch.int32))
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, *, modelopt: bool,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """Rows of an NVFP4 weight: ``packed`` (rows, in/2) uint8, ``scale`` (rows, in/16) e4m3, ``global_scale`` one
    float32 value (ModelOpt's ``weight_scale_2`` if ``modelopt``, else compressed-tensors' ``weight_global_scale``)."""
    import torch

    rows = packed.shape[0]
    if modelopt:
        values = unpack_e2m1(packed, torch.float32).reshape(rows, -1, NVFP4_BLOCK)
        factors = scale.to(torch.float32).unsqueeze(-1) * global_scale.to(torch.float32)
        return (values * factors).reshape(rows, -1).to(out_dtype)
    values = unpack_e2m1(packed, torch.bfloat16).reshape(rows, -1, NVFP4_BLOCK)
    factors = scale.to(torch.bfloat16).unsqueeze(-1) / global_scale
    return (values.to(factors.dtype) * factors).reshape(rows, -1).to(out_dtype)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 groups: ``blocks`` (..., G, 16) uint8 and ``scales`` (..., G) e8m0 → (..., G × 32) in ``out_dtype``."""
    import torch

    values = unpack_e2m1(blocks.to(torch.uint8), out_dtype)
    exponents = scales.view(torch.uint8).to(torch.int32).unsqueeze(-1) - 127
    torch.ldexp(values, exponents, out=values)
    return values.reshape(*values.shape[:-2], -1)


def nvfp4_global_scale(absmax: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' ``generate_gparam``: ``448 × 6 / absmax`` in ``absmax``'s dtype, float32 ``[1]``."""
    import torch

    top = torch.clamp(absmax, min=torch.finfo(absmax.dtype).tiny)
    scale = torch.nan_to_num(E4M3_MAX * E2M1_MAX / top, nan=1.0, posinf=1.0, neginf=1.0)
    return scale.to(torch.float32).reshape([1])


def quantize_nvfp4(w: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 (rows, in/2), e4m3 scales (rows, in/16)) of rows ``w`` in their stored dtype."""
    import torch

    rows = w.shape[0]
    groups = w.reshape(rows, -1, NVFP4_BLOCK)
    absmax = torch.max(torch.amin(groups, dim=-1).clamp(max=0).abs(), torch.amax(groups, dim=-1).clamp(min=0))
    scale = absmax / torch.tensor(2 * E2M1_MAX, dtype=torch.float32).to(absmax.dtype).div(2)
    scale = (global_scale * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    scale = torch.where(scale == 0, torch.tensor(0.125, dtype=scale.dtype), scale)
    scaled = groups / (scale / global_scale).unsqueeze(-1)
    codes = _e2m1_codes(scaled.clamp(-E2M1_MAX, E2M1_MAX).to(torch.float32))
    return _pack(codes.reshape(rows, -1)), scale.to(torch.float8_e4m3fn)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks uint8 (..., G, 16), scales uint8 (..., G)) of ``w`` (..., in) in its stored dtype."""
    import torch

    groups = w.reshape(*w.shape[:-1], -1, MXFP4_BLOCK)
    absmax = torch.max(torch.amin(groups, dim=-1).clamp(max=0).abs(), torch.amax(groups, dim=-1).clamp(min=0))
    exponent = 127 + torch.floor(torch.log2(_round_to_power_2(absmax))) - 2
    exponent = torch.round(torch.clamp(exponent, 0, 255)).to(torch.uint8).to(absmax.dtype)
    scale = (2.00 ** ((exponent.to(torch.int32) - 127).to(torch.float))).to(absmax.dtype)
    scale = torch.where(scale == 0, torch.tensor(1, dtype=scale.dtype), scale)  # uint8 scales' eps
    scaled = groups / scale.unsqueeze(-1)
    codes = _e2m1_codes(scaled.clamp(-E2M1_MAX, E2M1_MAX).to(torch.float32))
    packed = _pack(codes.reshape(-1, MXFP4_BLOCK)).reshape(*groups.shape[:-1], MXFP4_BLOCK // 2)
    return packed, (127 + torch.floor(torch.log2(scale)).to(torch.int32)).to(torch.uint8)


def _round_to_power_2(x: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' ``round_to_power_2`` with e2m1's one mantissa bit (bf16, fp16 or float32 ``x``)."""
    import torch

    bits = {torch.bfloat16: (torch.uint16, 7, 8), torch.float16: (torch.uint16, 10, 5),
            torch.float32: (torch.uint32, 23, 8)}
    int_dtype, mantissa, exponent = bits[x.dtype]
    raw = x.view(int_dtype).to(torch.int32)
    rounded = torch.bitwise_and(raw + (1 << (mantissa - 1 - 1)), ((1 << (exponent + 1)) - 1) << mantissa)
    return rounded.to(int_dtype).view(x.dtype) if int_dtype is torch.uint16 else rounded.view(x.dtype)


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' ``cast_to_fp4`` then ``pack_fp4_to_uint8``'s codes: nearest e2m1 (ties as it breaks
    them), sign kept from the rounded value's sign bit."""
    import torch

    sign, a = torch.sign(x), torch.abs(x)
    a = torch.where(a <= 0.25, 0.0, a)
    for low, high, value, closed in ((0.25, 0.75, 0.5, False), (0.75, 1.25, 1.0, True), (1.25, 1.75, 1.5, False),
                                     (1.75, 2.5, 2.0, True), (2.5, 3.5, 3.0, False), (3.5, 5.0, 4.0, True)):
        inside = (a >= low) & (a <= high) if closed else (a > low) & (a < high)
        a = torch.where(inside & (a != 0), value, a)
    a = torch.where(a > 5.0, 6.0, a)
    rounded = a * sign
    doubled = (rounded * 2).to(torch.int8).abs()
    index = torch.zeros_like(doubled, dtype=torch.uint8)
    for value, code in ((1, 1), (2, 2), (3, 3), (4, 4), (6, 5), (8, 6)):
        index = torch.where(doubled == value, code, index)
    index = torch.where(doubled >= 12, 7, index)
    return index | (torch.signbit(rounded).to(torch.uint8) << 3)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    pairs = codes.reshape(-1, 2)
    return (pairs[:, 0] | (pairs[:, 1] << 4)).reshape(codes.shape[0], -1)


def scale_problems(layout: Fp4Layout, read: Callable[[str], torch.Tensor]) -> list[tuple[str, str]]:
    """(packed weight, one line) per scale tensor of ``layout`` holding a NaN or an infinity (or a zero divisor),
    read by ``read``."""
    import torch

    problems = []
    for weight in layout.weights:
        codes = read(weight.scale).view(torch.uint8)  # e4m3fn: NaN is S.1111.111, no infinity; e8m0: NaN is 0xFF
        nan = (codes == 0xFF) if layout.scheme == MXFP4 else (codes & 0x7F) == 0x7F
        if bool(nan.any()):
            problems.append((weight.packed, f"scale {weight.scale} of {weight.packed} holds non-finite values"))
        if weight.global_scale is not None:
            value = read(weight.global_scale).to(torch.float32)
            if not bool(torch.isfinite(value).all()) or (layout.scheme == COMPRESSED_NVFP4 and bool((value == 0).any())):
                problems.append((weight.packed, f"global scale {weight.global_scale} of {weight.packed} is "
                                                f"{value.reshape(-1).tolist()}"))
    return problems


class Fp4Dequantizer:
    """The dense weights of an fp4 layout (a :class:`~shardkit.layouts.quant.Dequantizer`): band by band of rows
    (NVFP4) or of one expert's input columns (MXFP4), never the whole tensor."""

    dropped_metadata: frozenset[str] = frozenset()
    side_files = frozenset({HF_QUANT_CONFIG})  # ModelOpt's recipe goes with the quantization

    def __init__(self, layout: Fp4Layout) -> None:
        self.layout = layout
        self._packed = {w.packed: w for w in layout.weights}
        self._weights = tuple(DenseWeight(w.packed, w.output, w.shape, tuple(s for s in (w.scale, w.global_scale) if s))
                              for w in layout.weights)

    def weights(self) -> tuple[DenseWeight, ...]:
        return self._weights

    def broken(self, reader: TensorReader, *, where: str, allow_lossy: bool) -> frozenset[str]:
        """The weights whose scales hold NaN or infinity (refused unless ``allow_lossy``)."""
        problems = self.scale_problems(reader)
        if problems and not allow_lossy:
            raise InvalidInputError(f"{where}: {self.layout.scheme}: {'; '.join(p for _, p in problems[:3])}; "
                                    "dequantized, these weights would be NaN or infinite (re-export the checkpoint, or "
                                    "pass ", Option("allow_lossy", True), " to copy them as they are)")
        return frozenset(packed for packed, _ in problems)

    def scale_problems(self, reader: TensorReader) -> list[tuple[str, str]]:
        """Scales holding NaN or infinity, global scales that are zero (:func:`scale_problems`)."""
        return scale_problems(self.layout, reader.whole)

    def dense_bands(self, reader: TensorReader, weight: DenseWeight, out_dtype: torch.dtype, *,
                    first: int = 0) -> Iterator[tuple[int, torch.Tensor]]:
        packed = self._packed[weight.stored]
        if self.layout.scheme == MXFP4:
            return _mxfp4_bands(reader, packed, out_dtype, first)
        return _nvfp4_bands(reader, packed, out_dtype, first, modelopt=self.layout.scheme == MODELOPT_NVFP4)


def _nvfp4_bands(reader: TensorReader, weight: PackedWeight, out_dtype: torch.dtype, first: int, *,
                 modelopt: bool) -> Iterator[tuple[int, torch.Tensor]]:
    rows, cols = weight.shape
    step = max(1, BAND_BYTES // (cols * 4))
    global_scale = reader.whole(weight.global_scale or "")
    for row0 in range(first // max(1, cols) // step * step, rows, step):
        row1 = min(rows, row0 + step)
        band = dequantize_nvfp4(reader.rows(weight.packed, row0, row1), reader.rows(weight.scale, row0, row1),
                                global_scale, modelopt=modelopt, out_dtype=out_dtype)
        yield row0 * cols, band


def _mxfp4_bands(reader: TensorReader, weight: PackedWeight, out_dtype: torch.dtype,
                 first: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Expert by expert, a run of input columns at a time: dense rows ``(e, c0:c1)`` are the transposed
    dequantized columns ``c0:c1`` of the stored ``(out, in)`` matrix of expert ``e``."""
    experts, cols, rows = weight.shape  # dense (E, in, out)
    groups = cols // MXFP4_BLOCK
    per_band = max(1, BAND_BYTES // (rows * MXFP4_BLOCK * 4))  # groups of 32 input columns per band
    for expert in range(first // max(1, cols * rows), experts):
        blocks = reader.rows(weight.packed, expert, expert + 1).reshape(rows, groups, 16)
        scales = reader.rows(weight.scale, expert, expert + 1).reshape(rows, groups)
        for g0 in range(0, groups, per_band):
            g1 = min(groups, g0 + per_band)
            dense = dequantize_mxfp4(blocks[:, g0:g1], scales[:, g0:g1], out_dtype).transpose(0, 1)
            yield (expert * cols + g0 * MXFP4_BLOCK) * rows, dense
