"""``shardkit.open``: a safetensors file, index or folder as a :class:`~shardkit.loading.lazy.LazyCheckpoint`.

Only the index (a single file: its header) is read here; each shard's header is read through the
descriptor its tensors are then read from (:func:`~shardkit.loading.shards.open_shard`).
"""

from __future__ import annotations

import os

from ..atomic.snapshot import wait_settled
from ..errors import InvalidInputError, SourceNotFoundError
from ..formats.index import find_checkpoint, load_index, shard_file
from ..formats.layout import is_pipeline_folder
from ..formats.names import named_file_kind
from ..reading.prefetch import READ_AHEAD_BYTES
from ..reading.residency import ReadMode, check_backend
from ..sources.ranged import OpenRangeFile, RangedCheckpoint
from .lazy import LazyCheckpoint
from .shards import Shard, open_shard

__all__ = ["open_checkpoint"]


def _single_file(path: str, read: str, read_ahead_bytes: int, open_file: OpenRangeFile | None) -> LazyCheckpoint:
    shard = Shard(path, None, open_file=open_file)
    open_shard(shard, read)  # the descriptor first, the header through it: reads match the header
    assert shard.header is not None
    shard_of = {e.name: path for e in shard.header.entries}
    return LazyCheckpoint(shard_of, {path: shard}, description=f"safetensors file {path}", read=read,
                          read_ahead_bytes=read_ahead_bytes)


def _indexed(path: str, read: str, read_ahead_bytes: int, open_file: OpenRangeFile | None) -> LazyCheckpoint:
    index = load_index(path)
    shards: dict[str, Shard] = {}
    for shard_name in index.shard_names():
        shard_path = shard_file(index.folder, shard_name, where=index.path)  # existence + symlink policy
        names = frozenset(t for t, s in index.weight_map.items() if s == shard_name)
        shards[shard_name] = Shard(shard_path, names, open_file=open_file)
    return LazyCheckpoint(dict(index.weight_map), shards, index_metadata=index.metadata, read=read,
                          read_ahead_bytes=read_ahead_bytes, description=f"sharded checkpoint {path} ({len(shards)} shards)")


def open_checkpoint(path: str | os.PathLike[str] | RangedCheckpoint, *, variant: str | None = None,
                    read: ReadMode = "auto", read_ahead_bytes: int = READ_AHEAD_BYTES) -> LazyCheckpoint:
    """Open a safetensors checkpoint lazily: a file, an index JSON or a (sharded) folder.

    Only the index is read here (a single file: its header); each shard's header is read and
    validated, through the descriptor its tensors are then read from, the first time one of its
    tensors is touched. Opening never modifies anything. The one interrupted-write policy of
    every reader (``open_source``, so ``split``/``convert``/``verify``/``info`` of a source): a
    folder another shardkit process is committing into is waited for; one a crashed shardkit
    write left pending is refused with one line naming ``shardkit recover``, which (like the next
    write into that folder) finishes it.

    Args:
        path: a ``.safetensors`` file, a ``*.safetensors.index*.json`` file, or a folder holding
            one (transformers ``model*`` or diffusers ``diffusion_pytorch_model*`` naming).
        variant: in a folder, the weight variant to open (``"fp16"`` for
            ``model.fp16.safetensors``); None prefers the plain weights.
        read: how tensor bytes are read: ``"mmap"`` (zero-copy views of the file's pages),
            ``"pread"`` (large parallel reads into fresh memory; best on network/FUSE
            filesystems and cold caches), ``"direct"`` (O_DIRECT through aligned bounce buffers,
            ``pread`` where refused) or ``"auto"``: ``mmap`` for warm files, ``pread`` for cold local
            ones, ``direct`` for cold network/FUSE ones (sized by one timed request per mount); ``read_report()`` says what each shard got.
            A :class:`~shardkit.sources.ranged.RangedCheckpoint` (how ``s3://`` is opened) reads
            every shard by parallel ranged requests, whatever ``read`` says.
        read_ahead_bytes: with ``pread``/``direct``, reading the mapping in its order reads the
            next tensors ahead (their ranges in flight while the caller uses the current one)
            up to this many bytes not yet taken (default 256 MiB); 0 turns read-ahead off.
            Memory peaks at the tensors kept plus this budget; ``close()`` cancels it.

    Returns:
        A :class:`LazyCheckpoint`; use it as a context manager, or call ``close()``.

    Raises:
        SourceNotFoundError: the path does not exist, or the folder holds no safetensors
            checkpoint.
        InvalidInputError: the path is a diffusers pipeline folder (open a component folder),
            not safetensors, holds an interrupted shardkit write, or ``read`` is unknown.
        CheckpointIndexError: the index is malformed or names missing or unsafe shard files,
            or a folder holds several candidate checkpoints (pass ``variant`` or the file).
        HeaderError: a single file's header is invalid.

    import shardkit
    with shardkit.open("out/") as ckpt:
        print(len(ckpt), ckpt.shape_of("conv_in.weight"))
        w = ckpt["conv_in.weight"]                             # reads only this tensor
    """
    ranged = path if isinstance(path, RangedCheckpoint) else None
    path = os.fspath(path)
    check_backend(read)
    if not os.path.exists(path):
        raise SourceNotFoundError(f"{path}: no such file or folder")
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    wait_settled(folder)  # the readers' interrupted-write policy: refused, never rolled forward
    kind: str | None
    if os.path.isdir(path):
        if is_pipeline_folder(path):
            raise InvalidInputError(
                f"{path}: is a diffusers pipeline folder; open one component, e.g. {os.path.join(path, 'unet')}"
            )
        layout = find_checkpoint(path, variant=variant)
        path, kind = layout.path, layout.kind
    else:
        kind = named_file_kind(os.path.basename(path))
    if kind in ("index", "file"):
        opener = _indexed if kind == "index" else _single_file
        checkpoint = opener(path, read, read_ahead_bytes, ranged.open_file if ranged is not None else None)
        if ranged is not None and ranged.name:  # the URL, not the temporary header-only folder
            checkpoint.description = checkpoint.description.replace(ranged.root, ranged.name)
        return checkpoint
    raise InvalidInputError(
        f"{path}: not a safetensors checkpoint; convert it first with 'shardkit split {path} OUT/'"
    )

