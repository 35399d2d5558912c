"""The bytes of a GGUF file ``convert --to gguf`` writes: its header, then each tensor band by band of rows.

A tensor's bytes are copied when the source holds them in the ggml type written (a GGUF source's quantized
tensors, or F32/F16/BF16 unchanged), else read as float32 values, permuted (Llama's q/k rows), shifted (Gemma's
norms) and quantized (:func:`shardkit.layouts.ggml.quantize`); memory never depends on a tensor's size. A tensor
taken from part of its source (:class:`~shardkit.layouts.gguf_arch.Piece`: gpt-oss's interleaved gate/up rows, its
dense experts transposed, one expert at a time) is quantized the same way; an MXFP4 pair (``X_blocks``, ``X_scales``)
is repacked band by band into ggml MXFP4 blocks, its values unchanged
(:func:`shardkit.layouts.ggml_quantize.mxfp4_blocks`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import InvalidInputError
from ..formats.gguf import ggml_type, padded
from ..formats.header import TensorEntry
from ..layouts.gguf_arch import Piece
from ..sources import Source
from ..sources.gguf import GgufSource
from .options import ProgressCallback
from .writer import write_all

__all__ = ["BAND_BYTES", "PlannedTensor", "tensor_bytes", "write_gguf_file"]

BAND_BYTES = 16 * 2**20


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of the GGUF file to write: where it comes from and what it becomes."""

    entry: TensorEntry   # in the source (HF names)
    name: str            # in the GGUF file
    kind: str            # ggml type written
    heads: int | None    # q/k permutation
    data: bytes | None = None  # a tensor the converter computes (Llama 3.1's rope_freqs.weight), not in the source
    parts: tuple[TensorEntry, ...] = ()  # stacked experts: the source tensors, expert 0 first (``entry`` their stack)
    shift: float = 0.0   # added to the values before quantizing
    piece: Piece | None = None  # part of its source (``parts``: the source tensor, or an MXFP4 pair's blocks and scales)


def write_gguf_file(path: str, head: bytes, tensors: list[PlannedTensor], src: Source, *,
                    progress: ProgressCallback | None) -> None:
    """``head`` then every tensor's bytes, each padded to the alignment, into ``path`` (created or emptied), synced."""
    total = sum(t.entry.nbytes for t in tensors)
    done = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, head, path)
        for t in tensors:
            written = 0
            for data in tensor_bytes(t, src):
                write_all(fd, data, path)
                written += len(data)
            write_all(fd, b"\0" * (padded(written) - written), path)
            done += t.entry.nbytes
            if progress is not None:
                progress(done, total)
        os.fsync(fd)
    finally:
        os.close(fd)


def tensor_bytes(t: PlannedTensor, src: Source) -> Iterator[bytes | memoryview]:
    """The GGUF bytes of one tensor, band by band of rows: copied (same ggml type) or quantized; stacked experts
    one after another (rows stay whole, so their blocks are the stack's)."""
    if t.data is not None:
        yield t.data
        return
    if t.piece is not None and t.piece.mxfp4:
        yield from _mxfp4_bytes(t.piece, t.parts[0], t.parts[1], src)
        return
    if t.piece is not None:
        yield from _piece_bytes(t, t.parts[0], src)
        return
    for entry in t.parts or (t.entry,):
        yield from _entry_bytes(t, entry, src)


def _entry_bytes(t: PlannedTensor, entry: TensorEntry, src: Source) -> Iterator[bytes | memoryview]:
    import torch

    from ..layouts.fp8 import matrix_shape
    from ..layouts.ggml import quantize
    from ..layouts.gguf_names import permute_rows
    from ..sources.dequantized import read_rows

    if isinstance(src, GgufSource) and src.names[entry.name].kind.name == t.kind:
        stored = src.names[entry.name]
        for begin in range(0, stored.nbytes, BAND_BYTES):
            yield src.stored_bytes(stored, begin, min(stored.nbytes, begin + BAND_BYTES))
        return
    if entry.dtype == t.kind and t.heads is None and not t.shift:  # same type, same order: the bytes as stored
        for begin in range(0, entry.nbytes, BAND_BYTES):
            yield src.read(entry, begin, min(entry.nbytes, begin + BAND_BYTES))
        return
    rows, cols = matrix_shape(entry.shape)
    step = max(1, BAND_BYTES // (4 * max(1, cols)))
    if t.heads is not None:
        per_head = rows // t.heads
        if rows % t.heads or per_head % 2:
            raise InvalidInputError(f"tensor {entry.name}: {rows} rows are not {t.heads} heads of even size")
        step = max(per_head, step // per_head * per_head)
    kind = ggml_type(t.kind)
    for row0 in range(0, rows, step):
        values = read_rows(src, entry, row0, min(rows, row0 + step))  # widened to float32 as it is quantized
        if t.shift:  # in the source's float16/float32, else float32, as the converter adds it
            values = (values if values.dtype in (torch.float16, torch.float32) else values.float()) + t.shift
        if t.heads is not None:
            values = permute_rows(values, values.shape[0] // (rows // t.heads))
        yield quantize(values, kind).numpy().data


def _mxfp4_bytes(piece: Piece, blocks: TensorEntry, scales: TensorEntry, src: Source) -> Iterator[bytes | memoryview]:
    """ggml MXFP4 blocks of the output rows ``piece.first::piece.step`` of an MXFP4 pair (blocks (E, R, G, 16), scales
    (E, R, G)), band by band of rows (R is a multiple of the step, so the pick runs across experts)."""
    import numpy as np

    from ..layouts.ggml_quantize import mxfp4_blocks

    rows = blocks.shape[0] * blocks.shape[1]
    groups = blocks.shape[2]
    step = max(piece.step, BAND_BYTES // (groups * 16) // piece.step * piece.step)
    for row0 in range(0, rows, step):
        row1 = min(rows, row0 + step)
        b = np.frombuffer(_read(src, blocks, row0 * groups * 16, row1 * groups * 16), np.uint8).reshape(-1, groups, 16)
        s = np.frombuffer(_read(src, scales, row0 * groups, row1 * groups), np.uint8).reshape(-1, groups)
        yield mxfp4_blocks(b[piece.first::piece.step], s[piece.first::piece.step]).data


def _piece_bytes(t: PlannedTensor, entry: TensorEntry, src: Source) -> Iterator[bytes | memoryview]:
    """The output features ``first::step`` of ``entry`` (its last dimension), each expert's matrix transposed
    (``transpose``: (E, in, out) read one expert at a time), quantized."""
    import math

    from ..layouts.fp8_math import tensor_from_bytes
    from ..layouts.ggml import quantize

    assert t.piece is not None
    cols = entry.shape[-1] if entry.shape else 1
    rows = math.prod(entry.shape[:-1])
    row_bytes = entry.nbytes // max(1, rows)
    step = entry.shape[1] if t.piece.transpose else max(1, BAND_BYTES // max(1, row_bytes))
    kind = ggml_type(t.kind)
    for row0 in range(0, rows, step):
        row1 = min(rows, row0 + step)
        values = tensor_from_bytes(_read(src, entry, row0 * row_bytes, row1 * row_bytes), entry.dtype, (row1 - row0, cols))
        values = values[:, t.piece.first::t.piece.step]
        yield quantize(values.T.contiguous() if t.piece.transpose else values.contiguous(), kind).numpy().data


def _read(src: Source, entry: TensorEntry, begin: int, end: int) -> bytes | bytearray | memoryview:
    raw = src.read(entry, begin, end)
    if len(raw) != end - begin:
        raise InvalidInputError(f"{src.description}: short read of {entry.name} bytes {begin}:{end} ({len(raw)} bytes; "
                                "file truncated?)")
    return raw
