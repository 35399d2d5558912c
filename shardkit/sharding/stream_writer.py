"""One safetensors shard written front to back into a byte sink: the seam for outputs without seek.

:func:`~shardkit.sharding.writer.write_safetensors` writes a file by offsets (copy-on-write clones
last); an object store takes bytes in order only. :func:`stream_safetensors` writes the same
bytes (the same header, padding included, the tensors in the same order) to anything with a
``write`` method, such as a store's multipart writer (``shardkit.stores.ObjectStore.writer``),
reading each tensor through the source in chunks of at most 64 MiB (casts in 16 MiB), so memory is bounded.
Every byte goes through Python, so the shard's whole manifest record (header region and every
tensor's crc32) is taken on the way: nothing is read back.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Protocol

from ..formats.header import build_header
from ..formats.manifest import FileDigest, TensorDigest
from ..sources.base import Source
from .writer import CHUNK_BYTES, ProgressFn, TensorWrite, WrittenFile, _check_length, cast_chunks, clone_alignment

__all__ = ["ByteSink", "StreamedFile", "stream_safetensors"]


class ByteSink(Protocol):
    """Where a streamed shard goes: bytes in order, each call's count taken whole."""

    def write(self, data: bytes | memoryview) -> None: ...


@dataclass(frozen=True)
class StreamedFile(WrittenFile):
    """A :class:`~shardkit.sharding.writer.WrittenFile` with its manifest record (``digest``), taken on the way."""

    digest: FileDigest = field(default_factory=lambda: FileDigest(0, None))


def stream_safetensors(sink: ByteSink, name: str, writes: list[TensorWrite], source: Source, *,
                       metadata: dict[str, str] | None = None, progress: ProgressFn | None = None,
                       chunk_bytes: int = CHUNK_BYTES) -> StreamedFile:
    """Write ``writes`` as one safetensors file into ``sink``, byte for byte what ``write_safetensors`` writes.

    Returns a :class:`StreamedFile` named ``name`` with every tensor's crc32 and the file's
    manifest record (the same record :func:`~shardkit.sharding.digest.digest_file` makes of the file).
    ``chunk_bytes``: how much of a tensor is read from the source at a time (memory, not bytes, depends on it).

    with store.writer("model-00001-of-00002.safetensors") as w:
        stream_safetensors(w, w.name, writes, source); w.commit()
    """
    head, begins = build_header([p.out for p in writes], metadata=dict(sorted((metadata or {}).items())),
                                data_start_mod=clone_alignment(writes))
    tick = progress or (lambda n: None)
    sink.write(head)
    file_bytes, crc32s, tensors = len(head), {}, {}
    for p, begin in zip(writes, begins, strict=True):
        crc, done = 0, 0
        chunks = cast_chunks(p, source) if p.src.dtype != p.out.dtype else source.chunks(p.src, chunk_bytes)
        for chunk in chunks:
            sink.write(chunk)
            crc = zlib.crc32(chunk, crc)
            nbytes = memoryview(chunk).nbytes
            done += nbytes
            tick(nbytes)
        if p.src.dtype == p.out.dtype:
            _check_length(p.src, done, p.src.nbytes, source)
        elif done != p.out.nbytes:
            _check_length(p.out, done, p.out.nbytes, source)
        crc32s[p.out.name] = f"{crc:08x}"
        tensors[p.out.name] = TensorDigest(begin, begin + done, crc32s[p.out.name])
        file_bytes += done
    digest = FileDigest(file_bytes, None, len(head), f"{zlib.crc32(head):08x}", tensors)
    return StreamedFile(name, file_bytes, 0, crc32s, digest)
