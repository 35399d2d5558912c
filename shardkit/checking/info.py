"""``info``: what a checkpoint holds, from its headers alone (fast on 100 GB: no tensor data is read).

Works on a ``.safetensors`` file, a sharded folder or its index, a pickle (opened with
``torch.load(weights_only=True, mmap=True)``, so tensor data is mapped, not read), and a
diffusers pipeline folder (one section per weight-bearing component, plus totals).
"""

from __future__ import annotations

import heapq
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import SourceNotFoundError, join_parts
from ..formats.header import TensorEntry
from ..units import FLOAT_DTYPES

LARGEST_COUNT = 10
# Memory if float tensors were cast to these widths (bits); other tensors count as stored.
MEMORY_TARGETS = {"fp32": 32, "bf16": 16, "fp8": 8}


@dataclass
class ShardInfo:
    """One weight file: its name, tensor count, tensor bytes and size on disk.

    ``shared_bytes`` counts the bytes whose disk extents are shared with another file
    (copy-on-write clones, e.g. of the file it was split from, on XFS or btrfs); None where the
    filesystem does not tell.
    """

    file: str
    tensors: int
    bytes: int
    file_bytes: int
    shared_bytes: int | None = None


@dataclass
class TensorInfo:
    """One tensor, as listed among the largest: its name, dtype code, shape and byte size."""

    name: str
    dtype: str
    shape: list[int]
    bytes: int


@dataclass
class CheckpointInfo:
    """What :func:`info` found: a checkpoint's format, counts, sizes and files, from headers alone.

    For a pipeline, ``components`` holds one per component and the counts are totals; file
    names in ``shards`` and tensor names in ``largest`` are then ``component/name``.

    Attributes:
        path: the path described (a component's name, inside a pipeline).
        format: ``"safetensors"``, ``"safetensors-sharded"``, ``"pickle"``, ``"pickle-sharded"``,
            ``"dcp"`` or ``"diffusers-pipeline"``.
        tensor_count: the number of tensors.
        parameter_count: the number of elements over all tensors but fp8 scales, input scales and markers.
        total_bytes: tensor bytes as stored.
        bytes_by_dtype: stored bytes per dtype code, largest first.
        memory_bytes: bytes if floating-point tensors were cast to ``fp32``, ``bf16`` or ``fp8``; for fp8
            weights with scales, ``fp32``/``bf16`` are the dequantized sizes and ``fp8`` counts the scales.
        quantization: for fp8 weights with scales, the layout
            (:meth:`~shardkit.formats.quant.QuantLayout.to_dict`: ``description`` such as "fp8, 128×128
            blocks, float32 scales (transformers FineGrainedFP8)"), or ``{"error": ...}`` when inconsistent.
        shards: one :class:`ShardInfo` per weight file.
        largest: the :data:`LARGEST_COUNT` largest tensors.
        components: for a pipeline, one :class:`CheckpointInfo` per weight-bearing component.
        shared_bytes: bytes of the weight files that share disk extents with other files
            (copy-on-write clones); None where the filesystem does not tell.
    """

    path: str
    format: str                      # "safetensors", "safetensors-sharded", "pickle", "diffusers-pipeline"
    naming: str | None = None        # file prefix: "model" or "diffusion_pytorch_model"
    variant: str | None = None
    index: str | None = None         # index file name, for sharded checkpoints
    tensor_count: int = 0
    parameter_count: int = 0
    total_bytes: int = 0             # tensor bytes as stored
    bytes_by_dtype: dict[str, int] = field(default_factory=dict)
    tensors_by_dtype: dict[str, int] = field(default_factory=dict)
    memory_bytes: dict[str, int] = field(default_factory=dict)
    shards: list[ShardInfo] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)
    index_metadata: dict[str, Any] = field(default_factory=dict)
    largest: list[TensorInfo] = field(default_factory=list)
    components: dict[str, CheckpointInfo] = field(default_factory=dict)
    library: str | None = None       # pipeline components: "diffusers", "transformers", ...
    class_name: str | None = None
    shared_bytes: int | None = None  # copy-on-write clones (FIEMAP shared flag); None: not reported
    quantization: dict[str, Any] | None = None  # fp8 with scales: the layout (formats/quant.py)

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain JSON-ready data."""
        return asdict(self)


def info(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Describe a checkpoint without reading its tensor data.

    Safetensors checkpoints are described from their headers; pickles are opened with
    ``torch.load(weights_only=True, mmap=True)``, so their data is mapped, not read.

    Args:
        path: a ``.safetensors`` file, a sharded folder or its index, a pickle
            (``.bin``/``.pt``/``.pth``/``.ckpt``, sharded or not), a
            ``torch.distributed.checkpoint`` folder, or a diffusers pipeline folder.

    Returns:
        A :class:`CheckpointInfo`.

    Raises:
        SourceNotFoundError: the path does not exist or holds no checkpoint.
        InvalidInputError: the input is not a usable checkpoint (``HeaderError``,
            ``CheckpointIndexError`` and ``UnsafePickleError`` are subclasses).

    summary = info("sdxl-unet/")
    summary.format, summary.tensor_count, summary.parameter_count
    ('safetensors-sharded', 1680, 2567463684)
    """
    from ..formats.layout import is_pipeline_folder

    path = os.fspath(path)
    if not os.path.exists(path):
        raise SourceNotFoundError(f"{path}: no such file or folder")
    if is_pipeline_folder(path):
        return _pipeline_info(path)
    return _checkpoint_info(path)


def _checkpoint_info(path: str) -> CheckpointInfo:
    from ..formats.index import load_index
    from ..formats.names import library_naming
    from ..sources import open_source

    target, index_name = _resolve(path)
    from ..sources.gguf import GgufSource

    with open_source(target) as source:
        entries = source.entries()
        metadata = source.metadata()
        headers = getattr(source, "headers", None)
        gguf = (source.describe(), source.stored_entries()) if isinstance(source, GgufSource) else None
    fmt = _format_name(target, headers, index_name)
    filename = index_name or os.path.basename(target)
    naming = library_naming(filename)
    result = CheckpointInfo(path, fmt, naming.prefix if naming else None, naming.variant if naming else None,
                            index_name, metadata=dict(metadata))
    if index_name:
        result.index_metadata = dict(load_index(target).metadata)
    if gguf is not None:  # a split GGUF: a shard per part
        parts: dict[str, list[TensorEntry]] = {}
        for entry in gguf[1]:
            parts.setdefault(entry.file or target, []).append(entry)
        result.shards = [ShardInfo(os.path.basename(file), len(held), sum(e.nbytes for e in held), _disk_bytes(file),
                                   _shared_bytes(file)) for file, held in parts.items()]
    elif headers is not None:
        result.shards = [ShardInfo(os.path.basename(h.path), len(h.entries), sum(e.nbytes for e in h.entries),
                                   h.file_bytes, _shared_bytes(h.path)) for h in sorted(headers, key=lambda h: h.path)]
    else:
        result.shards = [ShardInfo(os.path.basename(target), len(entries), sum(e.nbytes for e in entries),
                                   _disk_bytes(target), _shared_bytes(target))]
    result.shared_bytes = _sum_known([s.shared_bytes for s in result.shards])
    result.quantization, scales = _quantization(target, entries, metadata)
    if gguf is not None:  # stored sizes by ggml type; memory as dequantized
        result.quantization, stored = gguf
        _summarize(result, [("", e) for e in stored])
        result.memory_bytes = {k: sum((math.prod(e.shape) * bits + 7) // 8 if e.dtype in FLOAT_DTYPES else e.nbytes
                                      for e in entries) for k, bits in MEMORY_TARGETS.items()}
        return result
    _summarize(result, [("", e) for e in entries], scales=scales)
    packed = {w["weight"]: w["shape"] for w in (result.quantization or {}).get("weights", [])}
    for entry in entries:  # fp4: a packed uint8 weight stands for twice its elements, dequantized
        if (shape := packed.get(entry.name)) is not None:
            result.parameter_count += math.prod(shape) - math.prod(entry.shape)
            for target, bits in (("fp32", 32), ("bf16", 16)):
                result.memory_bytes[target] += math.prod(shape) * bits // 8 - entry.nbytes
    return result


def _quantization(target: str, entries: list[TensorEntry], metadata: dict[str, str]
                  ) -> tuple[dict[str, Any] | None, frozenset[str]]:
    """The quantized layout (or the reason it is unusable) and its scale/marker tensors."""
    from ..errors import InvalidInputError
    from ..formats.layout import read_config
    from ..formats.links import UntrustedFileError
    from ..layouts.registry import find_quant_layout, quant_config_of

    folder = target if os.path.isdir(target) else os.path.dirname(os.path.abspath(target))
    config = read_config(folder)  # a config.json that leaves the folder or is no regular file: one line, exit 2
    try:
        config = quant_config_of(folder, config)
        layout = find_quant_layout(entries, config=config, metadata=metadata, where=target, allow_lossy=True)
        if layout is None:  # or an inconsistent fp8 one: say why
            layout = find_quant_layout(entries, config=config, metadata=metadata, where=target)
    except UntrustedFileError:  # hf_quant_config.json leaving the folder, a FIFO...: refused, not described
        raise
    except InvalidInputError as e:  # info describes a broken checkpoint; split/convert refuse it
        return {"error": str(e)}, frozenset()
    if layout is None:
        return None, frozenset()
    found, refusal = layout.to_dict(), layout.refusal(target)
    if refusal is not None:
        found = {"error": join_parts(refusal), **{k: v for k, v in found.items() if k != "description"}}
    return found, layout.extra


def _format_name(target: str, headers: object, index_name: str | None) -> str:
    if target.endswith(".gguf"):
        return "gguf"
    if headers is not None:
        return "safetensors-sharded" if index_name else "safetensors"
    if os.path.isdir(target):
        return "dcp" if os.path.exists(os.path.join(target, ".metadata")) else "pickle-sharded"
    return "pickle-sharded" if target.endswith(".json") else "pickle"


def _disk_bytes(target: str) -> int:
    if not os.path.isdir(target):
        return os.path.getsize(target)
    return sum(e.stat().st_size for e in os.scandir(target) if e.is_file())


def _shared_bytes(path: str) -> int | None:
    """Bytes of a weight file that share extents with another file; None when unknown (or a folder)."""
    from ..atomic.extents import shared_bytes

    if not os.path.isfile(path):
        return None
    try:
        return shared_bytes(path)
    except OSError:
        return None


def _sum_known(values: list[int | None]) -> int | None:
    """The total, or None when any part is unknown (a partial figure would mislead)."""
    return None if not values or any(v is None for v in values) else sum(v for v in values if v is not None)


def _resolve(path: str) -> tuple[str, str | None]:
    """(path to open, index file name or None): a folder through the resolver, strictly (info opens what it finds)."""
    from ..formats.index import find_checkpoint, shard_file
    from ..formats.layout import weight_files
    from ..sources import is_dcp_folder, is_pickle_index_folder

    if not os.path.isdir(path):
        name = os.path.basename(path)
        return path, name if name.endswith(".json") else None
    if is_dcp_folder(path) or is_pickle_index_folder(path):
        return path, None  # opened whole by its source; no safetensors index to show
    names = weight_files(path)
    if len(names) == 1 and not names[0].endswith(".safetensors"):
        # a folder with one pickle (e.g. pytorch_model.bin): found in the folder, so under its link rule
        return shard_file(path, names[0], where=path), None
    layout = find_checkpoint(path)
    return layout.path, os.path.basename(layout.path) if layout.kind == "index" else None


def _pipeline_info(path: str) -> CheckpointInfo:
    from ..formats.layout import find_components

    result = CheckpointInfo(path, "diffusers-pipeline")
    tagged: list[tuple[str, TensorEntry]] = []
    for component in find_components(path):
        if not component.has_weights:
            continue
        sub = _checkpoint_info(component.path)
        sub.path, sub.library, sub.class_name = component.name, component.library, component.class_name
        result.components[component.name] = sub
        result.shards += [ShardInfo(f"{component.name}/{s.file}", s.tensors, s.bytes, s.file_bytes, s.shared_bytes)
                          for s in sub.shards]
        tagged += [(f"{component.name}/", _as_entry(t)) for t in sub.largest]
        for key in ("tensor_count", "parameter_count", "total_bytes"):
            setattr(result, key, getattr(result, key) + getattr(sub, key))
        for key in ("bytes_by_dtype", "tensors_by_dtype", "memory_bytes"):
            for k, v in getattr(sub, key).items():
                getattr(result, key)[k] = getattr(result, key).get(k, 0) + v
    result.largest = _largest(tagged)
    result.shared_bytes = _sum_known([s.shared_bytes for s in result.shards])
    return result


def _summarize(result: CheckpointInfo, tagged: list[tuple[str, TensorEntry]],
               scales: frozenset[str] = frozenset()) -> None:
    result.memory_bytes = {k: 0 for k in MEMORY_TARGETS}
    for _, entry in tagged:
        numel = math.prod(entry.shape)
        result.tensor_count += 1
        if entry.name in scales:  # not parameters: gone once dequantized, kept beside fp8 weights
            result.memory_bytes["fp8"] += entry.nbytes
        else:
            result.parameter_count += numel
        result.total_bytes += entry.nbytes
        result.bytes_by_dtype[entry.dtype] = result.bytes_by_dtype.get(entry.dtype, 0) + entry.nbytes
        result.tensors_by_dtype[entry.dtype] = result.tensors_by_dtype.get(entry.dtype, 0) + 1
        for target, bits in MEMORY_TARGETS.items():
            if entry.name not in scales:
                result.memory_bytes[target] += (numel * bits + 7) // 8 if entry.dtype in FLOAT_DTYPES else entry.nbytes
    result.bytes_by_dtype = dict(sorted(result.bytes_by_dtype.items(), key=lambda kv: -kv[1]))
    result.largest = _largest(tagged)


def _largest(tagged: list[tuple[str, TensorEntry]]) -> list[TensorInfo]:
    top = heapq.nlargest(LARGEST_COUNT, tagged, key=lambda t: t[1].nbytes)
    return [TensorInfo(prefix + e.name, e.dtype, list(e.shape), e.nbytes) for prefix, e in top]


def _as_entry(t: TensorInfo) -> TensorEntry:
    return TensorEntry(t.name, t.dtype, tuple(t.shape), t.bytes)
