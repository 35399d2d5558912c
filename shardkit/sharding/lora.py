"""Adapters merged into their base as it streams: ``W + scale · (B @ A)`` band by band of rows.

:func:`merged_view` wraps a base source in a :class:`LoraSource`, the view every writing job reads
(:func:`~shardkit.sharding.job.split_source`): each weight an adapter changes becomes a computed tensor
(float32 from the base's band, then the output dtype, rounded once), every other tensor passes through
with its file offsets (still copied kernel-side). The adapters are held in memory; the base is read one
band of rows at a time, so memory does not depend on the base's size.

A pair may cover only some rows of a tensor (``LowRank.row0``: a diffusers module's part of an original
Flux file's fused ``qkv``); each band adds the rows of each product that fall in it.

The product of a tensor whose float32 delta fits :data:`WHOLE_DELTA_BYTES` is computed whole, as PEFT's
``merge_and_unload`` computes it, so an fp32 merge equals PEFT's bit for bit; a larger one is added band
by band (``addmm(W[rows], scale · B[rows], A)``), which may round differently in the last bit of float32.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from ..errors import InvalidInputError, Option
from ..formats.header import TensorEntry
from ..formats.json_types import JsonObject
from ..layouts.fp8 import matrix_shape
from ..layouts.registry import find_quant_layout
from ..sources import Source
from ..sources.dequantized import DequantizedSource, ViewSource, bytes_in_range, read_rows
from ..units import LOSSLESS_TARGETS, tensor_nbytes
from .lora_adapter import Adapter, LowRank, Replace, is_peft_folder, load_adapter, plan_merge
from .lora_original import Placement, is_original_flux, original_placements
from .options import WriteOptions
from .quant import source_config

if TYPE_CHECKING:
    import torch

    from .pipeline import PipelineResult

__all__ = ["WHOLE_DELTA_BYTES", "LoraSource", "merged_view"]

WHOLE_DELTA_BYTES = 64 * 2**20  # a delta up to this (float32) is computed whole, as PEFT does
BAND_BYTES = 8 * 2**20  # float32 bytes of one band of rows
_FLOATS = ("F32", "F16", "BF16", "F64")
TEXT_ENCODERS = ("text_encoder", "text_encoder_2")  # pipeline components a diffusion LoRA file may hold keys for


def merged_view(inner: Source, adapters: Sequence[str | os.PathLike[str]], *, scale: float = 1.0,
                options: WriteOptions, component: str | None = None) -> LoraSource:
    """``inner`` with ``adapters`` merged (in order), every check done before a byte is written.

    A quantized base (fp8 or fp4 with scales) is dequantized to float32 beneath the merge: written in
    ``options.dtype`` (bf16/fp16/fp32), or quantized again with ``options.quantize``
    (:func:`~shardkit.sharding.quant.quant_view` sees a plain checkpoint).

    Raises:
        InvalidInputError: a quantized base with neither, or an adapter that does not fit (:func:`plan_merge`).

    ``component`` names the pipeline component ``inner`` is, for a diffusion LoRA file's keys. A diffusion
    LoRA (diffusers' names) merged into an original Flux file adds each pair to its rows of the fused tensors
    (:mod:`shardkit.sharding.lora_original`).
    """
    config = source_config(inner)  # an SDXL UNet's block numbering, for kohya files
    inner = _dequantized(inner, options)
    names = frozenset(e.name for e in inner.entries())
    loaded = [load_adapter(path, base_config=config, component=component, base_names=names) for path in adapters]
    placements = None
    if is_original_flux(list(names)) and any(not is_peft_folder(path) for path in adapters):  # diffusers' names
        placements = original_placements(inner.entries(), where=inner.description)
    return LoraSource(inner, loaded, scale=scale, cast_to=options.cast_to, placements=placements)


def _dequantized(inner: Source, options: WriteOptions) -> Source:
    layout = find_quant_layout(inner.entries(), config=source_config(inner), metadata=inner.metadata(),
                               where=inner.description, allow_lossy=options.allow_lossy)
    if layout is None:
        return inner
    if options.cast_to not in LOSSLESS_TARGETS and options.quantize is None:
        raise InvalidInputError(f"{inner.description}: a LoRA merges into the plain weights of this {layout.describe()} "
                                "base; choose what to write: ", Option("dtype", "bf16"), " (or 'fp16', 'fp32'), or ",
                                Option("quantize", "fp8-block"), " "
                                "(or another scheme) to quantize the merged weights again")
    return DequantizedSource(inner, layout, "F32", allow_lossy=options.allow_lossy)


class LoraSource(ViewSource):
    """``inner`` with each weight the adapters change computed as ``W + Σ scale · (B @ A)`` (see the module)."""

    def __init__(self, inner: Source, adapters: Sequence[Adapter], *, scale: float = 1.0,
                 cast_to: str | None = None, placements: Mapping[str, tuple[Placement, ...]] | None = None) -> None:
        super().__init__(inner)
        base = inner.entries()
        self.plan = plan_merge(adapters, base, scale=scale, where=inner.description, placements=placements)
        self._by_name = {e.name: e for e in base}
        out = cast_to if cast_to in _FLOATS else None
        self._entries = [self._output_entry(e, out) for e in base]
        self._cache: tuple[str, list[torch.Tensor | None]] | None = None

    def _output_entry(self, entry: TensorEntry, cast_to: str | None) -> TensorEntry:
        if entry.name not in self.plan.updates:
            return entry
        dtype = cast_to or entry.dtype
        return TensorEntry(entry.name, dtype, entry.shape, tensor_nbytes(dtype, entry.shape))

    def entries(self) -> list[TensorEntry]:
        return list(self._entries)

    def read(self, entry: TensorEntry, begin: int, end: int) -> bytes | memoryview:
        if entry.name not in self.plan.updates:
            return self.inner.read(self._by_name[entry.name], begin, end)
        rows = matrix_shape(entry.shape)[0]
        row_bytes = entry.nbytes // max(1, rows)
        first = begin // row_bytes if row_bytes else 0
        last = min(rows, -(-end // row_bytes)) if row_bytes else rows
        bands = ((row0 * row_bytes, data) for row0, data in self._bands(entry, first, last))
        return bytes_in_range(bands, begin, end)

    def chunks(self, entry: TensorEntry, chunk_bytes: int) -> Iterator[bytes | memoryview]:
        if entry.name not in self.plan.updates:
            yield from self.inner.chunks(self._by_name[entry.name], chunk_bytes)
            return
        for _, data in self._bands(entry, 0, matrix_shape(entry.shape)[0]):
            yield data

    def _bands(self, entry: TensorEntry, first: int, last: int) -> Iterator[tuple[int, memoryview]]:
        """(first row, output bytes) of the merged rows ``first:last``, a band at a time."""
        import torch

        from ..formats.dtypes import to_torch

        stored = self._by_name[entry.name]
        cols = matrix_shape(stored.shape)[1]
        step = max(1, BAND_BYTES // max(1, cols * 4))
        compute = torch.float64 if stored.dtype == "F64" else torch.float32
        work = torch.empty(min(step, last - first) * cols, dtype=compute)  # one band's memory, reused (no page faults)
        for row0 in range(first, last, step):
            row1 = min(last, row0 + step)
            band = self._merged_band(work[: (row1 - row0) * cols].view(row1 - row0, cols), stored, row0, row1)
            data = band.to(to_torch(entry.dtype), copy=True).view(torch.uint8).numpy()  # never the reused buffer
            yield row0, data.data.cast("B")

    def _merged_band(self, into: torch.Tensor, stored: TensorEntry, row0: int, row1: int) -> torch.Tensor:
        """Rows ``row0:row1`` of ``stored`` with every update added, in float32 (``into``: the band's memory)."""
        rows, cols = matrix_shape(stored.shape)
        compute = into.dtype
        band: torch.Tensor | None = None
        for i, update in enumerate(self.plan.updates[stored.name]):
            if isinstance(update, Replace) and not update.add:  # modules_to_save: the base is not read
                band = into.copy_(update.value.reshape(rows, cols)[row0:row1])  # added to in place below
                continue
            if band is None:
                band = into.copy_(read_rows(self.inner, stored, row0, row1))
            if isinstance(update, Replace):  # lora_B.bias, added as PEFT adds it
                band = band + update.value.reshape(rows, cols)[row0:row1].to(compute) * update.scale
            else:
                self._add_delta(band, stored.name, i, update, cols, row0, row1, compute)
                band = _dora(band, update, row0, row1)
        return band if band is not None else read_rows(self.inner, stored, row0, row1).to(compute)

    def _add_delta(self, band: torch.Tensor, name: str, i: int, update: LowRank, cols: int, row0: int,
                   row1: int, compute: torch.dtype) -> None:
        """Add to ``band`` (rows ``row0:row1`` of the tensor), in place, the rows of ``scale · (B @ A)`` (transposed
        where the pair says so) that fall in it: the product covers rows ``update.row0`` on of the tensor.

        A delta up to :data:`WHOLE_DELTA_BYTES` is computed whole and added, in PEFT's order (bit-equal to its
        merge); a larger one is one fused ``addmm`` per band with the scale folded into B (a pass over the band
        instead of three; float32 rounding may differ from PEFT's in the last bit).
        """
        import torch

        first, last = max(row0, update.row0) - update.row0, min(row1, update.row0 + update.rows) - update.row0
        if first >= last:
            return  # this band holds none of the product's rows
        into = band[first + update.row0 - row0: last + update.row0 - row0]
        a, b = update.a.reshape(update.a.shape[0], -1).to(compute), update.b.to(compute)
        if update.rows * cols * 4 <= WHOLE_DELTA_BYTES:
            if self._cache is None or self._cache[0] != name:
                self._cache = (name, [None] * len(self.plan.updates[name]))
            deltas = self._cache[1]
            whole = deltas[i]
            if whole is None:
                product = _conv_product(update.a.to(compute), b) if _is_spatial_conv(update.a) else b @ a
                whole = deltas[i] = (product.T if update.transpose else product).mul_(update.scale)  # no copy
            into.add_(whole[first:last])
        elif update.transpose:  # rows of (B @ A)ᵀ: A[:, rows]ᵀ @ Bᵀ
            torch.addmm(into, a[:, first:last].T, (b * update.scale).T, out=into)
        else:
            torch.addmm(into, b[first:last] * update.scale, a, out=into)

    def report(self) -> JsonObject:
        """What was merged: per adapter its rank, alpha, scale and counts; the tensors changed."""
        return {"adapters": list(self.plan.reports), "tensors": len(self.plan.updates)}


def _is_spatial_conv(a: torch.Tensor) -> bool:
    """A Conv2d pair with a kernel larger than 1x1 (PEFT merges it as a convolution, not a matmul)."""
    return a.dim() == 4 and tuple(a.shape[2:]) != (1, 1)


def _conv_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``B ∘ A`` for a Conv2d pair as PEFT computes it (``conv2d(Aᵀ, B)ᵀ``), as an (out, in·k·k) matrix."""
    from torch.nn.functional import conv2d

    product = conv2d(a.transpose(0, 1), b.reshape(*b.shape, 1, 1)).transpose(0, 1)
    return product.reshape(product.shape[0], -1)


def _dora(merged: torch.Tensor, update: LowRank, row0: int, row1: int) -> torch.Tensor:
    """DoRA: the merged rows rescaled to the magnitude vector, ``m / norm(W + ΔW)`` per output row, as PEFT merges."""
    if update.magnitude is None:
        return merged
    import torch

    norm = torch.linalg.norm(merged, dim=1).to(merged.dtype)
    factor = update.magnitude[row0:row1].to(merged.dtype) / norm
    rescaled: torch.Tensor = factor.view(-1, 1) * merged
    return rescaled


def pipeline_lora(folder: str | os.PathLike[str], output: str, adapters: Sequence[str | os.PathLike[str]], *,
                  scale: float, options: WriteOptions, key: str | None) -> tuple[PipelineResult, dict[str, JsonObject]]:
    """A diffusers pipeline folder with diffusion LoRAs merged into its UNet (or transformer) and, where the
    files hold their keys, its text encoders; every other component and file written as
    :func:`~shardkit.sharding.pipeline.split_pipeline` writes them.

    Returns:
        The pipeline's result, and what was merged into each component changed (:meth:`LoraSource.report`).
    """
    from ..formats.layout import find_components
    from .job import refuse_output_inside_source
    from .pipeline import split_pipeline
    from .single_file import refuse_file_output

    names = {c.name for c in find_components(folder) if c.has_weights}
    target = next((n for n in ("unet", "transformer") if n in names), None)
    if target is None:
        raise InvalidInputError(f"{folder}: a LoRA merges into a pipeline's unet or transformer, and this one has "
                                f"neither ({', '.join(sorted(names))}); merge into a component folder instead")
    refuse_output_inside_source(folder, output)
    refuse_file_output(folder, output)
    merged: dict[str, LoraSource] = {}
    files_only = not any(is_peft_folder(path) for path in adapters)  # a PEFT adapter is the UNet's alone

    def view(name: str, src: Source) -> Source:
        if name != target and (name not in TEXT_ENCODERS or not files_only):
            return src
        merged[name] = merged_view(src, adapters, scale=scale, options=options, component=name)
        return merged[name]

    result = split_pipeline(folder, output, options=options, key=key, view=view)
    return result, {name: lora.report() for name, lora in merged.items() if lora.plan.updates}
