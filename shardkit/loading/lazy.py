"""A lazy, read-only ``Mapping[str, torch.Tensor]`` over safetensors checkpoints.

``open`` takes a single file, an index, a sharded folder (transformers or diffusers naming,
variants) or a diffusers component folder. Nothing but the index is read up front; a shard's
header is read and validated (with :mod:`shardkit.formats.header`) the first time one of its tensors
is touched, so a corrupt shard gives a clear error there instead of a crash.

How bytes are read is each shard's *read backend* (``read=``): ``mmap`` gives tensors without a
cast straight from a private (copy-on-write) memory map (no copy; only the pages of the tensors
asked for are ever read); ``pread`` and ``direct`` read each tensor as parallel range reads
straight into freshly allocated memory, and reading the mapping in its order reads the next
tensors ahead within a budget (:mod:`shardkit.reading.prefetch`); ``to_state_dict`` and
``read_many`` read everything with one plan over all shards (:mod:`shardkit.reading.read_plan`);
``auto`` picks per file (:mod:`shardkit.reading.residency`). Each shard is opened once (descriptor
first, header read through it); reads are safe from several threads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import InvalidInputError
from ..formats.header import TensorEntry
from ..reading.host_reads import cast_staging, read_cast, read_into
from ..reading.prefetch import READ_AHEAD_BYTES
from ..reading.readers import Reader
from ..reading.residency import check_backend
from .fresh_reads import FreshReads
from .shards import Shard, check_unchanged, close_shard, open_shard
from .slices import TensorSlice

if TYPE_CHECKING:
    import torch

    from ..devices import DeviceKey

log = logging.getLogger("shardkit")


class LazyCheckpoint(Mapping[str, "torch.Tensor"]):
    """A read-only ``Mapping[str, torch.Tensor]`` over one or more safetensors shards.

    Returned by :func:`open`. Iterating, ``len`` and ``in`` use the index alone; ``shape_of``,
    ``dtype_of``, ``nbytes`` and ``entry`` read only headers; ``ckpt[name]`` reads one tensor
    (zero-copy on the host, or parallel range reads with the ``pread``/``direct`` backends, the
    next tensors in iteration order read ahead within ``read_ahead_bytes``). Use it as a context
    manager, or call :meth:`close` (which cancels the read-ahead and joins its threads).

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
                 index_metadata: dict[str, Any] | None = None, read: str = "auto",
                 read_ahead_bytes: int = READ_AHEAD_BYTES) -> None:
        self.read = check_backend(read)
        self._shard_of = shard_of
        self._shards = shards
        self.description = description
        self.index_metadata = dict(index_metadata or {})
        self._lock = threading.Lock()
        self._open_locks: dict[str, threading.Lock] = {}  # shard path -> held while it opens
        self._local = threading.local()
        self._closed = False
        self._after_close: list[Callable[[], None]] = []
        self._fresh = FreshReads(list(shard_of), budget_bytes=read_ahead_bytes, locate=self._locate,
                                 shards=list(shards.values()), open_shard=self._opened, description=description)

    # -- Mapping -----------------------------------------------------------------------------
    def __getitem__(self, name: str) -> torch.Tensor:
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
        return self._opened(shard)[name]

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name``, from its shard's header."""
        return self.entry(name).shape

    def dtype_of(self, name: str) -> torch.dtype:
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
            self._opened(shard)
            assert shard.header is not None
            merged.update(shard.header.metadata)
        return merged

    @property
    def aliases(self) -> dict[str, str]:
        """Tied names that were written once: dropped alias → stored name (from the metadata)."""
        return {k: v for k, v in self.metadata.items() if v in self._shard_of and k not in self._shard_of}

    # -- data -----------------------------------------------------------------------------------
    def get_tensor(self, name: str, *, device: DeviceKey | None = None,
                   dtype: torch.dtype | None = None, copy: bool = False) -> torch.Tensor:
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

        ckpt.get_tensor("conv_in.weight", device="cuda:0", dtype=torch.bfloat16)
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
        elif host_cast and shard.open_file is None and not self._fresh.is_pending(name):
            assert dtype is not None
            assert shard.fd is not None
            return read_cast(shard.fd, entry, src_dtype, dtype, staging=self._staging())
        elif shard.reader is not None:
            tensor = self._fresh.tensor(shard, entry)
        elif copy or entry.offset % itemsize:
            tensor = torch.empty(entry.shape, dtype=src_dtype)
            assert shard.fd is not None
            read_into(shard.fd, tensor, entry.offset, entry.nbytes, where=f"{entry.file}: tensor {name!r}")
        else:
            if shard.ahead is not None:
                shard.ahead.advance(entry.offset + entry.nbytes)
            tensor = torch.frombuffer(shard.mapped, dtype=src_dtype, count=entry.nbytes // itemsize,
                                      offset=entry.offset).view(entry.shape)
        if not on_host:
            tensor = tensor.to(device)
        if dtype is not None:
            tensor = tensor.to(dtype)
        return tensor

    def get_slice(self, name: str) -> TensorSlice:
        """A handle for partial reads, like ``safetensors.safe_open(...).get_slice``."""
        self._shard_name(name)
        return TensorSlice(self, name)

    def to_state_dict(self, *, device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                      copy: bool = False) -> dict[str, torch.Tensor]:
        """Every tensor, zero-copy on the host by default; ``dtype`` casts floating-point tensors only.

        On the host, ``pread``/``direct`` shards are read in one parallel batch each (:meth:`read_many`);
        onto a GPU, every file goes through the pinned ring (:meth:`to`).
        """
        on_host = device is None or str(device) == "cpu"
        if not on_host:
            assert device is not None
            return self.to(device, dtype=dtype)
        out = {} if copy else self.read_many([n for n in self if self._cast_of(n, dtype) is None])
        for name in self:
            if name not in out:
                out[name] = self.get_tensor(name, dtype=self._cast_of(name, dtype), copy=copy)
        return {name: out[name] for name in self}  # checkpoint order, whichever way each was read

    def _cast_of(self, name: str, dtype: torch.dtype | None) -> torch.dtype | None:
        """The dtype ``name`` is cast to when ``dtype`` is asked for: floating-point tensors only."""
        return dtype if dtype is not None and self.dtype_of(name).is_floating_point else None

    def to(self, device: DeviceKey, *, dtype: torch.dtype | None = None,
           names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Every tensor (or those in ``names``) on ``device``, read through the pinned ring: parallel
        reads in file order into a few pinned slots, ``non_blocking`` copies on side streams, one
        allocation per tensor on the device; ``dtype`` casts floating-point tensors there, after the copy.

        On the host (``"cpu"``) each tensor is read into fresh memory, as ``to_state_dict(copy=True)`` does.

            state = shardkit.open("model/").to("cuda:0", dtype=torch.bfloat16)
        """
        import torch

        from .device_reads import Want, read_devices
        from .pipeline_copy import default_stage

        wanted = list(self) if names is None else names
        if torch.device(device).type == "cpu":  # only the tensors asked for, each into fresh memory
            return {n: self.get_tensor(n, dtype=self._cast_of(n, dtype), copy=True) for n in wanted}
        self.open_shards()
        wants = {n: Want(n, device, self._cast_of(n, dtype) or self.dtype_of(n)) for n in wanted}
        return read_devices(self, wants, default_stage).values

    def slice(self, name: str, dim: int, rank: int, world: int, *, sections: tuple[int, ...] = (),
              device: DeviceKey = "cpu", dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rank ``rank``'s share of ``name`` split over ``world`` ranks along ``dim``, reading only its
        bytes (``sections``: the sizes of fused parts along ``dim``, each split on its own, as a fused
        qkv or gate_up weight is split by vLLM and Megatron).

            q_part = ckpt.slice("model.layers.0.self_attn.o_proj.weight", 1, rank=1, world=4, device="cuda:1")
        """
        from .tensor_parallel import SliceSpec, rank_read, read_rank

        read = rank_read(self, SliceSpec(name, dim, tuple(sections)), rank=rank, world=world)
        values, _ = read_rank(self, {name: read}, device=device, dtype=dtype)
        return values[name]

    def read_many(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Host tensors, stored dtype: ``pread``/``direct`` shards with one plan over all of them
        (:mod:`shardkit.reading.read_plan`: file order, adjacent tensors coalesced, every range in
        flight at once), memory-mapped ones as zero-copy views.

            state = ckpt.read_many(list(ckpt))
        """
        out: dict[str, torch.Tensor] = {}
        planned: list[tuple[Shard, TensorEntry]] = []
        if names:
            self.open_shards()  # every shard's header at once, not one round trip after another
        for name in names:
            shard, entry = self._locate(name)
            if shard.reader is None or entry.nbytes == 0 or self._fresh.is_pending(name):
                out[name] = self.get_tensor(name)
            else:
                planned.append((shard, entry))
        out.update(self._fresh.many(planned))
        return out

    def read_rows(self, name: str, start: int, stop: int) -> tuple[torch.Tensor, bool]:
        """Rows ``start:stop`` of ``name``'s leading dimension, reading only their bytes (for
        :class:`~shardkit.loading.slices.TensorSlice`); ``fresh`` is False for a view of memory
        shared with other tensors (a memory map, a tensor read ahead).

            rows, fresh = ckpt.read_rows("w", 0, 2)
        """
        shard, entry = self._locate(name)
        ahead = self._fresh.peek(name)
        if ahead is not None:
            return ahead[start:stop], False
        if shard.reader is None or entry.nbytes == 0:
            return self.get_tensor(name)[start:stop], False
        return self._fresh.rows(shard, entry, start, stop), True

    def _locate(self, name: str) -> tuple[Shard, TensorEntry]:
        """``name``'s opened (and unchanged) shard and its header record."""
        shard = self._open_shard(self._shard_name(name))
        assert shard.entries is not None
        return shard, shard.entries[name]

    def _staging(self) -> torch.Tensor:
        """This thread's reusable cast buffer."""
        staging = getattr(self._local, "staging", None)
        if staging is None:
            staging = self._local.staging = cast_staging()
        return staging

    # -- shard management -------------------------------------------------------------------------
    def _shard_name(self, name: str) -> str:
        if self._closed:
            raise InvalidInputError(f"{self.description}: checkpoint is closed")
        try:
            return self._shard_of[name]
        except KeyError:
            raise KeyError(name) from None

    def _opened(self, shard: Shard) -> dict[str, TensorEntry]:
        """Open ``shard`` once (descriptor, then its header read through it, then the backend). Each shard
        has its own lock: several shards open at once (:meth:`open_shards`), each only once."""
        if shard.entries is None:
            with self._lock:
                if self._closed:
                    raise InvalidInputError(f"{self.description}: checkpoint is closed")
                lock = self._open_locks.setdefault(shard.path, threading.Lock())
            with lock:
                if shard.entries is None:
                    open_shard(shard, self.read)
                    with self._lock:
                        if self._closed:  # closed while this one was opening: close() may have passed it
                            close_shard(shard)
                            raise InvalidInputError(f"{self.description}: checkpoint is closed")
        assert shard.entries is not None
        return shard.entries

    def open_shards(self) -> None:
        """Open every shard now, several at once (a shard that fails to open fails again, with its
        error, when one of its tensors is asked for). Reads of many tensors call this first."""
        self._fresh.open_all()

    def _open_shard(self, shard_name: str) -> Shard:
        shard = self._shards[shard_name]
        self._opened(shard)
        check_unchanged(shard)
        return shard

    def read_report(self) -> list[dict[str, str | None]]:
        """Each opened shard's read backend and why: ``[{"path", "backend", "reason"}]``.

        ckpt.read_report()
        [{'path': 'out/model.safetensors', 'backend': 'pread', 'reason': 'fuse filesystem ...'}]
        """
        return [{"path": s.path, "backend": s.backend, "reason": s.reason}
                for s in self._shards.values() if s.backend is not None]

    def reader_of(self, name: str) -> Reader | None:
        """The bulk reader of ``name``'s shard (opening it), or None when that shard is memory-mapped."""
        return self._open_shard(self._shard_name(name)).reader

    def descriptor_of(self, name: str) -> int:
        """The open descriptor of ``name``'s shard: the file its header was read from. It stays the
        checkpoint's (closed by :meth:`close`); read through it, never reopen the path."""
        shard, _ = self._locate(name)
        assert shard.fd is not None
        return shard.fd

    def close(self) -> None:
        """Cancel the read-ahead, join the reader threads (bounded) and close the files.

        Tensors already returned stay valid (memory-mapped ones keep their mapping alive).
        """
        with self._lock:
            self._closed = True
        if not self._fresh.close():
            log.warning("%s: reads still running after close; leaving their files open", self.description)
            return  # a blocked read must not land in a reused descriptor
        with self._lock:
            for shard in self._shards.values():
                close_shard(shard)
            after, self._after_close = self._after_close, []
        for release in reversed(after):
            release()

    def close_after(self, release: Callable[[], None]) -> None:
        """Call ``release`` once the files are closed (what the checkpoint was opened from: a remote
        store's connections and its header-only mirror)."""
        self._after_close.append(release)

    def is_ranged(self, name: str) -> bool:
        """True when ``name``'s bytes are read by range from a remote object (its local file is only
        a header-only stand-in, never to be read or pointed to)."""
        return self._shards[self._shard_name(name)].open_file is not None

    def __enter__(self) -> LazyCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
