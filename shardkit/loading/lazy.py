"""A lazy, read-only ``Mapping[str, torch.Tensor]`` over safetensors checkpoints.

``open`` takes a single file, an index, a sharded folder (transformers or diffusers naming,
variants) or a diffusers component folder. Nothing but the index is read up front; a shard's
header is read and validated (with :mod:`shardkit.formats.header`) the first time one of its tensors
is touched, so a corrupt shard gives a clear error there instead of a crash.

How bytes are read is each shard's *read backend* (``read=``): ``mmap`` gives tensors without a
cast straight from a private (copy-on-write) memory map (no copy; only the pages of the tensors
asked for are ever read); ``pread`` and ``direct`` read each tensor with large parallel reads into
freshly allocated memory (:mod:`shardkit.loading.readers`); ``auto`` picks per file
(:mod:`shardkit.loading.residency`). Each shard is opened once; reads are safe from several threads.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ..atomic.journal import JOURNAL
from ..errors import (
    HeaderError,
    InvalidInputError,
    SourceNotFoundError,
)
from ..formats.header import TensorEntry, read_header
from ..formats.index import find_checkpoint, load_index, shard_file
from .readers import Reader, job_for, open_reader, pread_exact, read_entries
from .shards import Shard, TensorSlice, check_shard_names, check_unchanged
from .residency import check_backend, choose_backend

if TYPE_CHECKING:
    import torch

_CAST_CHUNK_BYTES = 16 << 20
log = logging.getLogger("shardkit")


class LazyCheckpoint(Mapping):
    """A read-only ``Mapping[str, torch.Tensor]`` over one or more safetensors shards.

    Returned by :func:`open`. Iterating, ``len`` and ``in`` use the index alone; ``shape_of``,
    ``dtype_of``, ``nbytes`` and ``entry`` read only headers; ``ckpt[name]`` reads one tensor
    (zero-copy on the host). Use it as a context manager, or call :meth:`close`.

    Attributes:
        description: what was opened (``"sharded checkpoint out/model.safetensors.index.json
            (3 shards)"``), for messages.
        index_metadata: the index file's ``metadata`` object (``total_size``...); empty for a
            single file.
        paths: the shard files.
        metadata: the shards' ``__metadata__`` maps, merged (reads every header).
        aliases: tied names that were written once: dropped alias → stored name.
    """

    def __init__(self, shard_of: dict[str, str], shards: dict[str, Shard], *, description: str,
                 index_metadata: dict[str, Any] | None = None, read: str = "auto") -> None:
        self.read = check_backend(read)
        self._shard_of = shard_of
        self._shards = shards
        self.description = description
        self.index_metadata = dict(index_metadata or {})
        self._lock = threading.Lock()
        self._local = threading.local()
        self._closed = False

    # -- Mapping -----------------------------------------------------------------------------
    def __getitem__(self, name: str) -> "torch.Tensor":
        return self.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._shard_of)

    def __len__(self) -> int:
        return len(self._shard_of)

    def __contains__(self, name: object) -> bool:
        return name in self._shard_of

    def __repr__(self) -> str:
        return f"<LazyCheckpoint {self.description}: {len(self)} tensors>"

    # -- metadata without reading data ---------------------------------------------------------
    @property
    def paths(self) -> list[str]:
        """The shard files, in index order."""
        return [s.path for s in self._shards.values()]

    def entry(self, name: str) -> TensorEntry:
        """The header record of ``name``: safetensors dtype code, shape, byte size, file and offset."""
        shard = self._shards[self._shard_name(name)]
        return self._load_header(shard)[name]

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name``, from its shard's header."""
        return self.entry(name).shape

    def dtype_of(self, name: str) -> "torch.dtype":
        """The stored ``torch.dtype`` of tensor ``name``, from its shard's header."""
        from ..formats.dtypes import to_torch

        return to_torch(self.entry(name).dtype)

    def nbytes(self, name: str | None = None) -> int:
        """Bytes of one tensor, or of the whole checkpoint when ``name`` is None."""
        if name is not None:
            return self.entry(name).nbytes
        return sum(self.entry(n).nbytes for n in self)

    @property
    def metadata(self) -> dict[str, str]:
        """The shards' ``__metadata__`` maps, merged."""
        merged: dict[str, str] = {}
        for shard in self._shards.values():
            self._load_header(shard)
            assert shard.header is not None
            merged.update(shard.header.metadata)
        return merged

    @property
    def aliases(self) -> dict[str, str]:
        """Tied names that were written once: dropped alias → stored name (from the metadata)."""
        return {k: v for k, v in self.metadata.items() if v in self._shard_of and k not in self._shard_of}

    # -- data -----------------------------------------------------------------------------------
    def get_tensor(self, name: str, *, device: "str | torch.device | None" = None,
                   dtype: "torch.dtype | None" = None, copy: bool = False) -> "torch.Tensor":
        """Read one tensor.

        Without ``copy`` the host tensor views the shard's private memory map (no copy; pages are
        read when touched; writes stay private). A host-side cast, ``copy=True``, a tensor not
        aligned to its element size or a ``pread``/``direct`` shard read into fresh memory instead. A ``device``
        gets the bytes moved there first and cast there.

        Args:
            name: the tensor's key.
            device: where to put it (``"cuda:0"``, ``0``...); None or ``"cpu"`` keeps it on the host.
            dtype: cast to this dtype; None keeps the stored one.
            copy: read into fresh memory even when a zero-copy view is possible.

        Returns:
            The tensor, with the stored shape.

        Raises:
            KeyError: no tensor is named ``name``.
            HeaderError: the shard's header is invalid or the file is truncated.
            CheckpointIndexError: the shard does not hold the tensors its index assigns to it.
            InvalidInputError: the checkpoint is closed, or the shard changed on disk since it was opened.

        >>> ckpt.get_tensor("conv_in.weight", device="cuda:0", dtype=torch.bfloat16)  # doctest: +SKIP
        """
        import torch

        from ..formats.dtypes import to_torch

        entry = self.entry(name)
        shard = self._open_shard(self._shard_of[name])
        src_dtype = to_torch(entry.dtype)
        itemsize = torch.empty((), dtype=src_dtype).element_size()
        on_host = device is None or torch.device(device).type == "cpu"
        host_cast = on_host and dtype is not None and dtype != src_dtype
        if entry.nbytes == 0:
            tensor = torch.empty(entry.shape, dtype=src_dtype)
        elif host_cast:
            assert dtype is not None
            return self._read_cast(shard, entry, src_dtype, itemsize, dtype)
        elif shard.reader is not None:
            tensor = torch.empty(entry.shape, dtype=src_dtype)
            shard.reader.read_all([job_for(tensor, offset=entry.offset, nbytes=entry.nbytes,
                                           where=f"{entry.file}: tensor {name!r}")])
        elif copy or entry.offset % itemsize:
            tensor = torch.empty(entry.shape, dtype=src_dtype)
            assert shard.fd is not None
            read_into(shard.fd, tensor, entry.offset, entry.nbytes, where=f"{entry.file}: tensor {name!r}")
        else:
            tensor = torch.frombuffer(shard.mapped, dtype=src_dtype, count=entry.nbytes // itemsize,
                                      offset=entry.offset).view(entry.shape)
        if not on_host:
            tensor = tensor.to(device)
        if dtype is not None:
            tensor = tensor.to(dtype)
        return tensor

    def _read_cast(self, shard: Shard, entry: TensorEntry, src_dtype: "torch.dtype", itemsize: int,
                   dtype: "torch.dtype") -> "torch.Tensor":
        """Cast through one small reusable buffer per thread: memory never depends on the tensor's size
        (a whole-tensor temporary would also fragment the heap, pinning a second copy's worth of RAM).
        """
        import torch

        out = torch.empty(entry.shape, dtype=dtype)
        flat = out.view(-1)
        staging = getattr(self._local, "staging", None)
        if staging is None:
            staging = self._local.staging = torch.empty(_CAST_CHUNK_BYTES, dtype=torch.uint8)
        per_chunk = max(1, _CAST_CHUNK_BYTES // itemsize)
        assert shard.fd is not None
        for start in range(0, flat.numel(), per_chunk):
            count = min(per_chunk, flat.numel() - start)
            chunk = staging[: count * itemsize]
            read_into(shard.fd, chunk, entry.offset + start * itemsize, count * itemsize,
                      where=f"{entry.file}: tensor {entry.name!r}")
            flat[start:start + count].copy_(chunk.view(src_dtype))
        return out

    def get_slice(self, name: str) -> TensorSlice:
        """A handle for partial reads, like ``safetensors.safe_open(...).get_slice``."""
        self._shard_name(name)
        return TensorSlice(self, name)

    def to_state_dict(self, *, device: "str | torch.device | None" = None, dtype: "torch.dtype | None" = None,
                      copy: bool = False) -> dict[str, "torch.Tensor"]:
        """Every tensor, zero-copy on the host by default; ``dtype`` casts floating-point tensors only.

        On the host, ``pread``/``direct`` shards are read in one parallel batch each (:meth:`read_many`).
        """
        on_host = device is None or str(device) == "cpu"
        out = self.read_many([n for n in self if dtype is None or not self.dtype_of(n).is_floating_point]) \
            if on_host and not copy else {}
        for name in self:
            if name in out:
                continue
            cast = dtype if dtype is not None and self.dtype_of(name).is_floating_point else None
            out[name] = self.get_tensor(name, device=device, dtype=cast, copy=copy)
        return {name: out[name] for name in self}  # checkpoint order, whichever way each was read

    def read_many(self, names: list[str]) -> dict[str, "torch.Tensor"]:
        """Host tensors, stored dtype: ``pread``/``direct`` shards in one batch of long parallel reads
        (:func:`shardkit.loading.readers.read_entries`), memory-mapped ones as zero-copy views.

        >>> state = ckpt.read_many(list(ckpt))                  # doctest: +SKIP
        """
        from ..formats.dtypes import to_torch

        per_shard: dict[str, list[TensorEntry]] = {}
        out: dict[str, "torch.Tensor"] = {}
        for name in names:
            shard = self._open_shard(self._shard_name(name))
            if shard.reader is None:
                out[name] = self.get_tensor(name)
            else:
                per_shard.setdefault(self._shard_of[name], []).append(self.entry(name))
        for shard_name, entries in per_shard.items():
            reader = self._open_shard(shard_name).reader
            assert reader is not None
            out.update(read_entries(reader, entries, {e.name: to_torch(e.dtype) for e in entries}))
        return out

    # -- shard management -------------------------------------------------------------------------
    def _shard_name(self, name: str) -> str:
        if self._closed:
            raise InvalidInputError(f"{self.description}: checkpoint is closed")
        try:
            return self._shard_of[name]
        except KeyError:
            raise KeyError(name) from None

    def _load_header(self, shard: Shard) -> dict[str, TensorEntry]:
        if shard.entries is None:
            with self._lock:
                if shard.entries is None:
                    header = read_header(shard.path)
                    check_shard_names(shard, header)
                    shard.header = header
                    shard.entries = header.by_name()
        return shard.entries

    def _open_shard(self, shard_name: str) -> Shard:
        shard = self._shards[shard_name]
        self._load_header(shard)
        if shard.fd is None:
            with self._lock:
                if shard.fd is None:
                    self._open_fd(shard)
        check_unchanged(shard)
        return shard

    def _open_fd(self, shard: Shard) -> None:
        fd = os.open(shard.path, os.O_RDONLY)
        try:
            choice = choose_backend(shard.path, self.read, fd=fd)
            st = os.fstat(fd)
            shard.identity = (st.st_ino, st.st_size, st.st_mtime_ns)
            assert shard.header is not None
            if st.st_size < shard.header.file_bytes:
                raise HeaderError(f"{shard.path}: file is {st.st_size} bytes, shorter than the "
                                  f"{shard.header.file_bytes} its header says (truncated?)")
            if choice.backend == "mmap":
                shard.mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
            else:
                shard.reader = open_reader(shard.path, choice.backend, fd=fd, remote=choice.remote is not None)
        except (OSError, ValueError) as e:
            os.close(fd)
            raise HeaderError(f"{shard.path}: cannot open the file for reading ({e})") from e
        except BaseException:
            os.close(fd)
            raise
        shard.fd = fd
        shard.backend = shard.reader.backend if shard.reader is not None else "mmap"
        shard.reason = choice.reason if shard.backend == choice.backend else f"{choice.reason}; O_DIRECT refused"
        log.debug("%s: read backend %s (%s)", shard.path, shard.backend, shard.reason)

    def read_report(self) -> list[dict[str, str | None]]:
        """Each opened shard's read backend and why: ``[{"path", "backend", "reason"}]``.

        >>> ckpt.read_report()                                   # doctest: +SKIP
        [{'path': 'out/model.safetensors', 'backend': 'pread', 'reason': 'fuse filesystem ...'}]
        """
        return [{"path": s.path, "backend": s.backend, "reason": s.reason}
                for s in self._shards.values() if s.backend is not None]

    def reader_of(self, name: str) -> Reader | None:
        """The bulk reader of ``name``'s shard (opening it), or None when that shard is memory-mapped."""
        return self._open_shard(self._shard_name(name)).reader

    def close(self) -> None:
        """Close the files. Tensors already returned stay valid (they keep their mapping alive)."""
        with self._lock:
            self._closed = True
            for shard in self._shards.values():
                if shard.fd is not None:
                    os.close(shard.fd)
                    shard.fd = None
                if shard.reader is not None:
                    shard.reader.close()
                    shard.reader = None
                # Never mmap.close(): torch.frombuffer keeps a reference to the map but holds no
                # buffer export, so closing would unmap pages live tensors still point to. Dropping
                # our reference unmaps it once the last zero-copy tensor is gone.
                shard.mapped = None

    def __enter__(self) -> "LazyCheckpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_into(fd: int, tensor: "torch.Tensor", offset: int, nbytes: int, *, where: str) -> None:
    """``pread`` ``nbytes`` at ``offset`` straight into a contiguous CPU tensor's memory."""
    pread_exact(fd, tensor.data_ptr(), offset, nbytes, where=where)


def _check_no_journal(folder: str) -> None:
    if os.path.exists(os.path.join(folder, JOURNAL)):
        raise InvalidInputError(
            f"{folder}: an interrupted shardkit write left {JOURNAL} here; run "
            f"'shardkit recover {folder}' to finish it first"
        )


def _single_file(path: str, read: str) -> LazyCheckpoint:
    header = read_header(path)
    shard = Shard(path, None, header=header, entries=header.by_name())
    shard_of = {e.name: path for e in header.entries}
    return LazyCheckpoint(shard_of, {path: shard}, description=f"safetensors file {path}", read=read)


def _indexed(path: str, read: str) -> LazyCheckpoint:
    index = load_index(path)
    shards: dict[str, Shard] = {}
    for shard_name in index.shard_names():
        shard_path = shard_file(index.folder, shard_name, where=index.path)  # existence + symlink policy
        names = frozenset(t for t, s in index.weight_map.items() if s == shard_name)
        shards[shard_name] = Shard(shard_path, names)
    return LazyCheckpoint(dict(index.weight_map), shards, index_metadata=index.metadata, read=read,
                          description=f"sharded checkpoint {path} ({len(shards)} shards)")


def open(path: str | os.PathLike[str], *, variant: str | None = None, read: str = "auto") -> LazyCheckpoint:  # noqa: A001
    """Open a safetensors checkpoint lazily: a file, an index JSON or a (sharded) folder.

    Only the index is read here; each shard's header is read and validated the first time one
    of its tensors is touched. Opening never modifies anything. A folder with an unfinished
    shardkit write is refused (``shardkit recover`` finishes it).

    Args:
        path: a ``.safetensors`` file, a ``*.safetensors.index*.json`` file, or a folder holding
            one (transformers ``model*`` or diffusers ``diffusion_pytorch_model*`` naming).
        variant: in a folder, the weight variant to open (``"fp16"`` for
            ``model.fp16.safetensors``); None prefers the plain weights.
        read: how tensor bytes are read: ``"mmap"`` (zero-copy views of the file's pages),
            ``"pread"`` (large parallel reads into fresh memory; best on network/FUSE
            filesystems and cold caches), ``"direct"`` (O_DIRECT through aligned bounce buffers,
            ``pread`` where refused) or ``"auto"``: ``pread`` for network/FUSE filesystems and
            cold files, ``mmap`` for warm local ones; ``read_report()`` says what each shard got.

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

    >>> import shardkit
    >>> with shardkit.open("out/") as ckpt:                       # doctest: +SKIP
    ...     print(len(ckpt), ckpt.shape_of("conv_in.weight"))
    ...     w = ckpt["conv_in.weight"]                             # reads only this tensor
    """
    path = os.fspath(path)
    check_backend(read)
    if not os.path.exists(path):
        raise SourceNotFoundError(f"{path}: no such file or folder")
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    _check_no_journal(folder)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "model_index.json")):
            raise InvalidInputError(
                f"{path}: is a diffusers pipeline folder; open one component, e.g. {os.path.join(path, 'unet')}"
            )
        layout = find_checkpoint(path, variant=variant)
        path = layout.path
        if layout.kind == "file":
            return _single_file(path, read)
    if path.endswith(".json"):
        return _indexed(path, read)
    if path.endswith(".safetensors"):
        return _single_file(path, read)
    raise InvalidInputError(
        f"{path}: not a safetensors checkpoint; convert it first with 'shardkit split {path} OUT/'"
    )

