"""``verify model.gguf``: the GGUF container, the model it describes, and every value in it.

Checked, each problem a finding (never raised): the header (counts, strings, types, offsets, alignment,
overlaps: :func:`~shardkit.formats.gguf.read_gguf`); for Llama files, that every tensor has a Hugging
Face name and the metadata gives a config (head counts, sizes) whose shapes the tensors match; then
every tensor is read band by band and dequantized (its block scales included), and any NaN or infinity
is reported with its count. Then the file's sha256 and size.

A split GGUF (llama.cpp's gguf-split layout, given by its first part ``NAME-00001-of-0000N.gguf``) is checked
whole: every part's header, that each part is there, whole, numbered as its name says and holds tensors no other
part holds (:func:`~shardkit.formats.gguf_split.check_split_parts`), the model across all parts, every value in
every part, and each part's sha256. A part missing or damaged is a finding naming that part; the model and its
values are then not checked (they need every part), the parts that are whole are still hashed.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import HeaderError, InvalidInputError
from ..formats.header import TensorEntry
from ..formats.json_types import JsonObject
from ..formats.links import open_regular

if TYPE_CHECKING:
    from ..sources.gguf import GgufSource

__all__ = ["GgufCheck", "gguf_folder_files", "is_gguf_checkpoint", "verify_gguf", "verify_gguf_path"]

READ_BYTES = 16 * 2**20


@dataclass
class GgufCheck:
    """What :func:`verify_gguf` found.

    Attributes:
        findings: ``(file, tensor or None, problem)``: the file is the name of the part it is in (of the checked file
            for a whole GGUF).
        warnings: what the file lacks, not what is wrong in it.
        files: ``(name, bytes, sha256)`` of every file read in full (each part of a split GGUF).
        tensors_checked: tensors whose values were read.
    """

    findings: list[tuple[str, str | None, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    files: list[tuple[str, int, str]] = field(default_factory=list)
    tensors_checked: int = 0


def verify_gguf(path: str, *, progress: Callable[[int, int], None] | None = None,
                read_data: bool = True) -> GgufCheck:
    """Check the GGUF file ``path`` and, when it is the first part of a split GGUF, every other part (see the module
    docstring); problems are collected, never raised.

    Raises:
        InvalidInputError: ``path`` is a later part of a split GGUF (the message names the first part).
    """
    from ..formats.gguf import read_gguf
    from ..formats.gguf_split import check_split_parts, first_part, later_part_message

    report, name = GgufCheck(), os.path.basename(path)
    try:
        first = read_gguf(path)
    except HeaderError as e:
        report.findings.append((name, None, str(e).removeprefix(f"{path}: ")))
        return report
    first_path = first_part(first)
    if first_path is not None:
        raise InvalidInputError(later_part_message(first, first_path))
    split = check_split_parts(first)
    report.findings += [(os.path.basename(part), None, problem) for part, problem in split.problems]
    if split.problems:  # values need every part: the parts that are whole are still hashed
        if read_data:
            broken = {part for part, _ in split.problems}
            report.files = [_sha256(part) for part in split.paths if part not in broken and os.path.isfile(part)]
        return report
    if _check_model(path, report, progress=progress, read_data=read_data) and read_data:
        report.files = [_sha256(part) for part in split.paths]
    return report


def is_gguf_checkpoint(path: str) -> bool:
    """Whether ``path`` is a ``.gguf`` file, or a folder of GGUF weights (:func:`gguf_folder_files`)."""
    if path.endswith(".gguf") and os.path.isfile(path):
        return True
    return os.path.isdir(path) and gguf_folder_files(path) is not None


def verify_gguf_path(path: str, *, progress: Callable[[int, int], None] | None = None,
                     read_data: bool = True) -> GgufCheck:
    """:func:`verify_gguf` of a GGUF file, or :func:`verify_gguf_folder` of a folder of them; each warning names
    its file."""
    names = gguf_folder_files(path) if os.path.isdir(path) else None
    if names is not None:
        return verify_gguf_folder(path, names, progress=progress, read_data=read_data)
    check = verify_gguf(path, progress=progress, read_data=read_data)
    check.warnings = [f"{os.path.basename(path)}: {warning}" for warning in check.warnings]
    return check


def gguf_folder_files(folder: str) -> list[str] | None:
    """The ``.gguf`` files of ``folder`` (not its subfolders) when it holds GGUF weights and no safetensors or
    pickle ones (a folder of GGUFs, as ``push`` sends one), sorted; else None."""
    from ..formats.suffixes import CHECKPOINT_SUFFIXES

    try:
        names = sorted(n for n in os.listdir(folder) if os.path.isfile(os.path.join(folder, n)))
    except OSError:
        return None
    ggufs = [n for n in names if n.endswith(".gguf")]
    return ggufs if ggufs and not any(n.endswith(CHECKPOINT_SUFFIXES) for n in names) else None


def verify_gguf_folder(folder: str, names: list[str], *, progress: Callable[[int, int], None] | None = None,
                       read_data: bool = True) -> GgufCheck:
    """Check every GGUF of ``folder`` (``names``, from :func:`gguf_folder_files`): each whole file, and each split
    from its first part; a part whose first part is not there is a finding."""
    from ..formats.gguf import read_gguf
    from ..formats.gguf_split import SPLIT_NAME, first_part

    report = GgufCheck()
    for name in names:
        match = SPLIT_NAME.fullmatch(name)
        if match is not None and int(match.group(2)) > 1:  # a later part: checked with its first
            try:
                first = first_part(read_gguf(os.path.join(folder, name)))
            except HeaderError as e:
                report.findings.append((name, None, str(e).removeprefix(f"{os.path.join(folder, name)}: ")))
                continue
            if first is not None and not os.path.isfile(first):
                report.findings.append((name, None, f"a part of a split GGUF whose first part, "
                                                    f"{os.path.basename(first)}, is not in the folder"))
            if first is not None:
                continue
        check = verify_gguf(os.path.join(folder, name), progress=progress, read_data=read_data)
        report.findings += check.findings
        report.warnings += [f"{name}: {warning}" for warning in check.warnings]
        report.files += check.files
        report.tensors_checked += check.tensors_checked
    return report


def _check_model(path: str, report: GgufCheck, *, progress: Callable[[int, int], None] | None,
                 read_data: bool) -> bool:
    """The model the GGUF (every part of it) describes: names, shapes against its metadata, then every value;
    False when it could not be opened as a model (a finding says why)."""
    from ..layouts.gguf_vocab import describe_vocab
    from ..sources.gguf import GgufSource

    name = os.path.basename(path)
    try:
        src = GgufSource(path)
    except (HeaderError, InvalidInputError) as e:
        report.findings.append((name, None, str(e).removeprefix(f"{path}: ")))
        return False
    try:
        try:
            config = src.config()
        except InvalidInputError as e:
            report.findings.append((name, None, str(e).removeprefix(f"{path}: ")))
            config = None
        if config is not None and config.get("model_type") != "bert":  # decoders: Llama, Qwen2, Qwen3
            report.findings += [(_part_of(src, tensor), tensor, problem)
                                for tensor, problem in _shape_problems(src.entries(), config)]
        vocab = describe_vocab(src.gguf.metadata, src.gguf.architecture)
        if vocab is not None and vocab["missing"]:
            report.warnings.append(f"no vocabulary: {vocab['text']}")
        if read_data:
            _check_values(src, report, progress=progress)
    finally:
        src.close()
    return True


def _check_values(src: GgufSource, report: GgufCheck, *, progress: Callable[[int, int], None] | None) -> None:
    total = sum(e.nbytes for e in src.entries())
    done = 0
    for entry in src.entries():
        bad = _non_finite(src, entry)
        if bad:
            kind = src.names[entry.name].kind.name
            report.findings.append((_part_of(src, entry.name), entry.name, f"{bad} NaN/infinite value(s) once read as "
                                    f"{kind} (damaged data or block scales)"))
        report.tensors_checked += 1
        done += entry.nbytes
        if progress is not None:
            progress(done, total)


def _part_of(src: GgufSource, hf_name: str) -> str:
    """The name of the file (the part, for a split GGUF) holding the tensor ``hf_name``; the first for a layer count."""
    tensor = src.names.get(hf_name)
    return os.path.basename(src.file_of[tensor.name] if tensor is not None else src.paths[0])


def _non_finite(src: GgufSource, entry: TensorEntry) -> int:
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


def _sha256(path: str) -> tuple[str, int, str]:
    """The file's name, size and sha256, read through one checked descriptor (a FIFO or device refused unread)."""
    digest, size = hashlib.sha256(), 0
    fd = open_regular(path)
    try:
        while block := os.read(fd, READ_BYTES):
            digest.update(block)
            size += len(block)
    finally:
        os.close(fd)
    return os.path.basename(path), size, digest.hexdigest()
