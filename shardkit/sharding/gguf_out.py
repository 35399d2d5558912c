"""``convert SRC out.gguf --to gguf``: a language model or a Flux transformer → one GGUF file.

Which model, and how its tensors are named in GGUF:

=================================================  =========================================================
source                                             written
=================================================  =========================================================
transformers folder whose ``model_type`` has       as llama.cpp's ``convert_hf_to_gguf.py`` writes it: the
an entry in :mod:`shardkit.layouts.gguf_arch`      entry of :mod:`shardkit.layouts.gguf_arch` (names, Llama's
                                                   q/k row permutation, ``{arch}.*`` keys from config.json,
                                                   BERT's pooling type), and the vocabulary of its
                                                   tokenizer.json (:mod:`shardkit.layouts.gguf_vocab`; none:
                                                   ``no_vocab`` and a warning)
diffusers Flux transformer folder                  BFL names through the single-file layouts (ComfyUI-GGUF /
                                                   city96 layout, ``general.architecture = flux``)
BFL Flux ``.safetensors`` (``double_blocks.*``)    its names (``model.diffusion_model.`` stripped)
a ``.gguf`` file                                   its tensors back in llama.cpp's layout; its metadata kept
=================================================  =========================================================

``quantize`` (``f32``, ``f16``, ``bf16``, ``q8_0``, ``q4_0``) sets the ggml type of every tensor of two or more
dimensions; 1-D tensors stay F32, and so do, for language models, what llama.cpp's converter keeps F32
(norms, biases, BERT's position and token-type tables). Rows that are not whole blocks fall back to F16 for
language models (as that converter does) and stay F32 for Flux. The bytes are :func:`shardkit.layouts.ggml.quantize`
of the float32 values, identical to ``gguf.quants.quantize``. gpt-oss's MXFP4 experts stay MXFP4 whatever
``quantize`` (repacked, values unchanged, as the converter does). Without ``quantize``, F32/F16/BF16 tensors keep
their type and a GGUF source keeps each tensor's ggml type (its bytes copied). The file is written tensor by
tensor, band by band of rows (memory never depends on a tensor's size: :mod:`shardkit.sharding.gguf_bytes`), into a
temporary file published atomically; with ``max_shard_size``, llama.cpp's gguf-split layout (:mod:`shardkit.sharding.gguf_split`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidInputError, Option
from ..formats.gguf import BOOL, FLOAT32, GGUF_QUANTIZE, STRING, UINT32, ggml_type
from ..formats.header import TensorEntry
from ..formats.json_types import Config
from ..layouts.gguf_arch import Piece
from ..sources import Source, open_source
from ..sources.gguf import GgufSource
from .gguf_bytes import PlannedTensor
from .gguf_split import GgufFiles, Row, plan_files, split_files, write_files
from .job import SplitResult, refuse_output_inside_source
from .options import WriteOptions, warn
from .plan import ShardPlan

__all__ = ["GGUF_QUANTIZE", "GgufJob", "convert_to_gguf", "open_gguf_job"]

FILE_TYPE = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "BF16": 32, "MXFP4": 38}  # llama.cpp's general.file_type (LLAMA_FTYPE)
FLOAT_SOURCES = frozenset({"F32", "F16", "BF16", "F64"})
BFL_PREFIX = "model.diffusion_model."
LLAMA_CPP_ONLY = frozenset({"rope_freqs.weight"})  # llama.cpp tensors with no HF name, kept by a GGUF source


@dataclass
class GgufModel:
    """What the writer needs to know about the model: architecture, names, permuted heads, metadata."""

    architecture: str
    gguf_name: Callable[[str], str | None]
    heads: Callable[[str], int | None] = lambda name: None
    metadata: list[Row] = field(default_factory=list)
    note: str | None = None  # said once the conversion is known to go ahead (what the file will lack)
    drops: Callable[[str], bool] = lambda name: name.endswith("rotary_emb.inv_freq")  # left out, as llama.cpp does
    keep_f32: Callable[[str], bool] = lambda gguf_name: False  # kept F32 whatever the quantize type (by GGUF name)
    partial_blocks: str = "F32"  # the type of 2-D tensors whose rows are not whole blocks (llama.cpp's converter: F16)
    extra: dict[str, bytes] = field(default_factory=dict)  # GGUF name → F32 bytes of tensors computed from the config
    shift: Callable[[str], float] = lambda name: 0.0  # added to a tensor's values (by HF name; Gemma's norms: 1)
    expert_index: Callable[[str], int | None] = lambda name: None  # the expert of a tensor stacked with its peers
    pieces: Callable[[str], tuple[Piece, ...]] | None = None  # what an HF tensor becomes (else its ``gguf_name``)


def convert_to_gguf(source: Any, output: str, *, options: WriteOptions, quantize: str | None = None,
                    component: str | None = None, view: Callable[[Source], Source] | None = None) -> SplitResult:
    """Write ``source`` (see the module docstring) as the GGUF file ``output``.

    ``view`` wraps the model's opened source before it is planned (LoRA adapters merged in as it streams,
    :func:`shardkit.sharding.lora.merged_view`).

    Raises:
        InvalidInputError: an output not ending in ``.gguf``, a model that is neither Llama nor Flux, a
            tensor without a GGUF name, or a non-float tensor to quantize.
    """
    with open_gguf_job(source, output, options=options, quantize=quantize, component=component, view=view) as job:
        folder = os.path.dirname(os.path.abspath(output))
        result = SplitResult(folder, job.plan, job.src.description, quantize, options.dry_run)
        if options.dry_run:
            taken = [name for name, _, _ in job.files if os.path.exists(os.path.join(folder, name))]
            if taken and not options.overwrite:
                warn(f"{os.path.join(folder, taken[0])} exists: the real run needs ", Option("overwrite", True))
        else:
            write_files(folder, job.files, job.src, overwrite=options.overwrite, progress=options.progress)
    if job.model.note:
        warn(job.model.note)
    return result


@dataclass(frozen=True)
class GgufJob:
    """A GGUF output planned: the model's source (open), what it is, and each file's name, header and tensors."""

    src: Source
    model: GgufModel
    plan: ShardPlan
    files: GgufFiles


@contextlib.contextmanager
def open_gguf_job(source: Any, output: str, *, options: WriteOptions, quantize: str | None = None,
                  component: str | None = None, view: Callable[[Source], Source] | None = None) -> Iterator[GgufJob]:
    """The files :func:`convert_to_gguf` writes, planned (headers only read), the source open for the block."""
    if not output.endswith(".gguf") or os.path.isdir(output):
        from .outputs import output_target

        raise InvalidInputError(f"{output_target(output)}: ", Option("to", "gguf"),
                                " writes one file (or a split's files beside it); "
                                "give an output ending in .gguf")
    if options.dtype is not None:
        raise InvalidInputError(Option("dtype", options.dtype), " does not apply with ", Option("to", "gguf"), ": ",
                                Option("quantize", "f16", choices=("bf16", "q8_0", "q4_0")), " "
                                "sets the ggml type (without it, types are kept)")
    if quantize is not None and quantize not in GGUF_QUANTIZE:
        raise InvalidInputError(Option("quantize", quantize), " with ", Option("to", "gguf"),
                                f": expected one of {', '.join(GGUF_QUANTIZE)}")
    if not isinstance(source, (str, os.PathLike)):
        raise InvalidInputError(Option("to", "gguf"), f" converts a checkpoint path; got {type(source).__name__}")
    path = os.fspath(source)
    refuse_output_inside_source(path, output)
    with _open_model(path, component=component, variant=options.variant) as (src, model):
        src = view(src) if view is not None else src
        tensors = _plan(src, model, quantize=quantize)
        plan = plan_files(tensors, output, max_shard_bytes=options.max_shard_bytes)
        yield GgufJob(src, model, plan, split_files(plan, tensors, _metadata(model, tensors, quantize)))


# ----------------------------------------------------------------------------- which model


@contextlib.contextmanager
def _open_model(path: str, *, component: str | None, variant: str | None) -> Iterator[tuple[Source, GgufModel]]:
    from ..formats.layout import is_pipeline_folder, read_config

    if path.endswith(".gguf"):
        gguf_src = GgufSource(path)
        try:
            yield gguf_src, _gguf_model(gguf_src)
        finally:
            gguf_src.close()
        return
    config = read_config(path) if os.path.isdir(path) else None
    if is_pipeline_folder(path) or (config or {}).get("_class_name") == "FluxTransformer2DModel":
        with _flux_folder(path, component=component, variant=variant) as src:
            yield src, GgufModel("flux", lambda name: name)
        return
    with open_source(path, variant=variant) as src:
        names = [e.name for e in src.entries()]
        if any(n.startswith(("double_blocks.", BFL_PREFIX + "double_blocks.")) for n in names):
            yield src, GgufModel("flux", lambda name: name.removeprefix(BFL_PREFIX))
            return
        folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
        yield src, _text_model(read_config(folder), where=path, folder=folder)


@contextlib.contextmanager
def _flux_folder(path: str, *, component: str | None, variant: str | None) -> Iterator[Source]:
    from ..layouts.single_file_export import plan_export, trace_part
    from ..sources.original_layout import OriginalLayoutSource

    model_type, parts = plan_export(path, component=component)
    if model_type != "flux":
        raise InvalidInputError(f"{path}: ", Option("to", "gguf"),
                                f" writes Flux transformers of diffusers folders; this is {model_type}")
    with OriginalLayoutSource.open(parts, variant=variant, trace=trace_part, metadata={},
                                   description=f"{path} as a BFL Flux single file") as src:
        yield src


def _text_model(config: Config | None, *, where: str, folder: str) -> GgufModel:
    """A transformers language model through its entry in :mod:`shardkit.layouts.gguf_arch`."""
    from ..layouts.gguf_arch import arch_for_config
    from ..layouts.gguf_keys import arch_metadata, llama3_rope_factors

    if config is None:
        raise InvalidInputError(f"{where}: ", Option("to", "gguf"),
                                " needs the model's config.json beside the weights (a transformers "
                                "model folder), or a Flux transformer (diffusers folder or BFL file)")
    arch = arch_for_config(config, where=where)
    kinds = {"u32": UINT32, "f32": FLOAT32, "bool": BOOL, "str": STRING}
    rows: list[Row] = [("general.architecture", STRING, arch.name, None), ("general.name", STRING, "shardkit export", None)]
    rows += [(key, kinds[kind], value, None) for key, kind, value in arch_metadata(arch, config, folder, where=where)]
    vocab, note = _vocab_rows(folder, config, where=where, bert=arch.bert, space_prefix=arch.name == "llama")
    heads_of: Callable[[str], int | None] = lambda name: None  # noqa: E731
    if arch.permute_qk:
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)

        def heads_of(name: str) -> int | None:
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                return heads
            return kv_heads if name.endswith(("k_proj.weight", "k_proj.bias")) else None

    rope_freqs = llama3_rope_factors(config) if arch.llama_keys else None
    extra = {"rope_freqs.weight": rope_freqs} if rope_freqs is not None else {}
    if arch.space_prefix is not None:
        vocab.append(("tokenizer.ggml.add_space_prefix", BOOL, arch.space_prefix, None))
    return GgufModel(arch.name, arch.gguf_name, heads_of, rows + vocab, note, arch.drops, arch.keeps_f32, "F16", extra,
                     arch.shift, arch.expert_index, arch.pieces)


def _vocab_rows(folder: str, config: Config, *, where: str, bert: bool = False,
                space_prefix: bool = False) -> tuple[list[Row], str | None]:
    """The tokenizer's ``tokenizer.*`` keys as llama.cpp's converter writes them; without one, ``no_vocab`` and a note."""
    from ..layouts.gguf_vocab import has_tokenizer, read_vocab

    if has_tokenizer(folder):
        return read_vocab(folder, config, bert=bert, space_prefix=space_prefix).rows, None
    rows: list[Row] = [("tokenizer.ggml.model", STRING, "no_vocab", None)]
    rows += [(f"tokenizer.ggml.{key}", UINT32, config[key], None) for key in ("bos_token_id", "eos_token_id")
             if isinstance(config.get(key), int) and not isinstance(config.get(key), bool)]
    return rows, (f"{where}: no tokenizer.json beside the weights, so the GGUF has no vocabulary (tokenizer.ggml.model "
                  "= no_vocab): llama.cpp cannot tokenize text with it; put the model's tokenizer files in the folder")


def _gguf_model(src: GgufSource) -> GgufModel:
    from ..formats.gguf import metadata_rows

    rewritten = frozenset({"general.file_type", "general.alignment", "general.quantization_version", "split.no",
                           "split.count", "split.tensors.count"})
    names = {hf: t.name for hf, t in src.names.items()}
    return GgufModel(src.gguf.architecture, names.get, src.heads.get, metadata_rows(src.gguf, skip=rewritten))


# ----------------------------------------------------------------------------- what each tensor becomes


def _plan(src: Source, model: GgufModel, *, quantize: str | None) -> list[PlannedTensor]:
    out: list[PlannedTensor] = []
    missing: list[str] = []
    experts: dict[str, dict[int, TensorEntry]] = {}
    pairs: dict[str, tuple[Piece, dict[str, TensorEntry]]] = {}  # MXFP4: GGUF name → (piece, its blocks and scales)
    for entry in src.entries():
        pieces = (model.pieces(entry.name) if model.pieces is not None else ()) or _named(model, entry.name)
        if not pieces:
            if not model.drops(entry.name):  # e.g. rotary_emb.inv_freq: recomputed by every loader
                missing.append(entry.name)
            continue
        expert = model.expert_index(entry.name)
        for piece in pieces:  # an MXFP4 pair or a layer's experts: put together once all their parts are known
            if piece.mxfp4:
                if piece.name not in pairs:
                    out.append(PlannedTensor(entry, piece.name, "", None))
                pairs.setdefault(piece.name, (piece, {}))[1][piece.mxfp4] = entry
            elif expert is not None:
                if piece.name not in experts:
                    out.append(PlannedTensor(entry, piece.name, "", None))
                experts.setdefault(piece.name, {})[expert] = entry
            else:
                out.append(_planned(entry, piece, src, model, quantize))
    out = [_stacked(t, experts[t.name], quantize, model, where=src.description) if t.name in experts
           else _mxfp4(t.name, *pairs[t.name], where=src.description) if t.name in pairs else t for t in out]
    for name, data in model.extra.items():
        if name not in {t.name for t in out}:
            out.append(PlannedTensor(TensorEntry(name, "F32", (len(data) // 4,), len(data)), name, "F32", None, data))
    if missing:
        raise InvalidInputError(f"{src.description}: {len(missing)} tensor(s) have no llama.cpp name, e.g. "
                                f"{', '.join(missing[:3])}; ", Option("to", "gguf"),
                                f" writes {model.architecture} models as "
                                "llama.cpp's converter names them (see shardkit.layouts.gguf_arch)")
    return out


def _named(model: GgufModel, hf_name: str) -> tuple[Piece, ...]:
    name = model.gguf_name(hf_name) or (hf_name if hf_name in LLAMA_CPP_ONLY else None)
    return () if name is None else (Piece(name),)


def _planned(entry: TensorEntry, piece: Piece, src: Source, model: GgufModel, quantize: str | None) -> PlannedTensor:
    """One float tensor (or the part of it ``piece`` takes) and the ggml type it is written in."""
    gguf = src if isinstance(src, GgufSource) else None
    stored = gguf.names[entry.name].kind.name if gguf is not None else None
    if piece.step == 1 and not piece.transpose:
        kind = _kind(entry, quantize, stored, where=src.description, keep_f32=model.keep_f32(piece.name),
                     partial_blocks=model.partial_blocks)
        return PlannedTensor(entry, piece.name, kind, model.heads(entry.name), shift=model.shift(entry.name))
    shape = (*entry.shape[:-1], entry.shape[-1] // piece.step)
    if entry.shape[-1] % piece.step or (piece.transpose and len(shape) != 3):
        raise InvalidInputError(f"{src.description}: tensor {entry.name} {list(entry.shape)} does not split into "
                                f"{piece.step} interleaved parts (or is not 3-D experts); ", Option("to", "gguf"),
                                " writes it as "
                                "llama.cpp's converter does")
    if piece.transpose:
        shape = (shape[0], shape[2], shape[1])
    part = TensorEntry(piece.name, entry.dtype, shape, entry.nbytes // piece.step)
    kind = _kind(part, quantize, None, where=src.description, keep_f32=model.keep_f32(piece.name),
                 partial_blocks=model.partial_blocks)
    return PlannedTensor(part, piece.name, kind, None, parts=(entry,), piece=piece)


def _mxfp4(name: str, piece: Piece, pair: dict[str, TensorEntry], *, where: str) -> PlannedTensor:
    """An MXFP4 pair (blocks (E, R, G, 16) U8, scales (E, R, G) U8) as one ggml MXFP4 tensor (E, R / step, G × 32)."""
    blocks, scales = pair.get("blocks"), pair.get("scales")
    if blocks is None or scales is None or blocks.dtype != "U8" or len(blocks.shape) != 4 or blocks.shape[3] != 16 \
            or scales.dtype not in ("U8", "F8_E8M0") or tuple(scales.shape) != tuple(blocks.shape[:3]) \
            or blocks.shape[1] % piece.step:
        raise InvalidInputError(f"{where}: the MXFP4 tensors of {name} are not a pair of U8 blocks (E, R, G, 16) and "
                                f"e8m0 scales (E, R, G) (got {blocks and list(blocks.shape)}, "
                                f"{scales and list(scales.shape)}); ", Option("to", "gguf"),
                                " keeps gpt-oss's MXFP4 experts as they are")
    experts, rows, groups, _ = blocks.shape
    shape = (experts, rows // piece.step, groups * 32)
    entry = TensorEntry(name, "U8", shape, experts * rows // piece.step * groups * 17)
    return PlannedTensor(entry, name, "MXFP4", None, parts=(blocks, scales), piece=piece)


def _stacked(first: PlannedTensor, parts: dict[int, TensorEntry], quantize: str | None, model: GgufModel, *,
             where: str) -> PlannedTensor:
    """One tensor of a layer's experts stacked, expert index first (the converter's ``torch.stack``)."""
    entries = [parts[i] for i in sorted(parts)]
    if sorted(parts) != list(range(len(parts))) or len({(e.dtype, e.shape) for e in entries}) != 1:
        raise InvalidInputError(f"{where}: the experts of {first.name} are not numbered 0..{len(parts) - 1} with one "
                                "dtype and shape; ", Option("to", "gguf"), " stacks them as llama.cpp's converter does")
    shape = (len(entries), *entries[0].shape)
    stack = TensorEntry(first.name, entries[0].dtype, shape, entries[0].nbytes * len(entries))
    kind = _kind(stack, quantize, None, where=where, keep_f32=model.keep_f32(first.name),
                 partial_blocks=model.partial_blocks)
    return PlannedTensor(stack, first.name, kind, None, parts=tuple(entries))


def _kind(entry: TensorEntry, quantize: str | None, stored: str | None, *, where: str, keep_f32: bool = False,
          partial_blocks: str = "F32") -> str:
    if stored is not None and (quantize is None or len(entry.shape) < 2 and stored == "F32" or stored == "MXFP4"):
        return stored  # MXFP4 (gpt-oss's experts) stays MXFP4 whatever quantize, as llama.cpp's converter keeps it
    if entry.dtype not in FLOAT_SOURCES:
        raise InvalidInputError(f"{where}: tensor {entry.name} is {entry.dtype}; ", Option("to", "gguf"),
                                " writes float tensors "
                                "(dequantize it first: convert ", Option("dtype", "bf16"), ")")
    if quantize is None:
        return entry.dtype if entry.dtype != "F64" else "F32"
    kind = ggml_type(quantize)
    if len(entry.shape) < 2 or keep_f32:
        return "F32"
    return partial_blocks if entry.shape[-1] % kind.block else kind.name


def _metadata(model: GgufModel, tensors: list[PlannedTensor], quantize: str | None) -> list[Row]:
    kinds = [t.kind for t in tensors]
    main = ggml_type(quantize).name if quantize else max(sorted(set(kinds)), key=kinds.count, default="F32")
    rows = list(model.metadata)
    if not any(r[0] == "general.architecture" for r in rows):
        rows.insert(0, ("general.architecture", STRING, model.architecture, None))
    rows += [("general.quantization_version", UINT32, 2, None)]
    if main in ("F32", "F16", "BF16") and "MXFP4" in kinds:  # the converter's MOSTLY_MXFP4_MOE (gpt-oss's experts kept)
        main = "MXFP4"
    if main in FILE_TYPE:
        rows += [("general.file_type", UINT32, FILE_TYPE[main], None)]
    return rows
