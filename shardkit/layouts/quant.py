"""What a quantized layout is to the stages that read, write and load it, whatever its format.

Each quantized entry of :data:`~shardkit.layouts.registry.LAYOUTS` (fp8 with scales, NVFP4, MXFP4) has a
strategy that maps names (:class:`~shardkit.layouts.table.LayoutStrategy`) and is a :class:`QuantStrategy`:
it dequantizes the checkpoints it reads (:meth:`QuantStrategy.dequantizer`) and quantizes the weights it
writes (:meth:`QuantStrategy.target`, :meth:`QuantStrategy.quantize_band`). Each stage has one code path
over this interface: :class:`shardkit.sources.dequantized.DequantizedSource` (a quantized checkpoint read
as the plain one), :class:`shardkit.sources.quantized.QuantizedSource` (a plain one written quantized) and
:mod:`shardkit.runtime.scaled_fp` (kept quantized in memory, dequantized per layer at compute). The
arithmetic stays in each format's own module (:mod:`~shardkit.layouts.fp8_math`, :mod:`~shardkit.layouts.fp4_math`).

Tensors reach the strategies through a :class:`TensorReader` (a checkpoint's files, or a module's tensors),
so the same bands are computed on disk and at compute, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ..formats.header import TensorEntry
from ..formats.json_types import JsonObject
from ..units import tensor_nbytes
from .fp8 import matrix_shape
from .table import Mapped

if TYPE_CHECKING:
    import torch

    from .fp4 import Fp4Layout
    from .fp8 import QuantLayout

__all__ = ["BandBytes", "DenseWeight", "Dequantizer", "QuantStrategy", "QuantTarget", "QuantizedTable", "TensorReader",
           "TensorsReader", "band_bytes", "dense_entries", "dense_tensor", "dequantized_mapped", "quantized_mapped", "quantized_table"]

BandBytes = bytes | memoryview


class TensorReader(Protocol):
    """Where a strategy reads stored tensors: whole (scales), or rows of the tensor seen as a matrix
    (:func:`~shardkit.layouts.fp8.matrix_shape`), in their stored dtypes."""

    def whole(self, name: str) -> torch.Tensor:
        """The tensor called ``name``."""
        ...

    def rows(self, name: str, row0: int, row1: int) -> torch.Tensor:
        """Rows ``row0:row1`` of ``name`` seen as a matrix, 2-D."""
        ...


class TensorsReader:
    """A :class:`TensorReader` over tensors in memory (a state dict, a module's parameters), found by ``lookup``."""

    def __init__(self, lookup: Callable[[str], torch.Tensor]) -> None:
        self.lookup = lookup

    def whole(self, name: str) -> torch.Tensor:
        return self.lookup(name).detach()

    def rows(self, name: str, row0: int, row1: int) -> torch.Tensor:
        found = self.whole(name)
        return found.reshape(matrix_shape(tuple(found.shape)))[row0:row1]


@dataclass(frozen=True)
class DenseWeight:
    """One quantized weight as the plain tensor it stands for.

    Attributes:
        stored: the tensor it is stored as (the fp8 weight, the packed fp4 tensor).
        name: the dense tensor's name (gpt-oss experts: ``X`` of ``X_blocks``; else ``stored``'s module's ``weight``).
        shape: the dense tensor's shape.
        scales: the tensors it is multiplied by (block scales, then a global scale).
    """

    stored: str
    name: str
    shape: tuple[int, ...]
    scales: tuple[str, ...]


class Dequantizer(Protocol):
    """The dense weights of one checkpoint's quantized layout, computed band by band."""

    @property
    def dropped_metadata(self) -> frozenset[str]:
        """Header metadata keys that describe the quantization (gone once dequantized)."""
        ...

    @property
    def side_files(self) -> frozenset[str]:
        """Side files that describe the quantization (gone once dequantized)."""
        ...

    def weights(self) -> tuple[DenseWeight, ...]:
        """Every quantized weight, in the checkpoint's order."""
        ...

    def broken(self, reader: TensorReader, *, where: str, allow_lossy: bool) -> frozenset[str]:
        """The stored weights whose scales cannot be used (passed through as stored, with ``allow_lossy``).

        Raises:
            InvalidInputError: unusable scales (NaN, infinity, fused scales that disagree), naming them.
        """
        ...

    def scale_problems(self, reader: TensorReader) -> list[tuple[str, str]]:
        """(stored weight, one line naming the tensor) per scale whose values cannot be used: NaN or infinite
        values, a zero divisor, fused per-tensor scales that disagree (what ``verify`` reports)."""
        ...

    def dense_bands(self, reader: TensorReader, weight: DenseWeight, out_dtype: torch.dtype, *,
                    first: int = 0) -> Iterator[tuple[int, torch.Tensor]]:
        """(element offset in the dense tensor, the band's values) for each band from the one holding ``first`` on."""
        ...


def dense_tensor(weights: Dequantizer, reader: TensorReader, weight: DenseWeight, dtype: torch.dtype) -> torch.Tensor:
    """The whole dense ``weight`` in ``dtype``, on its stored tensor's device, filled band by band (the temporaries
    are one band's; the result is the only full-size allocation)."""
    import torch

    out = torch.empty(weight.shape, dtype=dtype, device=reader.whole(weight.stored).device)
    flat = out.view(-1)
    for offset, band in weights.dense_bands(reader, weight, dtype):
        flat[offset:offset + band.numel()].view(band.shape).copy_(band)
    return out


@dataclass(frozen=True)
class QuantTarget:
    """One plain weight a quantizing strategy writes: the weight, and the tensors written for it.

    Attributes:
        source: the plain weight.
        written: the quantized tensor first, then its scales, in the order written.
    """

    source: TensorEntry
    written: tuple[TensorEntry, ...]


@runtime_checkable
class QuantStrategy(Protocol):
    """What a quantized layout's strategy does besides mapping names: read its checkpoints back as plain ones, and
    write plain weights in it."""

    @property
    def kept_to_bf16(self) -> bool:
        """Without ``dtype``, fp32 tensors the layout keeps are written in bf16 (the output stays smaller)."""
        ...

    @property
    def applies_to(self) -> str | None:
        """What the layout quantizes, when finding nothing is an error (None: nothing quantized is fine)."""
        ...

    def dequantizer(self, layout: QuantLayout | Fp4Layout, entries: Sequence[TensorEntry]) -> Dequantizer | None:
        """The dense weights of ``layout`` (found among ``entries``), or None when this strategy does not read it."""
        ...

    def target(self, entry: TensorEntry) -> QuantTarget | None:
        """What is written for ``entry``, or None when it is kept as it is."""
        ...

    def quantization_config(self, kept: Sequence[str]) -> JsonObject:
        """The ``quantization_config`` written, ``kept`` naming the modules left as they were."""
        ...

    def prepare(self, reader: TensorReader, target: QuantTarget) -> torch.Tensor | None:
        """What the bands need from the whole weight first (its absmax, a global scale), or None."""
        ...

    def source_bands(self, reader: TensorReader, target: QuantTarget) -> Iterator[torch.Tensor]:
        """The plain weight, band by band, as :meth:`quantize_band` takes it."""
        ...

    def quantize_band(self, band: torch.Tensor, target: QuantTarget,
                      prepared: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(quantized values, their scales) of one band."""
        ...

    def dequantize_band(self, q: torch.Tensor, scale: torch.Tensor, target: QuantTarget,
                        prepared: torch.Tensor | None) -> torch.Tensor:
        """One quantized band back in float32 (to measure the error)."""
        ...

    def side_bytes(self, target: QuantTarget, scales: Sequence[torch.Tensor],
                   prepared: torch.Tensor | None) -> tuple[BandBytes, ...]:
        """The bytes of ``target.written[1:]`` from every band's scales."""
        ...


def band_bytes(tensor: torch.Tensor) -> memoryview:
    """A host tensor's bytes as stored (flat, contiguous)."""
    import torch

    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data.cast("B")


@dataclass(frozen=True)
class QuantizedTable:
    """A plain table as a quantizing strategy writes it.

    Attributes:
        entries: every tensor written, in order (each quantized weight replaced by its ``written`` tensors).
        targets: the quantized weights.
        kept: the modules whose ≥2-D ``weight`` is kept as it was (``modules_to_not_convert`` / ``ignore``).
    """

    entries: tuple[TensorEntry, ...]
    targets: tuple[QuantTarget, ...]
    kept: tuple[str, ...]


def quantized_table(strategy: QuantStrategy, entries: Iterable[TensorEntry]) -> QuantizedTable:
    """``entries`` as ``strategy`` writes them."""
    written: list[TensorEntry] = []
    targets: list[QuantTarget] = []
    kept: list[str] = []
    for entry in entries:
        target = strategy.target(entry)
        if target is None:
            written.append(entry)
            if entry.name.endswith(".weight") and len(entry.shape) >= 2:
                kept.append(entry.name[: -len(".weight")])
        else:
            written += target.written
            targets.append(target)
    return QuantizedTable(tuple(written), tuple(targets), tuple(kept))


def quantized_mapped(strategy: QuantStrategy, plain: Mapped) -> Mapped:
    """A strategy's ``forward``: each weight it quantizes as the tensors it writes, and its ``quantization_config``."""
    table = quantized_table(strategy, plain.entries)
    return Mapped(table.entries, {**plain.config, "quantization_config": strategy.quantization_config(table.kept)})


def dense_entries(weights: Iterable[DenseWeight], entries: Iterable[TensorEntry], *, dropped: frozenset[str],
                  dtype: str) -> list[TensorEntry]:
    """``entries`` dequantized to ``dtype``: each stored weight of ``weights`` as its dense tensor, ``dropped`` gone."""
    dense = {w.stored: w for w in weights}
    return [TensorEntry(w.name, dtype, w.shape, tensor_nbytes(dtype, w.shape)) if (w := dense.get(e.name)) else e
            for e in entries if e.name not in dropped]


def dequantized_mapped(stored: Mapped, weights: Dequantizer | None, extra: frozenset[str]) -> Mapped:
    """A strategy's ``inverse``: what dequantizing to bf16 gives (as ``convert dtype='bf16'``), ``extra`` (scales,
    markers) and the ``quantization_config`` gone; ``stored`` itself when the strategy does not read it."""
    if weights is None:
        return stored
    return Mapped(tuple(dense_entries(weights.weights(), stored.entries, dropped=extra, dtype="BF16")),
                  {k: v for k, v in stored.config.items() if k != "quantization_config"})
