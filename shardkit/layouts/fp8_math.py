"""fp8 with scales, the arithmetic: dequantize a band of rows, quantize one (torch is imported lazily).

Dequantization is ``weight.to(float32) × scale.to(float32)``, then the output dtype: the same
operations, in the same order, as transformers' ``Fp8Dequantize``, so a weight dequantized here equals
the one its loader builds bit for bit. e4m3fn and e4m3fnuz are both read by torch's own conversion
(fnuz: the byte 0x80 is NaN and the largest value 240). e8m0 scales (``float8_e8m0fnu``, or ``uint8``
exponents with ``scale_fmt: "ue8m0"``) are powers of two: ``2 ** (byte - 127)``.

Quantization is absmax: each tensor's / row's / block's largest magnitude maps to 448 (e4m3fn),
``q = clamp(w × 448 / absmax).to(e4m3fn)`` and the stored scale is ``1 / (448 / absmax)``, again as
transformers' ``Fp8Quantize`` computes it. All functions take and return one band of rows.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from ..errors import InvalidInputError, Option
from ..formats.dtypes import to_torch
from ..formats.header import TensorEntry
from .fp8 import COMFY_METADATA_KEY, QuantLayout, ScaledWeight, find_layout, matrix_shape
from .quant import DenseWeight, TensorReader, TensorsReader, dense_tensor

if TYPE_CHECKING:
    import torch

__all__ = ["E4M3_MAX", "Fp8Dequantizer", "band_rows", "dequantize_band", "dequantize_state_dict", "quantize_band", "refuse_disagreeing",
           "scale_to_float32", "state_dict_entries", "tensor_from_bytes"]

E4M3_MAX = 448.0
BAND_BYTES = 16 * 2**20  # float32 bytes of one band of rows (bounds memory whatever the tensor's size)


def tensor_from_bytes(raw: bytes | bytearray | memoryview, dtype_code: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over a copy of ``raw`` (little-endian, as stored), in its stored dtype."""
    import torch

    data = bytearray(raw)
    if not data:
        return torch.empty(shape, dtype=to_torch(dtype_code))
    return torch.frombuffer(data, dtype=to_torch(dtype_code)).reshape(shape)


def scale_to_float32(scale: torch.Tensor, *, name: str | None = None) -> torch.Tensor:
    """A scale tensor as float32 multipliers (uint8 holds e8m0 exponents); NaN or infinite values are refused."""
    import torch

    factors = _factors(scale)
    if not bool(torch.isfinite(factors).all()):
        raise InvalidInputError(f"scale {name or 'tensor'} holds NaN or infinite values (as float32 multipliers); "
                                "the checkpoint is corrupt: re-export it")
    return factors


def _factors(scale: torch.Tensor) -> torch.Tensor:
    import torch

    return (scale.to(torch.float32) - 127.0).exp2() if scale.dtype == torch.uint8 else scale.to(torch.float32)


def band_rows(weight: ScaledWeight, cols: int, *, whole_blocks: bool = False) -> int:
    """Rows per band: about :data:`BAND_BYTES` of float32, a whole number of scale blocks when one fits.

    With ``whole_blocks`` (quantizing: each block's absmax needs all its rows) a band is at least one block
    of rows, over the budget for a weight wider than ``BAND_BYTES / (4 × block rows)`` columns; without it
    (dequantizing, a block read from a checkpoint may be huge) such a block is cut and its scale gathered.
    """
    step = weight.block[0] if weight.granularity == "block" else 1
    fit = max(1, BAND_BYTES // max(1, cols * 4))
    if fit >= step or whole_blocks:
        return max(1, fit // step) * step
    return fit


def dequantize_band(q: torch.Tensor, scale: torch.Tensor, weight: ScaledWeight, row0: int,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """Rows ``row0 : row0 + len(q)`` of the dequantized weight (``q``: those rows, 2-D, as stored).

    Args:
        q: the band of the stored weight, shaped (rows, columns).
        scale: the whole scale tensor, float32 (:func:`scale_to_float32`).
        weight: the weight's :class:`~shardkit.layouts.fp8.ScaledWeight`.
        row0: the band's first row.
        out_dtype: the dtype written.
    """
    import torch

    values = q.to(torch.float32)
    rows, cols = values.shape
    b0, b1 = weight.block
    if weight.granularity == "block" and row0 % b0 == 0 and rows % b0 == 0 and cols % b1 == 0:
        grid = scale.reshape(scale.shape[0], -1)[row0 // b0: row0 // b0 + rows // b0]  # broadcast, not expanded
        blocks = values.reshape(rows // b0, b0, cols // b1, b1) * grid[:, None, :, None]
        return blocks.reshape(rows, cols).to(out_dtype)
    return (values * _band_scale(scale, weight, row0, values.shape)).to(out_dtype)


def _band_scale(scale: torch.Tensor, weight: ScaledWeight, row0: int, shape: torch.Size) -> torch.Tensor:
    rows, cols = shape
    if weight.granularity in ("tensor", "fused"):  # fused: only used once every value agrees
        return scale.reshape(-1)[0]
    if weight.granularity == "channel":
        return scale.reshape(-1)[row0:row0 + rows].reshape(rows, 1)
    import torch

    b0, b1 = weight.block
    grid = scale.reshape(scale.shape[0], -1)
    # gathered, never expanded block by block: memory is the band's, whatever the block size
    return grid[torch.arange(row0, row0 + rows) // b0][:, torch.arange(cols) // b1]


def quantize_band(w: torch.Tensor, granularity: str, *, block: tuple[int, int] = (128, 128),
                  absmax: torch.Tensor | None = None,
                  scale_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(``q`` as e4m3fn, scale in ``scale_dtype``, float32 by default) of a band of rows ``w`` (2-D float32).

    ``granularity``: ``"block"`` (the band's rows a multiple of ``block[0]``, columns of ``block[1]``),
    ``"channel"`` (one scale per row), or ``"tensor"`` with the whole tensor's ``absmax`` given.
    The scale's shape: blocks ``(rows/b0, cols/b1)``, channel ``(rows, 1)``, tensor ``(1,)``. ``q`` is
    computed with the scale as stored (rounded to ``scale_dtype``), so q × scale is what was meant.
    """
    import torch

    rows, cols = w.shape
    if granularity == "block":
        b0, b1 = block
        tiles = w.reshape(rows // b0, b0, cols // b1, b1)
        scale = _scale(tiles.abs().amax(dim=(1, 3)), scale_dtype)
        q = tiles / scale.to(torch.float32)[:, None, :, None]
    elif granularity == "channel":
        scale = _scale(w.abs().amax(dim=1, keepdim=True), scale_dtype)
        q = w / scale.to(torch.float32)
    else:
        scale = _scale((absmax if absmax is not None else w.abs().amax()).reshape(1), scale_dtype)
        q = w / scale.to(torch.float32)
    return q.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(rows, cols), scale


def _scale(absmax: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The stored scale of an absmax: ``1 / (448 / absmax)`` as transformers' Fp8Quantize computes it (1 for an
    all-zero block), rounded to ``dtype``."""
    import torch

    absmax = absmax.to(torch.float32)
    mult = torch.where(absmax > 0, E4M3_MAX / torch.where(absmax > 0, absmax, torch.ones_like(absmax)),
                       torch.ones_like(absmax))
    return (1.0 / mult).to(dtype or torch.float32)


def refuse_disagreeing(fused: Mapping[str, torch.Tensor], *, where: str) -> None:
    """Several per-tensor scales on one fused weight (qkv) are usable only when they agree.

    Args:
        fused: scale name → its values (float32), for the weights of ``"fused"`` granularity.
    """
    disagree = [f"{name} {[round(float(v), 6) for v in values.reshape(-1)[:4]]}" for name, values in fused.items()
                if not bool((values == values.reshape(-1)[0]).all())]
    if disagree:
        raise InvalidInputError(f"{where}: fused per-tensor scales disagree ({'; '.join(disagree[:3])}): which rows "
                                "each one scales is not recorded, so the weights cannot be dequantized (copy the "
                                "checkpoint as is, without ", Option("dtype"), ")")


class Fp8Dequantizer:
    """The dense weights of an fp8 layout (a :class:`~shardkit.layouts.quant.Dequantizer`): weight × scale, band
    by band of rows, a whole number of scale blocks at a time."""

    dropped_metadata = frozenset({COMFY_METADATA_KEY})
    side_files: frozenset[str] = frozenset()

    def __init__(self, layout: QuantLayout, entries: Sequence[TensorEntry]) -> None:
        shapes = {e.name: tuple(e.shape) for e in entries}
        self.layout = layout
        self._scaled = {w.weight: w for w in layout.weights}
        self._weights = tuple(DenseWeight(w.weight, w.weight, shapes[w.weight], (w.scale,)) for w in layout.weights)

    def weights(self) -> tuple[DenseWeight, ...]:
        return self._weights

    def broken(self, reader: TensorReader, *, where: str, allow_lossy: bool) -> frozenset[str]:
        """None: several per-tensor scales on one (fused) weight that disagree are refused, even with ``allow_lossy``."""
        refuse_disagreeing({w.scale: scale_to_float32(reader.whole(w.scale), name=w.scale)
                            for w in self.layout.weights if w.granularity == "fused"}, where=where)
        return frozenset()

    def scale_problems(self, reader: TensorReader) -> list[tuple[str, str]]:
        """Scales holding NaN or infinity (as float32 multipliers), fused per-tensor scales that disagree."""
        import torch

        problems = []
        for w in self.layout.weights:
            factors = _factors(reader.whole(w.scale))
            if not bool(torch.isfinite(factors).all()):
                problems.append((w.weight, f"scale {w.scale} of {w.weight} holds non-finite values"))
            elif w.granularity == "fused" and not bool((factors == factors.reshape(-1)[0]).all()):
                problems.append((w.weight, f"fused per-tensor scales {w.scale} of {w.weight} disagree: which rows each "
                                           "one scales is not recorded"))
        return problems

    def dense_bands(self, reader: TensorReader, weight: DenseWeight, out_dtype: torch.dtype, *,
                    first: int = 0) -> Iterator[tuple[int, torch.Tensor]]:
        scaled = self._scaled[weight.stored]
        rows, cols = matrix_shape(weight.shape)
        scale = scale_to_float32(reader.whole(scaled.scale), name=scaled.scale)
        step = band_rows(scaled, cols)
        for row0 in range(first // max(1, cols) // step * step, rows, step):
            band = reader.rows(scaled.weight, row0, min(rows, row0 + step))
            yield row0 * cols, dequantize_band(band, scale, scaled, row0, out_dtype)


def state_dict_entries(tensors: Mapping[str, torch.Tensor]) -> list[TensorEntry]:
    """The header records (name, dtype code, shape, bytes) of an in-memory state dict."""
    from ..formats.dtypes import from_torch

    return [TensorEntry(n, from_torch(t.dtype), tuple(t.shape), t.numel() * t.element_size()) for n, t in tensors.items()]


def dequantize_state_dict(tensors: Mapping[str, torch.Tensor], *, out_dtype: torch.dtype,
                          metadata: Mapping[str, str] | None = None,
                          where: str = "checkpoint") -> tuple[dict[str, torch.Tensor], QuantLayout | None]:
    """An in-memory state dict with its scaled weights dequantized and its scales and markers dropped.

    For the callers that need whole tensors (diffusers' single-file key mapping): each scaled weight
    becomes a new ``out_dtype`` tensor; every other tensor is passed through as is (still mapped).
    Without scale tensors, ``tensors`` is returned unchanged with a None layout.

    Raises:
        InvalidInputError: as :func:`~shardkit.layouts.fp8.find_layout`, or fused scales that disagree.
    """
    entries = state_dict_entries(tensors)
    layout = find_layout(entries, metadata=metadata, where=where)
    if layout is None:
        return dict(tensors), None
    weights, reader = Fp8Dequantizer(layout, entries), TensorsReader(tensors.__getitem__)
    weights.broken(reader, where=where, allow_lossy=False)
    out = {n: t for n, t in tensors.items() if n not in layout.extra}
    out.update({w.name: dense_tensor(weights, reader, w, out_dtype) for w in weights.weights()})
    return out, layout
