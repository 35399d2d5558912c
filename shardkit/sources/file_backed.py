"""A single-file checkpoint as torch tensors backed by the file, and sources over tensors derived from it.

A conversion written in torch (diffusers' single-file key mapping) needs a state dict of
tensors. Loaded here, those tensors are memory-mapped (safetensors ``load_file``,
``torch.load(mmap=True)``), so the checkpoint is not copied into RAM. Most converted tensors are
the same tensors under new names, or contiguous slices of them (split attention weights): their
bytes are still a run of the checkpoint file, so :func:`file_backed_source` gives them a file and
offset and the writer copies them kernel-side (``copy_file_range``, reflinks) without reading
them through the process. Tensors the conversion built anew are read from memory.
"""

from __future__ import annotations

import bisect
import os
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidInputError, Option
from ..formats.header import TensorEntry
from ..formats.index import Naming
from .memory import MemorySource, check_all_tensors
from .pickle import _ends_match

__all__ = ["FileBacked", "file_backed_source", "load_file_backed"]


@dataclass
class FileBacked:
    """A checkpoint file's state dict and where each tensor's bytes start in the file.

    Attributes:
        path: the checkpoint file.
        tensors: name → tensor (memory-mapped where the format allows).
        offsets: name → absolute offset of the tensor's bytes in ``path``, for the tensors
            that are stored there contiguously (all of a safetensors file; the located ones of a
            zip pickle).
    """

    path: str
    tensors: dict[str, Any]
    offsets: dict[str, int]


def load_file_backed(path: str, *, key: str | None = None, dequantize_to: str = "BF16") -> FileBacked:
    """Load a ``.safetensors`` file, a ``.gguf`` file or a pickle (``weights_only``) as memory-mapped tensors.

    Args:
        path: the checkpoint file.
        key: for pickles, the nested dict holding the state dict (default: auto).
        dequantize_to: for GGUF files, the dtype code ggml-quantized tensors are dequantized to.

    Returns:
        The :class:`FileBacked` state dict.

    len(load_file_backed("v1-5-pruned.safetensors").tensors)
    1131
    """
    if not os.path.isfile(path):
        raise InvalidInputError(f"{path}: not a checkpoint file (.safetensors, .ckpt, .pt, .pth, .bin)")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        from ..formats.header import read_header

        if key is not None:
            raise InvalidInputError(Option("key"),
                                    f" applies to pickles; {path} is a safetensors file with one flat state dict")
        header = read_header(path)  # validated by shardkit first: a hostile header gets shardkit's error
        return FileBacked(path, load_file(path), {e.name: e.offset for e in header.entries})
    if path.endswith(".gguf"):
        from .gguf import load_gguf_tensors

        tensors, offsets, _ = load_gguf_tensors(path, dequantize_to=dequantize_to)
        return FileBacked(path, tensors, offsets)
    from .pickle import load_pickle, locate_in_file, select_state_dict

    loaded = load_pickle(path)
    tensors = dict(select_state_dict(loaded, key=key, where=path))
    check_all_tensors(tensors, where=path)
    offsets = locate_in_file(path, tensors, every=loaded) if zipfile.is_zipfile(path) else {}
    return FileBacked(path, tensors, offsets)


def file_backed_source(tensors: Mapping[str, Any], backing: FileBacked, *, description: str,
                       naming: Naming = Naming()) -> MemorySource:
    """A source over ``tensors``; those that view a contiguous run of ``backing``'s file carry its offset.

    Every name is written (no alias detection): two names for one source tensor are two
    parameters that the model loads separately.

    fb = load_file_backed("sd.safetensors")
    src = file_backed_source({"conv_in.weight": fb.tensors["model.diffusion_model.input_blocks.0.0.weight"]},
                             fb, description="unet")
    src.entries()[0].file
    'sd.safetensors'
    """
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), backing.offsets[name])
                   for name, t in backing.tensors.items()
                   if name in backing.offsets and t.numel() and t.is_contiguous() and t.device.type == "cpu")
    source = MemorySource(tensors, description=description, naming=naming, dedupe=False)
    fd = source._fd(backing.path)  # held: kernel copies read the file that was loaded
    source._entries = [_locate(entry, tensors[entry.name], spans, backing.path, fd) for entry in source._entries]
    source.paths = (backing.path,)
    return source


def _locate(entry: TensorEntry, tensor: Any, spans: list[tuple[int, int, int]], path: str, fd: int) -> TensorEntry:
    """``entry`` with the file offset of ``tensor``'s bytes when they lie inside one loaded tensor."""
    if not spans or not tensor.numel() or not tensor.is_contiguous() or tensor.device.type != "cpu":
        return entry
    ptr = tensor.data_ptr()
    i = bisect.bisect_right(spans, (ptr, float("inf"), 0)) - 1
    if i < 0 or ptr + entry.nbytes > spans[i][1]:
        return entry
    start, _, offset = spans[i]
    located = offset + ptr - start
    if not _ends_match(fd, located, tensor):  # a wrong guess costs speed, never correctness
        return entry
    return TensorEntry(entry.name, entry.dtype, entry.shape, entry.nbytes, path, located)

