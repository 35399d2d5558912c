"""A GGUF file (llama.cpp, ComfyUI-GGUF) as a source: Hugging Face names, row order and values.

The header is read and validated by :func:`~shardkit.formats.gguf.read_gguf`; names and q/k row order
come from :mod:`shardkit.layouts.gguf_names` (Llama; Flux keeps its BFL names). Tensors of a plain type
(F32, F16, BF16, integers) keep it; quantized ones (Q8_0, Q4_K...) are listed as F32 and dequantized
(:mod:`shardkit.layouts.ggml`, bit-equal to ``gguf.quants.dequantize``) band by band of rows when read,
so memory never depends on a tensor's size. Tensors stored as they are listed (plain, not permuted)
carry their file offset and are copied kernel-side.

A GGUF in a store is opened through :func:`remote_gguf`: its header stand-ins (the header, then a hole) are what
this source parses, and every tensor byte is read by range from the object (never the hole, never kernel-side).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..errors import InvalidInputError, Option
from ..formats.gguf import GgufFile, GgufTensor
from ..formats.gguf_split import read_split_gguf
from ..formats.header import TensorEntry
from ..formats.json_types import JsonObject
from ..formats.ranges import RangeFile
from ..units import tensor_nbytes
from .base import Source, pread_exactly
from .ranged import RangedCheckpoint

if TYPE_CHECKING:
    import torch

__all__ = ["GgufSource", "find_gguf", "load_gguf_tensors", "open_gguf", "remote_gguf"]

PLAIN = {"F32": "F32", "F16": "F16", "BF16": "BF16", "F64": "F64", "I8": "I8", "I16": "I16", "I32": "I32",
         "I64": "I64"}
BAND_BYTES = 4 * 2**20  # output bytes computed at a time (float32)

_BY_RANGE: dict[str, RangedCheckpoint] = {}  # a temporary folder of header stand-ins → where their bytes are read
_BY_RANGE_LOCK = threading.Lock()


@contextlib.contextmanager
def remote_gguf(path: str, *, token: str | None = None) -> Iterator[str]:
    """A GGUF in a store (``s3://BUCKET/PATH/NAME.gguf``, ``hf://ORG/REPO/PATH/NAME.gguf``; a split's every part) for
    the local readers: the local path of its header stand-in. Until exit, every :class:`GgufSource` opened on it reads
    its tensor bytes by range from the store (:func:`~shardkit.stores.gguf_fetch.gguf_headers`); errors name the
    location.

    with remote_gguf("s3://models/llama/model-q8_0.gguf") as local, GgufSource(local) as src:
        data = src.read(src.entries()[0], 0, 64)   # one ranged request
    """
    from ..stores.gguf_fetch import gguf_headers

    with gguf_headers(path, token=token) as remote:
        ranged = RangedCheckpoint(remote.local, remote.open_file, name=remote.folder, root=remote.root)
        with _BY_RANGE_LOCK:
            _BY_RANGE[os.path.abspath(remote.root)] = ranged
        try:
            yield remote.local
        finally:
            with _BY_RANGE_LOCK:
                del _BY_RANGE[os.path.abspath(remote.root)]


def _read_by_range(path: str) -> RangedCheckpoint | None:
    """Where the tensor bytes of the GGUF stand-in ``path`` are read (None: a local file, read where it is)."""
    with _BY_RANGE_LOCK:
        return _BY_RANGE.get(os.path.dirname(os.path.abspath(path)))


def open_gguf(path: str, **_: object) -> GgufSource:
    """Open a ``.gguf`` file (the header is validated; no tensor data is read)."""
    return GgufSource(path)


def find_gguf(source: Source) -> GgufSource | None:
    """The :class:`GgufSource` under ``source``'s views (key maps, casts), or None."""
    seen = 0
    while not isinstance(source, GgufSource) and hasattr(source, "inner") and seen < 16:
        source, seen = source.inner, seen + 1
    return source if isinstance(source, GgufSource) else None


class GgufSource(Source):
    """The tensors of one GGUF file under Hugging Face names, dequantized to float32 when quantized.

    Attributes:
        gguf: the parsed header.
        names: HF name → the file's tensor.
        heads: HF name → head count of the q/k row permutation undone on reading.
    """

    def __init__(self, path: str) -> None:
        from ..layouts.gguf_names import name_map

        first, parts = read_split_gguf(path)  # a split GGUF (gguf-split): every part, from the first
        self.gguf: GgufFile = first
        if len(parts) > 1:
            self.gguf.tensors = [t for part in parts for t in part.tensors]
        self.file_of = {t.name: part.path for part in parts for t in part.tensors}  # GGUF tensor name → its file
        self.description, self.paths = path, tuple(part.path for part in parts)
        self._ranges: dict[str, RangeFile] = {}  # a stand-in's path → its object in a store (remote_gguf)
        ranged = _read_by_range(path)
        if ranged is not None:
            self.description = path.replace(ranged.root, ranged.name, 1)
            self._ranges = {p: ranged.open_file(p) for p in self.paths}
            self.kernel_copy = False  # the stand-ins hold holes where the tensors are
        mapping = name_map(self.gguf.architecture, [t.name for t in self.gguf.tensors], self.gguf.metadata,
                           where=path)
        self.names: dict[str, GgufTensor] = {mapping.to_hf.get(t.name, t.name): t for t in self.gguf.tensors}
        self.heads = dict(mapping.heads)
        self._entries = [self._entry(name, t) for name, t in self.names.items()]
        for part in parts:  # held: every read sees the files that were validated
            self._fd(part.path)

    def _entry(self, name: str, tensor: GgufTensor) -> TensorEntry:
        dtype = PLAIN.get(tensor.kind.name, "F32")
        shape = tensor.shape
        if dtype == tensor.kind.name and name not in self.heads:
            return TensorEntry(name, dtype, shape, tensor.nbytes, self.file_of[tensor.name], tensor.offset)
        if name in self.heads and (not shape or shape[0] % (2 * self.heads[name]) or (
                len(shape) == 1 and tensor.kind.block != 1)):
            raise InvalidInputError(f"{self.description}: tensor {tensor.name} has {shape[0] if shape else 0} rows, "
                                    f"not a whole number of {self.heads[name]} heads of even size")
        return TensorEntry(name, dtype, shape, tensor_nbytes(dtype, shape))

    def entries(self) -> list[TensorEntry]:
        return list(self._entries)

    def metadata(self) -> dict[str, str]:
        """What the output's safetensors header records: where it came from."""
        arch = self.gguf.architecture
        return {"converted_from": "gguf", **({"gguf_architecture": arch} if arch else {})}

    def quantized(self) -> dict[str, str]:
        """HF name → ggml type of every tensor that is dequantized on reading (not a plain type)."""
        return {name: t.kind.name for name, t in self.names.items() if t.kind.name not in PLAIN}

    def stored_entries(self) -> list[TensorEntry]:
        """The tensors as stored: HF names, ggml type names as dtypes (``"Q8_0"``), stored byte counts (for ``info``)."""
        return [TensorEntry(name, t.kind.name, t.shape, t.nbytes, self.file_of[t.name], t.offset)
                for name, t in self.names.items()]

    def describe(self) -> dict[str, object]:
        """What ``info`` shows: architecture, ggml types (tensors, stored bytes), which tensors are dequantized."""
        kinds: dict[str, dict[str, int]] = {}
        for t in self.gguf.tensors:
            row = kinds.setdefault(t.kind.name, {"tensors": 0, "bytes": 0})
            row["tensors"], row["bytes"] = row["tensors"] + 1, row["bytes"] + t.nbytes
        ordered = dict(sorted(kinds.items(), key=lambda kv: -kv[1]["bytes"]))
        arch = self.gguf.architecture or "unknown architecture"
        types = ", ".join(f"{k} ×{v['tensors']}" for k, v in ordered.items())
        names = "Hugging Face names, q/k rows unpermuted" if self.heads else "names as stored"
        from ..layouts.gguf_vocab import describe_vocab

        vocab = describe_vocab(self.gguf.metadata, self.gguf.architecture)
        return {"description": f"GGUF v{self.gguf.version} {arch}: {types} ({names})", "scheme": "gguf",
                "architecture": self.gguf.architecture, "ggml_types": ordered,
                "quantized_tensors": len(self.quantized()), "alignment": self.gguf.alignment,
                "metadata_keys": len(self.gguf.metadata), **({"vocabulary": vocab} if vocab is not None else {})}

    def require_dtype(self, cast_to: str | None) -> None:
        """Refuse to write quantized ggml tensors where no loader reads them (safetensors), unless a dtype is given.

        Raises:
            InvalidInputError: quantized tensors and no ``cast_to`` (the message says what ``--dtype`` to add), or
                a ggml type that :mod:`shardkit.layouts.ggml` does not dequantize.
        """
        from ..layouts.ggml import DEQUANTIZABLE

        quantized = self.quantized()
        unknown = sorted({kind for kind in quantized.values() if kind not in DEQUANTIZABLE})
        if unknown:
            raise InvalidInputError(f"{self.description}: ggml type(s) {', '.join(unknown)} are not dequantized by "
                                    f"shardkit (it reads {', '.join(sorted(DEQUANTIZABLE))}); requantize the file with "
                                    "llama.cpp's llama-quantize, e.g. to Q8_0, first")
        if quantized and cast_to is None:
            kinds = sorted(set(quantized.values()))
            raise InvalidInputError(f"{self.description}: {len(quantized)} tensor(s) are ggml-quantized "
                                    f"({', '.join(kinds)}), which safetensors and its loaders cannot hold; add ",
                                    Option("dtype", "bf16"), " "
                                    "(or 'fp16'; 'fp32' keeps gguf's dequantized values exactly), or write GGUF with ",
                                    Option("to", "gguf"))

    def config(self) -> JsonObject | None:
        """The transformers ``config.json`` rebuilt from the metadata of a Llama, Qwen2, Qwen3 or BERT file; None for
        other architectures, and for a Llama file with stacked experts (Mixtral, written as llama: its experts keep
        their GGUF names, so a LlamaForCausalLM config would load a model without them)."""
        from ..layouts.gguf_names import CONFIG_ARCHITECTURES, config_from_metadata

        if self.gguf.architecture not in CONFIG_ARCHITECTURES or any(
                t.name.endswith("_exps.weight") for t in self.gguf.tensors):
            return None
        return config_from_metadata(self.gguf.metadata, has_output="output.weight" in {t.name for t in self.gguf.tensors},
                                    where=self.description)

    def config_bytes(self) -> bytes | None:
        config = self.config()
        return None if config is None else (json.dumps(config, indent=2) + "\n").encode()

    def hf_files(self) -> dict[str, bytes]:
        """The Hugging Face files beside config.json rebuilt from the metadata: the tokenizer
        (:func:`~shardkit.layouts.gguf_tokenizer.tokenizer_files`) and, for a language model, ``generation_config.json``
        with its bos/eos ids. Empty for a file without a vocabulary or an architecture with no config.json here."""
        from ..layouts.gguf_tokenizer import tokenizer_files

        config = self.config()
        if config is None:
            return {}
        files = tokenizer_files(self.gguf.metadata, where=self.description)
        ids = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
        if ids and config.get("model_type") != "bert":
            files["generation_config.json"] = (json.dumps(ids, indent=2) + "\n").encode()
        value = self.gguf.metadata.get("bert.pooling_type")
        pooling = {1: "pooling_mode_mean_tokens", 2: "pooling_mode_cls_token", 3: "pooling_mode_lasttoken"}.get(
            value if isinstance(value, int) else 0)
        if config.get("model_type") == "bert" and pooling is not None:  # sentence-transformers' files, as read
            modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                       {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
            files["modules.json"] = (json.dumps(modules, indent=2) + "\n").encode()
            files["1_Pooling/config.json"] = (json.dumps({"word_embedding_dimension": config["hidden_size"],
                                                           pooling: True}, indent=2) + "\n").encode()
        return files

    # ------------------------------------------------------------------ bytes

    @property
    def by_range(self) -> bool:
        """Whether the tensor bytes are read by range from a store (:func:`remote_gguf`), not from local files."""
        return bool(self._ranges)

    def _pread(self, file: str, nbytes: int, offset: int, name: str) -> bytes | memoryview:
        """``nbytes`` of ``file`` at ``offset`` (tensor ``name``'s): from the local file, or by range from its object
        (each read's byte count checked by the store; a range past its end refused, naming it)."""
        remote = self._ranges.get(file)
        if remote is None:
            return pread_exactly(self._fd(file), nbytes, offset, file=file, name=name)
        out = memoryview(bytearray(nbytes))  # filled in place: no second copy
        remote.read_into(offset, out)
        return out

    def stored_bytes(self, tensor: GgufTensor, begin: int, end: int) -> bytes | memoryview:
        """Bytes ``begin:end`` of ``tensor``'s data as the file stores it (llama.cpp's row order, its ggml type)."""
        return self._pread(self.file_of[tensor.name], end - begin, tensor.offset + begin, tensor.name)

    def matrix(self, name: str) -> tuple[int, int]:
        """``name`` as rows the permutation and the bands move whole: (rows, values per row).

        A tensor of two or more dimensions has ``shape[0]`` rows; a 1-D one is one row, unless it is a
        permuted bias (then each value is a row: it is a plain type, since rows of blocks cannot be 1 value).
        """
        shape = self.names[name].shape
        if len(shape) >= 2:
            return shape[0], math.prod(shape[1:])
        if name in self.heads and shape:
            return shape[0], 1
        return 1, math.prod(shape)

    def raw_rows(self, name: str, row0: int, row1: int) -> bytes | memoryview:
        """Stored bytes of HF rows ``row0:row1`` of tensor ``name`` (whole heads where permuted), in HF row order."""
        import torch

        from ..layouts.gguf_names import unpermute_rows

        tensor = self.names[name]
        rows = self.matrix(name)[0]
        row_bytes = tensor.nbytes // rows
        raw = self._pread(self.file_of[tensor.name], (row1 - row0) * row_bytes, tensor.offset + row0 * row_bytes,
                          tensor.name)
        heads = self.heads.get(name)
        if heads is None:
            return raw
        per_head = rows // heads
        block = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(row1 - row0, row_bytes)
        return unpermute_rows(block, (row1 - row0) // per_head).contiguous().numpy().tobytes()

    def band_rows(self, name: str) -> int:
        """Rows computed at a time for ``name``: about :data:`BAND_BYTES` of float32, whole heads where permuted."""
        rows, row_values = self.matrix(name)
        step = max(1, BAND_BYTES // (4 * max(1, row_values)))
        heads = self.heads.get(name)
        if heads is not None:
            per_head = rows // heads
            step = max(per_head, step // per_head * per_head)
        return min(step, rows)

    def _bands(self, entry: TensorEntry, first_band: int = 0) -> Iterator[bytes | memoryview]:
        """The output bytes of ``entry``, band by band from band ``first_band``."""
        import torch

        from ..formats.dtypes import to_torch
        from ..layouts.ggml import dequantize

        tensor = self.names[entry.name]
        rows = self.matrix(entry.name)[0]
        step = self.band_rows(entry.name)
        for row0 in range(first_band * step, rows, step):
            raw = self.raw_rows(entry.name, row0, min(rows, row0 + step))
            if entry.dtype == tensor.kind.name:
                yield raw
            else:
                yield dequantize(raw, tensor.kind).to(to_torch(entry.dtype)).view(torch.uint8).numpy().tobytes()

    def read(self, entry: TensorEntry, begin: int, end: int) -> bytes | memoryview:
        if entry.file is not None:
            return self._pread(entry.file, end - begin, entry.offset + begin, entry.name)
        rows = self.matrix(entry.name)[0]
        band_bytes = self.band_rows(entry.name) * (entry.nbytes // max(1, rows))
        first = begin // band_bytes if band_bytes else 0
        out, cursor = [], first * band_bytes
        for data in self._bands(entry, first):
            if cursor + len(data) > begin:
                out.append(data[max(0, begin - cursor):max(0, end - cursor)])
            cursor += len(data)
            if cursor >= end:
                break
        return b"".join(out)

    def chunks(self, entry: TensorEntry, chunk_bytes: int) -> Iterator[bytes | memoryview]:
        if entry.file is not None:
            yield from super().chunks(entry, chunk_bytes)
            return
        yield from self._bands(entry)



def load_gguf_tensors(path: str, *, dequantize_to: str) -> tuple[dict[str, torch.Tensor], dict[str, int], dict[str, str]]:
    """A GGUF file as torch tensors under HF names, for conversions written in torch (diffusers' key mapping).

    Plain tensors stored as listed are views of a private memory map of the file (not copied into RAM);
    quantized ones are dequantized, one at a time, to ``dequantize_to`` (a safetensors code).

    Returns:
        ``(tensors, offsets, quantized)``: name → tensor, name → file offset of the mapped ones, and
        name → ggml type of the dequantized ones.
    """
    import torch

    from ..formats.dtypes import to_torch

    src = GgufSource(path)
    try:
        if len(src.paths) > 1:
            raise InvalidInputError(f"{path}: a split GGUF ({len(src.paths)} parts) is read here as one file only; "
                                    "merge it first: convert it with ", Option("to", "gguf"), " to one .gguf")
        # read by range (a store's file): every tensor read into memory, none mapped from the stand-in's hole
        mapped = None if src.by_range else torch.from_file(path, shared=False, size=src.gguf.file_bytes,
                                                           dtype=torch.uint8)
        tensors: dict[str, torch.Tensor] = {}
        offsets: dict[str, int] = {}
        for entry in src.entries():
            if entry.file is not None and mapped is not None:
                view = mapped[entry.offset:entry.offset + entry.nbytes]
                tensors[entry.name] = view.view(to_torch(entry.dtype)).reshape(entry.shape)
                offsets[entry.name] = entry.offset
                continue
            raw = bytearray(src.read(entry, 0, entry.nbytes))
            values = torch.frombuffer(raw, dtype=to_torch(entry.dtype)) if raw else torch.empty(0, dtype=to_torch(
                entry.dtype))
            plain = entry.file is not None  # kept as stored; a dequantized one cast
            tensors[entry.name] = values.reshape(entry.shape) if plain else values.reshape(entry.shape).to(
                to_torch(dequantize_to))
        return tensors, offsets, src.quantized()
    finally:
        src.close()
