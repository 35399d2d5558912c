"""``verify model.gguf``: the GGUF container, the model it describes, and every value in it.

Checked, each problem a finding (never raised): the header (counts, strings, types, offsets, alignment,
overlaps: :func:`~shardkit.formats.gguf.read_gguf`); for Llama files, that every tensor has a Hugging
Face name and the metadata gives a config (head counts, sizes) whose shapes the tensors match; then
every tensor is read band by band and dequantized (its block scales included), and any NaN or infinity
is reported with its count. The file's sha256 is computed on the same pass.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import HeaderError, InvalidInputError
from ..formats.header import TensorEntry
from ..formats.json_types import JsonObject
from ..formats.links import open_regular

__all__ = ["GgufCheck", "verify_gguf"]

READ_BYTES = 16 * 2**20


@dataclass
class GgufCheck:
    """What :func:`verify_gguf` found: (tensor or None, problem) pairs, the file's sha256 and size, tensors read."""

    findings: list[tuple[str | None, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # what the file lacks, not what is wrong in it
    sha256: str = ""
    file_bytes: int = 0
    tensors_checked: int = 0


def verify_gguf(path: str, *, progress: Callable[[int, int], None] | None = None,
                read_data: bool = True) -> GgufCheck:
    """Check the GGUF file ``path`` (see the module docstring); problems are collected, never raised."""
    from ..layouts.gguf_vocab import describe_vocab
    from ..sources.gguf import GgufSource

    report = GgufCheck()
    try:
        src = GgufSource(path)
    except (HeaderError, InvalidInputError) as e:
        report.findings.append((None, str(e).removeprefix(f"{path}: ")))
        return report
    try:
        try:
            config = src.config()
        except InvalidInputError as e:
            report.findings.append((None, str(e).removeprefix(f"{path}: ")))
            config = None
        if config is not None and config.get("model_type") != "bert":  # decoders: Llama, Qwen2, Qwen3
            report.findings += _shape_problems(src.entries(), config)
        vocab = describe_vocab(src.gguf.metadata, src.gguf.architecture)
        if vocab is not None and vocab["missing"]:
            report.warnings.append(f"no vocabulary: {vocab['text']}")
        if not read_data:
            return report
        total = sum(e.nbytes for e in src.entries())
        done = 0
        for entry in src.entries():
            bad = _non_finite(src, entry)
            if bad:
                kind = src.names[entry.name].kind.name
                report.findings.append((entry.name, f"{bad} NaN/infinite value(s) once read as {kind} "
                                        "(damaged data or block scales)"))
            report.tensors_checked += 1
            done += entry.nbytes
            if progress is not None:
                progress(done, total)
        report.sha256, report.file_bytes = _sha256(path)
    finally:
        src.close()
    return report


def _non_finite(src: Any, entry: TensorEntry) -> int:
    import torch

    from ..formats.dtypes import to_torch
    from ..layouts.ggml import DEQUANTIZABLE

    if entry.dtype not in ("F32", "F16", "BF16", "F64") or src.names[entry.name].kind.name not in (
            DEQUANTIZABLE | {"F64"}):
        return 0  # integers, and ggml types shardkit cannot dequantize (IQ*, TQ*): the container is checked
    bad = 0
    for data in src.chunks(entry, READ_BYTES):
        raw = bytearray(data)
        if raw:
            bad += int((~torch.isfinite(torch.frombuffer(raw, dtype=to_torch(entry.dtype)))).sum())
    return bad


def _shape_problems(entries: list[TensorEntry], config: JsonObject) -> list[tuple[str, str]]:
    """Decoder tensors (Llama, Qwen2, Qwen3) whose shape disagrees with the metadata's sizes."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim", hidden // heads)
    vocab = config.get("vocab_size")
    want = {"q_proj.weight": (heads * head_dim, hidden), "k_proj.weight": (kv * head_dim, hidden),
            "v_proj.weight": (kv * head_dim, hidden), "o_proj.weight": (hidden, heads * head_dim),
            "gate_proj.weight": (inter, hidden), "up_proj.weight": (inter, hidden), "down_proj.weight": (hidden, inter),
            "layernorm.weight": (hidden,), "model.norm.weight": (hidden,)}
    if vocab:
        want.update({"embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden)})
    problems = []
    for entry in entries:
        shape = next((s for suffix, s in want.items() if entry.name.endswith(suffix)), None)
        if shape is not None and tuple(entry.shape) != shape:
            problems.append((entry.name, f"shape {list(entry.shape)} but the metadata's sizes make {list(shape)}"))
    layers = {int(e.name.split(".")[2]) for e in entries if e.name.startswith("model.layers.")}
    if layers != set(range(config["num_hidden_layers"])):
        problems.append(("model.layers", f"{len(layers)} layers in the file, {config['model_type']}.block_count says "
                                         f"{config['num_hidden_layers']}"))
    return problems


def _sha256(path: str) -> tuple[str, int]:
    """The file's sha256 and size, read through one checked descriptor (a FIFO or device refused unread)."""
    digest, size = hashlib.sha256(), 0
    fd = open_regular(path)
    try:
        while block := os.read(fd, READ_BYTES):
            digest.update(block)
            size += len(block)
    finally:
        os.close(fd)
    return digest.hexdigest(), size
