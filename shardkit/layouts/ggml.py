"""ggml tensor types: dequantize GGUF blocks to float32 (torch, here), quantize float values to GGUF blocks
(numpy, :mod:`shardkit.layouts.ggml_quantize`).

Each kernel follows ``gguf.quants`` (llama.cpp's gguf-py, itself checked against ggml's C code) step for
step in the same float32/float64 arithmetic, so the results are bit-equal to it (the tests compare them):

=========  ==========  ========  =====================================================
type       dequantize  quantize  block
=========  ==========  ========  =====================================================
F32, F16   yes         yes       1 value (F16 by ``astype``, as gguf does)
BF16       yes         yes       1 value (round to nearest even, NaN quieted, as ggml)
Q8_0       yes         yes       32 values: f16 scale, 32 int8
Q4_0       yes         yes       32 values: f16 scale, 16 bytes of nibbles (−8 offset)
Q4_1       yes         yes       32 values: f16 scale and min, 16 bytes of nibbles
Q5_0       yes         yes       32 values: f16 scale, 32 high bits, 16 bytes of nibbles
Q5_1       yes         yes       32 values: f16 scale and min, 32 high bits, 16 bytes of nibbles
Q2_K       yes         no        256 values: 4-bit scales/mins, 2-bit values, f16 d and dmin
Q3_K       yes         no        256 values: high-bit mask, 2-bit values, 6-bit scales, f16 d
Q4_K       yes         no        256 values: f16 d, dmin, 12 bytes of 6-bit scales/mins, nibbles
Q5_K       yes         no        as Q4_K plus 32 bytes of high bits
Q6_K       yes         no        256 values: low nibbles, 2 high bits, int8 scales, f16 d
=========  ==========  ========  =====================================================

torch is imported inside the functions (``import shardkit`` stays light).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import InvalidInputError
from ..formats.gguf import GgmlType
from .ggml_quantize import QUANTIZABLE, quantize  # the writing half, in numpy (gguf-py's own kernels)

if TYPE_CHECKING:
    import torch

__all__ = ["DEQUANTIZABLE", "QUANTIZABLE", "dequantize", "quantize"]

QK_K = 256


def _f16(raw: torch.Tensor) -> torch.Tensor:
    import torch

    return raw.contiguous().view(torch.float16).to(torch.float32)


def _f16_at(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The f16 field at byte ``at`` (even) of every block, as float32 ``(n_blocks, 1)``: one int16 column, no byte copy."""
    import torch

    return blocks.view(torch.int16)[:, at // 2].contiguous().view(torch.float16).to(torch.float32).reshape(-1, 1)


def _nibble_values(qs: torch.Tensor, n_blocks: int, offset: int) -> torch.Tensor:
    """Low nibbles of each row of ``qs`` then the high ones, minus ``offset``, as float32 (a 256-entry table)."""
    import torch

    table = torch.tensor([[b & 15, b >> 4] for b in range(256)], dtype=torch.float32) - offset
    pairs = torch.nn.functional.embedding(qs.to(torch.int64), table)  # (n, bytes, 2)
    return pairs.transpose(1, 2).reshape(n_blocks, -1)


def _nibbles(qs: torch.Tensor, n_blocks: int, half: int) -> torch.Tensor:
    """Low nibbles of each group of ``half`` bytes, then the high nibbles: ``(n_blocks, -1)`` uint8."""
    import torch

    qs = qs.reshape(n_blocks, -1, 1, half) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
    return (qs & 0x0F).reshape(n_blocks, -1)


def _bits(raw: torch.Tensor, n_blocks: int, count: int) -> torch.Tensor:
    """Bits 0..count-1 of each little-endian uint32 of ``raw`` (n_blocks, 4): ``(n_blocks, count)`` uint8."""
    import torch

    word = raw.contiguous().view(torch.int32).to(torch.int64).reshape(n_blocks, 1) & 0xFFFFFFFF
    return ((word >> torch.arange(count, dtype=torch.int64).reshape(1, count)) & 1).to(torch.uint8)


def _deq_f32(blocks: torch.Tensor) -> torch.Tensor:
    import torch

    return blocks.contiguous().view(torch.float32)


def _deq_f16(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks)


def _deq_bf16(blocks: torch.Tensor) -> torch.Tensor:
    import torch

    return (blocks.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)


def _deq_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    import torch

    return blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32) * _f16_at(blocks, 0)


def _deq_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return _f16_at(blocks, 0) * _nibble_values(blocks[:, 2:], blocks.shape[0], 8)


def _deq_q4_1(blocks: torch.Tensor) -> torch.Tensor:

    return (_f16_at(blocks, 0) * _nibble_values(blocks[:, 4:], blocks.shape[0], 0)) + _f16_at(blocks, 2)


def _deq_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    import torch

    n = blocks.shape[0]
    qh = _bits(blocks[:, 2:6], n, 32)
    ql = _nibbles(blocks[:, 6:], n, 16)
    qs = (ql | (qh << 4)).to(torch.int8) - 16
    return _f16_at(blocks, 0) * qs.to(torch.float32)


def _deq_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    import torch

    n = blocks.shape[0]
    qs = (_nibbles(blocks[:, 8:], n, 16) | (_bits(blocks[:, 4:8], n, 32) << 4)).to(torch.float32)
    return (_f16_at(blocks, 0) * qs) + _f16_at(blocks, 2)


def _deq_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    import torch

    n = blocks.shape[0]
    scales = blocks[:, :16]
    dl = (_f16_at(blocks, 80) * (scales & 0xF).to(torch.float32)).reshape(n, QK_K // 16, 1)
    ml = (_f16_at(blocks, 82) * (scales >> 4).to(torch.float32)).reshape(n, QK_K // 16, 1)
    shift = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    qs = ((blocks[:, 16:80].reshape(n, -1, 1, 32) >> shift) & 3).reshape(n, QK_K // 16, 16).to(torch.float32)
    return (dl * qs - ml).reshape(n, -1)


def _deq_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    import torch

    n = blocks.shape[0]
    hmask, qs, scales = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108]
    low = (scales[:, :8].reshape(n, 1, 8) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 2, 1)).reshape(n, 16)
    high = (scales[:, 8:].reshape(n, 1, 4) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 4, 1))
    sc = (low & 0x0F) | ((high.reshape(n, 16) & 0x03) << 4)
    dl = (_f16_at(blocks, 108) * (sc.to(torch.int8) - 32).to(torch.float32)).reshape(n, 16, 1)
    ql = (qs.reshape(n, -1, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1))
    qh = (hmask.reshape(n, -1, 1, 32) >> torch.arange(8, dtype=torch.uint8).reshape(1, 1, 8, 1))
    ql, qh = ql.reshape(n, 16, QK_K // 16) & 3, (qh.reshape(n, 16, QK_K // 16) & 1) ^ 1
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).to(torch.float32)
    return (dl * q).reshape(n, QK_K)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's eight 6-bit scales and mins from 12 bytes (as ``gguf.quants.Q4_K.get_scale_min``)."""
    import torch

    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, m_d = s[:, 0:1], s[:, 1:2], s[:, 2:3]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.reshape(n, 8), mn.reshape(n, 8)


def _deq_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    import torch

    n = blocks.shape[0]
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    d = (_f16_at(blocks, 0) * sc.to(torch.float32)).reshape(n, -1, 1)
    dm = (_f16_at(blocks, 2) * mn.to(torch.float32)).reshape(n, -1, 1)
    qs = _nibble_values(blocks[:, 16:].reshape(n * 4, 32), n * 4, 0).reshape(n, -1, 32)
    return (d * qs - dm).reshape(n, QK_K)


def _deq_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    import torch

    n = blocks.shape[0]
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    d = (_f16_at(blocks, 0) * sc.to(torch.float32)).reshape(n, -1, 1)
    dm = (_f16_at(blocks, 2) * mn.to(torch.float32)).reshape(n, -1, 1)
    qh = blocks[:, 16:48].reshape(n, -1, 1, 32) >> torch.arange(8, dtype=torch.uint8).reshape(1, 1, 8, 1)
    ql = _nibbles(blocks[:, 48:], n, 32).reshape(n, -1, 32)
    q = (ql | ((qh & 1).reshape(n, -1, 32) << 4)).to(torch.float32)
    return (d * q - dm).reshape(n, QK_K)


def _deq_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    import torch

    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = (_f16_at(blocks, 208) * scales).reshape(n, QK_K // 16, 1)
    ql = _nibbles(ql, n, 64).reshape(n, -1, 32)
    qh = (qh.reshape(n, -1, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)) & 0x03
    q = (ql | (qh.reshape(n, -1, 32) << 4)).to(torch.int8) - 32
    return (d * q.reshape(n, QK_K // 16, -1).to(torch.float32)).reshape(n, QK_K)


_DEQUANTIZE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "F32": _deq_f32, "F16": _deq_f16, "BF16": _deq_bf16, "Q8_0": _deq_q8_0, "Q4_0": _deq_q4_0, "Q4_1": _deq_q4_1,
    "Q5_0": _deq_q5_0, "Q5_1": _deq_q5_1, "Q2_K": _deq_q2_k, "Q3_K": _deq_q3_k, "Q4_K": _deq_q4_k, "Q5_K": _deq_q5_k,
    "Q6_K": _deq_q6_k,
}
DEQUANTIZABLE = frozenset(_DEQUANTIZE)


def dequantize(raw: bytes | bytearray | memoryview, kind: GgmlType) -> torch.Tensor:
    """The float32 values (1-D torch tensor) of whole blocks of ``kind`` in ``raw``.

    Raises:
        InvalidInputError: a type this module does not dequantize, or a partial block.
    """
    import torch

    if kind.name not in _DEQUANTIZE:
        raise InvalidInputError(f"ggml type {kind.name}: shardkit dequantizes {', '.join(_DEQUANTIZE)}; convert this "
                                "file with llama.cpp's tools first")
    if len(raw) % kind.block_bytes:
        raise InvalidInputError(f"{len(raw)} bytes are not whole {kind.name} blocks of {kind.block_bytes} bytes")
    blocks = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(-1, kind.block_bytes) if len(raw) else \
        torch.empty((0, kind.block_bytes), dtype=torch.uint8)
    return _DEQUANTIZE[kind.name](blocks).reshape(-1)
