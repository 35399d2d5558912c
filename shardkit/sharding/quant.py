"""What a writing job does with fp8 scales: copy them whole, dequantize, or quantize (one decision).

Every job (split, convert, save_sharded, pipeline components, single-file outputs) plans through
:func:`~shardkit.sharding.job.plan_job`, which asks :func:`quant_view` for the source to write:

============================  ==============  ==========================================================
source                        options         written
============================  ==============  ==========================================================
fp8 with scales (any layout)  no ``dtype``     as is: fp8 weights, scales in their own dtype, config kept
fp8 with scales               bf16/fp16/fp32  weight × scale in that dtype; scales, markers and
                                              ``quantization_config`` gone (:class:`DequantizedSource`)
fp8 with scales               fp8 / quantize  refused: it is quantized already
plain                         ``quantize``    fp8 + scales and ``quantization_config`` (:class:`QuantizedSource`)
============================  ==============  ==========================================================

Scale tensors are never cast by ``dtype`` (:func:`quant_view` names them), so a checkpoint is never
half-converted.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ..errors import InvalidInputError, Option, join_parts
from ..formats.gguf import GGUF_QUANTIZE
from ..formats.json_types import JsonObject
from ..formats.layout import read_config
from ..layouts.fp4 import Fp4Layout
from ..layouts.fp8 import FP8_DTYPES, find_layout
from ..layouts.registry import find_quant_layout, quant_config
from ..sources import Source
from ..sources.dequantized import DequantizedSource
from ..sources.gguf import find_gguf
from ..sources.quantized import QuantizedSource
from ..units import LOSSLESS_TARGETS
from .options import WriteOptions, warn

if TYPE_CHECKING:
    import torch

__all__ = ["config_edits", "dequantized_for_mapping", "dropped_side_files", "kept_cast", "quant_report", "quant_view",
           "written_view"]
VIEWS = (DequantizedSource, QuantizedSource)

_FP8_CASTS = FP8_DTYPES | {"F8_E8M0"}  # plain fp8 casts: the fp8 dtypes and e8m0
_WIDE = frozenset({"F32", "F64"})


def quant_view(src: Source, *, options: WriteOptions) -> tuple[Source, frozenset[str]]:
    """The source a job writes for ``src`` under ``options``, and the names ``dtype`` must not cast.

    Raises:
        InvalidInputError: an inconsistent scaled checkpoint (see :func:`~shardkit.layouts.fp8.find_layout`),
            or a scaled one asked for fp8 or ``quantize``.
    """
    if options.quantize in GGUF_QUANTIZE:
        raise InvalidInputError(Option("quantize", options.quantize),
                                " is a GGUF type, which only convert writes, with ",
                                Option("to", "gguf"), " and an OUTPUT ending in .gguf (safetensors outputs take ",
                                Option("quantize", "fp8-block", choices=("fp8-channel", "fp8-tensor", "nvfp4",
                                                                         "mxfp4")), ")")
    gguf = find_gguf(src)
    if gguf is not None:  # ggml-quantized tensors: dequantized (listed as F32) only when a dtype is given
        gguf.require_dtype(options.cast_to if options.quantize is None else "F32")
    layout = find_quant_layout(src.entries(), config=source_config(src), metadata=src.metadata(),
                               where=src.description, allow_lossy=options.allow_lossy)
    if isinstance(layout, Fp4Layout) and (refusal := layout.refusal(src.description)):
        warn(f"{join_parts(refusal).split('; every fp4 weight')[0]}: ", Option("allow_lossy", True),
             " copies those tensors as they are")
    if layout is None:
        if options.quantize is None:
            if options.cast_to in _FP8_CASTS:
                warn(f"{src.description}: ", Option("dtype", options.dtype),
                     " writes plain fp8 tensors without scales, which "
                     "transformers and diffusers cannot load as a model; for fp8 that loaders read, use ",
                     Option("quantize", "fp8-block"), " "
                     "(transformers FineGrainedFP8), 'fp8-channel' or 'fp8-tensor' (compressed-tensors), which "
                     "write scales and a quantization_config")
            return src, frozenset()
        view = QuantizedSource(src, options.quantize)
        return view, view.scale_names()
    if options.quantize is not None:
        raise InvalidInputError(f"{src.description}: already quantized ({layout.describe()}); ", Option("quantize"),
                                " applies to a "
                                "plain checkpoint: dequantize it first (", Option("dtype", "bf16"),
                                "), or copy it as is")
    cast_to = options.cast_to
    if cast_to is None:
        return src, frozenset(layout.extra)  # copied as is, scales and all
    if cast_to not in LOSSLESS_TARGETS:
        raise InvalidInputError(f"{src.description}: ", Option("dtype", options.dtype), " of a checkpoint already in "
                                f"{layout.describe()} would drop its scales; copy it as is (no ", Option("dtype"),
                                ") or dequantize "
                                "(", Option("dtype", "bf16"), ")")
    return DequantizedSource(src, layout, cast_to, allow_lossy=options.allow_lossy), frozenset()


def source_config(src: Source) -> JsonObject | None:
    """The ``config.json`` beside ``src``'s files (with ModelOpt's ``hf_quant_config.json``), if any."""
    folder = _config_folder(src)
    return quant_config(folder) if folder else None


def _config_folder(src: Source) -> str | None:
    return os.path.dirname(os.path.abspath(src.paths[0])) if src.paths else None


def kept_cast(src: Source, options: WriteOptions) -> str | None:
    """The dtype code a job casts floating tensors to: ``options.cast_to``, or for ``--quantize`` without
    ``--dtype`` the checkpoint's compute dtype for the tensors it keeps (norms, embeddings...): bf16 when
    they are stored in fp32/fp64, so the fp8 output is smaller than a bf16 copy; None (as they are) otherwise.
    """
    if options.cast_to is not None or not isinstance(src, QuantizedSource) or not src.strategy.kept_to_bf16:
        return options.cast_to
    scales = src.scale_names()
    stored: dict[str, int] = {}
    for entry in src.entries():
        if entry.name not in scales and entry.dtype in (*_WIDE, "F16", "BF16"):
            stored[entry.dtype] = stored.get(entry.dtype, 0) + entry.nbytes
    return "BF16" if stored and max(stored, key=stored.__getitem__) in _WIDE else None


def quant_report(src: Source, *, cast_to: str | None = None,
                 options: WriteOptions | None = None) -> JsonObject | None:
    """What :func:`quant_view`'s source did (scheme, kept modules and their dtype, per-tensor error), or None."""
    view = written_view(src)
    if view is None:
        return None
    report = view.report()
    if isinstance(view, QuantizedSource) and view.strategy.kept_to_bf16:
        report["kept_dtype"] = cast_to  # None: kept as stored
        report["kept_dtype_chosen"] = cast_to is not None and (options is None or options.cast_to is None)
    return report


def written_view(src: Source) -> DequantizedSource | QuantizedSource | None:
    """The (de)quantizing view a job writes through: ``src`` itself, or one beneath the views put over it
    (a LoRA merge over a dequantized base, :mod:`shardkit.sharding.lora`, then the key options); None without one."""
    while not isinstance(src, VIEWS):
        inner = getattr(src, "inner", None)
        if not isinstance(inner, Source):
            return None
        src = inner
    return src


def config_edits(output: str, jobs: Sequence[tuple[str, Source]],
                 side_files: Sequence[tuple[str, str]]) -> dict[str, bytes]:
    """``{name in the output: bytes}`` of every config.json a (de)quantizing job rewrites.

    Args:
        output: the output folder.
        jobs: ``(name of the job's config.json in the output, its source)``.
        side_files: the ``(path, name)`` side files of the write: a config.json among them is the
            one edited; in place (output = source folder) the source's own.
    """
    sides = {name: path for path, name in side_files}
    edits: dict[str, bytes] = {}
    for name, src in jobs:
        gguf = find_gguf(src)
        if gguf is not None:  # a GGUF: its tokenizer and generation config rebuilt from its metadata too
            beside = os.path.dirname(name)
            edits.update({os.path.join(beside, rel): data for rel, data in gguf.hf_files().items()
                          if os.path.join(beside, rel) not in sides})
        config = gguf.config() if gguf is not None and name not in sides else None
        if config is not None:  # a Llama GGUF: config.json rebuilt from its metadata
            config = src.edit_config(config) if isinstance(src, VIEWS) else config
            edits[name] = (json.dumps(config, indent=2) + "\n").encode()
            continue
        view = written_view(src)
        if view is None:
            continue
        path = sides.get(name)
        folder = _config_folder(src)
        if path is None and folder and os.path.abspath(os.path.join(output, os.path.dirname(name))) == folder:
            path = os.path.join(folder, "config.json")
        if path is None or not os.path.isfile(path):
            continue
        config = read_config(os.path.dirname(path)) if os.path.basename(path) == "config.json" else None
        if config is not None:
            edits[name] = (json.dumps(view.edit_config(config), indent=2) + "\n").encode()
    return edits


def dropped_side_files(jobs: Sequence[tuple[str, Source]]) -> frozenset[str]:
    """Side files a dequantizing job leaves out (``hf_quant_config.json`` beside its config.json)."""
    return frozenset(os.path.join(os.path.dirname(name), dropped) for name, src in jobs
                     if isinstance(view := written_view(src), DequantizedSource)
                     for dropped in view.dropped_side_files())


def dequantized_for_mapping(tensors: Mapping[str, torch.Tensor], *, options: WriteOptions, where: str
                            ) -> dict[str, torch.Tensor]:
    """``--to diffusers``: a scaled checkpoint's weights × scales *before* diffusers' key mapping, which
    would drop the scales and keep the raw fp8 values. In ``options.cast_to``, bf16 when none is given.

    Raises:
        InvalidInputError: an fp8 ``dtype`` for a scaled checkpoint, or an inconsistent one.
    """
    from ..formats.dtypes import to_torch
    from ..layouts.fp8_math import dequantize_state_dict, state_dict_entries

    out_code = options.cast_to or "BF16"
    if out_code not in LOSSLESS_TARGETS:
        layout = find_layout(state_dict_entries(tensors), where=where)
        if layout is None:
            return dict(tensors)
        raise InvalidInputError(f"{where}: ", Option("dtype", options.dtype),
                                f" of a checkpoint in {layout.describe()}: diffusers "
                                "models hold plain weights; give ", Option("dtype", "bf16", choices=("fp16", "fp32")))
    converted, layout = dequantize_state_dict(tensors, out_dtype=to_torch(out_code), where=where)
    if layout is not None and options.cast_to is None:
        warn(f"{where}: {layout.describe()}: weights × scales written as bf16 (choose with ", Option("dtype"), ")")
    return converted
