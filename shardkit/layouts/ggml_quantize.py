"""Float values → GGUF ggml blocks, byte-equal to ``gguf.quants.quantize`` of their float32 values.

The kernels are gguf-py's (llama.cpp's Python quantizers) step for step, in numpy with the same float32
arithmetic, so the bytes are gguf-py's by construction (the tests compare them): F32, F16, BF16 (round to
nearest even, NaN quieted), Q8_0 (round half away from zero), Q4_0 and Q5_0 (scale from the value of
largest magnitude / −8 or −16, ``trunc(x / d + 8.5 or 16.5)``), Q4_1 and Q5_1 (min and (max − min) / 15 or
31, ``trunc((x − min) / d + 0.5)``). MXFP4 is never computed from values: :func:`mxfp4_blocks` repacks
gpt-oss's MXFP4 blocks as llama.cpp's converter does (the same e8m0 scales and e2m1 codes, nibbles reordered).

Values are taken in chunks of :data:`CHUNK_VALUES` (bf16 and f16 widened to float32 chunk by chunk), so every
intermediate array stays in the CPU cache: this is what makes gguf-py's own quantizer fast (it works 16 rows at
a time), and it keeps the work single-threaded per call (no intra-op thread pool spinning on a busy machine).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ..errors import InvalidInputError
from ..formats.gguf import GgmlType

if TYPE_CHECKING:
    import torch

__all__ = ["CHUNK_VALUES", "QUANTIZABLE", "mxfp4_blocks", "quantize", "quantize_array"]

CHUNK_VALUES = 2**15  # 128 KiB of float32 a chunk: a whole number of every block size (32, 256)
Array = np.ndarray


def roundf(n: Array) -> Array:
    """Round half away from zero, as ``gguf.quants.np_roundf``."""
    a = np.abs(n)
    floored = np.floor(a)
    b = floored + np.floor(2 * (a - floored))
    rounded: Array = np.sign(n) * b
    return rounded


def _inverse(d: Array) -> Array:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, 0, 1 / d)


def _f16(d: Array) -> Array:
    return d.astype(np.float16).view(np.uint8)


def _q_f32(blocks: Array) -> Array:
    return blocks.view(np.uint8)


def _q_f16(blocks: Array) -> Array:
    return blocks.astype(np.float16).view(np.uint8)


def _q_bf16(blocks: Array) -> Array:
    bits = blocks.view(np.uint32)
    quiet = np.where((bits & 0x7FFFFFFF) > 0x7F800000, (bits & np.uint32(0xFFFF0000)) | np.uint32(64 << 16), bits)
    rounded = (quiet.astype(np.uint64) + (0x7FFF + ((quiet >> 16) & 1))) >> 16
    out: Array = rounded.astype(np.uint16).view(np.uint8)
    return out


def _q_q8_0(blocks: Array) -> Array:
    d = np.abs(blocks).max(axis=1, keepdims=True) / 127
    qs = roundf(blocks * _inverse(d))
    out: Array = np.concatenate([_f16(d), qs.astype(np.int8).view(np.uint8)], axis=1)
    return out


def _nibbles(q: Array) -> Array:
    qs = q.reshape((q.shape[0], 2, 16))
    packed: Array = (qs[..., 0, :] & np.uint8(0x0F)) | (qs[..., 1, :] << np.uint8(4))
    return packed


def _high_bits(q: Array) -> Array:
    return np.packbits(q.reshape((q.shape[0], 1, 32)) >> np.uint8(4), axis=-1, bitorder="little").reshape(-1, 4)


def _by_magnitude(blocks: Array, levels: int) -> tuple[Array, Array]:
    """Q4_0/Q5_0: ``d`` = the value of largest magnitude / −levels, ``q = trunc(x / d + levels + 0.5)``."""
    imax = np.abs(blocks).argmax(axis=-1, keepdims=True)
    d = np.take_along_axis(blocks, imax, axis=-1) / -levels
    q = np.trunc((blocks * _inverse(d)) + np.float32(levels + 0.5), dtype=np.float32)
    return d, q.astype(np.uint8).clip(0, 2 * levels - 1)


def _by_range(blocks: Array, levels: int) -> tuple[Array, Array, Array]:
    """Q4_1/Q5_1: ``d = (max - min) / levels``, ``q = trunc((x - min) / d + 0.5)``."""
    high, low = blocks.max(axis=-1, keepdims=True), blocks.min(axis=-1, keepdims=True)
    d = (high - low) / levels
    q = np.trunc((blocks - low) * _inverse(d) + np.float32(0.5), dtype=np.float32)
    return d, low, q.astype(np.uint8).clip(0, levels)


def _q_q4_0(blocks: Array) -> Array:
    d, q = _by_magnitude(blocks, 8)
    return np.concatenate([_f16(d), _nibbles(q)], axis=-1)


def _q_q5_0(blocks: Array) -> Array:
    d, q = _by_magnitude(blocks, 16)
    return np.concatenate([_f16(d), _high_bits(q), _nibbles(q)], axis=-1)


def _q_q4_1(blocks: Array) -> Array:
    d, low, q = _by_range(blocks, 15)
    return np.concatenate([_f16(d), _f16(low), _nibbles(q)], axis=-1)


def _q_q5_1(blocks: Array) -> Array:
    d, low, q = _by_range(blocks, 31)
    return np.concatenate([_f16(d), _f16(low), _high_bits(q), _nibbles(q)], axis=-1)


_KERNELS: dict[str, Callable[[Array], Array]] = {
    "F32": _q_f32, "F16": _q_f16, "BF16": _q_bf16, "Q8_0": _q_q8_0, "Q4_0": _q_q4_0, "Q4_1": _q_q4_1,
    "Q5_0": _q_q5_0, "Q5_1": _q_q5_1}
QUANTIZABLE = frozenset(_KERNELS)


def _float32(chunk: Array, source: str) -> Array:
    """A chunk of ``source`` values ("F32", "F16", or "BF16" as uint16 bits) as float32."""
    if source == "BF16":
        return (chunk.astype(np.uint32) << 16).view(np.float32)
    return chunk.astype(np.float32, copy=False)


def quantize_array(values: Array, source: str, kind: GgmlType) -> Array:
    """The GGUF bytes (1-D uint8) of ``values`` (1-D: float32, float16, or bfloat16 bits as uint16 with
    ``source="BF16"``) as ``kind``, chunk by chunk.

    Raises:
        InvalidInputError: a type this module does not quantize, or a partial block.
    """
    kernel = _KERNELS.get(kind.name)
    if kernel is None:
        raise InvalidInputError(f"ggml type {kind.name}: shardkit writes {', '.join(sorted(QUANTIZABLE))}")
    if values.size % kind.block:
        raise InvalidInputError(f"{values.size} values are not whole {kind.name} blocks of {kind.block}")
    out = np.empty(values.size // kind.block * kind.block_bytes, dtype=np.uint8)
    out_chunk = CHUNK_VALUES // kind.block * kind.block_bytes
    for i, start in enumerate(range(0, values.size, CHUNK_VALUES)):
        chunk = _float32(values[start:start + CHUNK_VALUES], source)
        data = kernel(chunk.reshape(-1, kind.block)).reshape(-1)
        out[i * out_chunk:i * out_chunk + data.size] = data
    return out


def quantize(values: torch.Tensor, kind: GgmlType) -> torch.Tensor:
    """The GGUF bytes (1-D uint8 torch tensor) of float ``values`` (float32, float16 or bfloat16; other dtypes are
    made float32 first) as ``kind``; see :func:`quantize_array`."""
    import torch

    flat = values.detach().reshape(-1)
    if flat.dtype == torch.bfloat16:
        array, source = flat.contiguous().view(torch.int16).numpy().view(np.uint16), "BF16"
    elif flat.dtype in (torch.float16, torch.float32):
        array, source = flat.contiguous().numpy(), "F32"
    else:
        array, source = flat.to(torch.float32).contiguous().numpy(), "F32"
    return torch.from_numpy(quantize_array(array, source, kind))


def mxfp4_blocks(blocks: Array, scales: Array) -> Array:
    """ggml MXFP4 blocks (uint8, ``(n, 17)``) of gpt-oss MXFP4 ``blocks`` (uint8, ``(..., 16)``: code ``2j`` in the low
    nibble of byte ``j``, ``2j + 1`` in the high) and their e8m0 ``scales`` (uint8, ``blocks.shape[:-1]``): the scale
    byte, then 16 bytes holding codes ``j`` (low nibble) and ``j + 16`` (high), as llama.cpp's converter repacks them
    (``GptOssModel.repack_mxfp4``; ggml's e2m1 table is gpt-oss's doubled, and its scale half of e8m0's: the same
    values).

    >>> mxfp4_blocks(np.arange(16, dtype=np.uint8).reshape(1, 16), np.array([127], np.uint8))[0, :5].tolist()
    [127, 128, 0, 145, 0]
    """
    packed = blocks.reshape(-1, 16)
    codes = np.empty((packed.shape[0], 32), dtype=np.uint8)
    codes[:, 0::2] = packed & 0x0F
    codes[:, 1::2] = packed >> 4
    out = np.empty((packed.shape[0], 17), dtype=np.uint8)
    out[:, 0] = scales.reshape(-1)
    out[:, 1:] = codes[:, :16] | (codes[:, 16:] << 4)
    return out
