"""The files ``convert --to gguf`` writes: one ``.gguf``, or with ``max_shard_size`` llama.cpp's gguf-split layout.

The split is gguf-split's (``convert_hf_to_gguf.py --split-max-size``): runs of tensors in order, a file closed
before a tensor would take it past the limit, named ``NAME-00001-of-0000N.gguf``...; the first file holds every
key, and each file ``split.no`` (u16, from 0), ``split.count`` (u16) and ``split.tensors.count`` (i32). Every file
is written to a temporary file and all are published once all are written (:mod:`shardkit.formats.gguf_split`
reads them back).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

from ..formats.gguf import INT32, UINT16, Value, build_gguf_header, ggml_type, padded, tensor_nbytes_ggml
from ..formats.index import Naming
from ..sources import Source
from .gguf_bytes import PlannedTensor, write_gguf_file
from .options import DEFAULT_MAX_SHARD_BYTES, ProgressCallback
from .plan import ShardPlan, plan_shards

__all__ = ["GgufFiles", "Row", "plan_files", "split_files", "write_files"]

Row = tuple[str, int, Value, int | None]  # a metadata key: (key, value type, value, array item type or None)
GgufFiles = list[tuple[str, bytes, list[PlannedTensor]]]  # (file name, header, tensors) of each file


def plan_files(tensors: list[PlannedTensor], output: str, *, max_shard_bytes: int) -> ShardPlan:
    """Which tensors go in which file of ``output`` (a path ending in ``.gguf``): all in it under the default shard
    size, else gguf-split's runs of tensors (no index file: a split GGUF's first file is its index)."""
    base = os.path.basename(output)
    sizes = [(t.name, padded(tensor_nbytes_ggml(ggml_type(t.kind), tuple(reversed(t.entry.shape))))) for t in tensors]
    limit = 2**62 if max_shard_bytes == DEFAULT_MAX_SHARD_BYTES else max_shard_bytes
    plan = plan_shards(sizes, max_shard_bytes=limit, naming=Naming(base[: -len(".gguf")], ext="gguf"),
                       rule="sequential")  # gguf-split's: runs of tensors, a file closed before it would pass
    return dataclasses.replace(plan, index_filename=None)


def split_files(plan: ShardPlan, tensors: list[PlannedTensor], metadata: list[Row]) -> GgufFiles:
    """``(file name, header, tensors)`` of each file: one file, or llama.cpp's gguf-split layout (every key in the
    first file, then in each ``split.no`` (u16, from 0), ``split.count`` (u16), ``split.tensors.count`` (i32))."""
    by_name = {t.name: t for t in tensors}
    out = []
    for number, shard in enumerate(plan.shards):
        part = [by_name[name] for name in shard.names]
        rows = list(metadata) if number == 0 else []
        if len(plan.shards) > 1:
            rows += [("split.no", UINT16, number, None), ("split.count", UINT16, len(plan.shards), None),
                     ("split.tensors.count", INT32, len(tensors), None)]
        head, _ = build_gguf_header(rows, [(t.name, tuple(reversed(t.entry.shape)), ggml_type(t.kind)) for t in part])
        out.append((shard.filename, head, part))
    return out


def write_files(folder: str, files: GgufFiles, src: Source, *, overwrite: bool,
                 progress: ProgressCallback | None) -> None:
    """Every file into a temporary file; all published once all are written (none if one fails)."""
    from ..atomic.commit import file_transaction

    total = sum(t.entry.nbytes for _, _, part in files for t in part)
    done = 0
    with contextlib.ExitStack() as stack:
        for name, head, part in files:
            tmp = stack.enter_context(file_transaction(os.path.join(folder, name), overwrite=overwrite))
            before = done

            def tick(written: int, _total: int, before: int = before) -> None:
                if progress is not None:
                    progress(before + written, total)

            write_gguf_file(tmp, head, part, src, progress=tick)
            done += sum(t.entry.nbytes for t in part)
