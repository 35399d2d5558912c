"""Which parts of a multipart upload are copied inside the store, and which travel through the client.

Pure: no I/O. An output object is a header (bytes the client builds) followed by tensor bytes
that lie, unchanged, in source objects of the same store. S3 composes an object from parts:
``UploadPart`` (bytes sent by the client) or ``UploadPartCopy`` (one contiguous byte range of
ONE source object, copied server-side). Its limits: every part but the last is at least 5 MiB,
none is over 5 GiB, at most 10,000 parts. :func:`plan_copy_parts` turns ``header + spans`` into
parts that honour them:

- The first part is the header plus enough tensor bytes (fetched by ranged GETs) to reach 5 MiB.
- After it, each run of spans contiguous in one source object becomes copy parts (cut evenly
  into pieces of at most 5 GiB), when what is left of it after topping up the client part
  before it is at least 5 MiB.
- A piece too small to be a part of its own joins a client part; client parts are cut at
  ``client_part_bytes`` (the writer's part size), so the client holds one part at a time.

>>> MiB = 1 << 20
>>> parts = plan_copy_parts(100, [SourceSpan("a", 1000, 1000 + 12 * MiB)])
>>> [type(p).__name__ for p in parts]
['ClientPart', 'CopyPart']
>>> parts[0].nbytes, parts[1].begin - 1000 + 100
(5242880, 5242880)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ..errors import CopyRefusedError as CopyRefusedError  # re-exported: defined with every public error
from ..errors import ShardkitWriteError

__all__ = ["MAX_COPY_PART_BYTES", "MAX_PARTS", "MIN_PART_BYTES", "ClientPart", "CopyPart", "CopyRefusedError", "Piece", "SourceSpan",
           "client_bytes", "copied_bytes", "plan_copy_parts", "refused_copy"]

MIN_PART_BYTES = 5 << 20  # S3: every part but the last
MAX_COPY_PART_BYTES = 5 << 30  # S3: the largest part
MAX_PARTS = 10_000
CLIENT_PART_BYTES = 16 << 20  # the multipart writer's part (stores.base.PART_BYTES)


@dataclass(frozen=True)
class SourceSpan:
    """Bytes ``[begin, end)`` of the source object ``name``, copied unchanged into the output."""

    name: str
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Piece:
    """Bytes a client part sends: ``[begin, end)`` of the header (``name`` None) or of a source object."""

    name: str | None
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class ClientPart:
    """A part sent through the client (``UploadPart``): the header's bytes and ranged GETs, in order."""

    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


@dataclass(frozen=True)
class CopyPart:
    """A part copied in the store (``UploadPartCopy``): bytes ``[begin, end)`` of the source object ``name``."""

    name: str
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


Part = ClientPart | CopyPart


def _runs(spans: Sequence[SourceSpan]) -> list[SourceSpan]:
    """Adjacent spans of one object merged (empty ones dropped)."""
    runs: list[SourceSpan] = []
    for s in spans:
        if s.begin < 0 or s.end < s.begin:
            raise ValueError(f"invalid span {s}")
        if not s.nbytes:
            continue
        if runs and runs[-1].name == s.name and runs[-1].end == s.begin:
            runs[-1] = SourceSpan(s.name, runs[-1].begin, s.end)
        else:
            runs.append(s)
    return runs


class _Planner:
    def __init__(self, *, min_part_bytes: int, max_copy_part_bytes: int, client_part_bytes: int) -> None:
        self.min = min_part_bytes
        self.max_copy = max_copy_part_bytes
        self.client_max = max(client_part_bytes, min_part_bytes)
        self.parts: list[Part] = []
        self.pending: list[Piece] = []
        self.pending_bytes = 0

    def send(self, piece: Piece) -> None:
        """Add ``piece`` to the client part, cutting a full part whenever it reaches ``client_max``."""
        begin = piece.begin
        while begin < piece.end:
            take = min(piece.end - begin, self.client_max - self.pending_bytes)
            self.pending.append(Piece(piece.name, begin, begin + take))
            self.pending_bytes += take
            begin += take
            if self.pending_bytes == self.client_max:
                self.flush()

    def flush(self) -> None:
        if self.pending:
            self.parts.append(ClientPart(tuple(self.pending)))
        self.pending, self.pending_bytes = [], 0

    def run(self, run: SourceSpan) -> None:
        top_up = max(0, self.min - self.pending_bytes) if self.pending else 0
        if run.nbytes - top_up < self.min:
            self.send(Piece(run.name, run.begin, run.end))  # too small to stand alone: through the client
            return
        if top_up:
            self.send(Piece(run.name, run.begin, run.begin + top_up))
        self.flush()
        self.copy(SourceSpan(run.name, run.begin + top_up, run.end))

    def copy(self, span: SourceSpan) -> None:
        """Copy parts of at most ``max_copy`` bytes, cut evenly (so none falls under ``min``)."""
        count = -(-span.nbytes // self.max_copy)
        size = -(-span.nbytes // count)
        for begin in range(span.begin, span.end, size):
            self.parts.append(CopyPart(span.name, begin, min(begin + size, span.end)))


def plan_copy_parts(header_bytes: int, spans: Sequence[SourceSpan], *, min_part_bytes: int = MIN_PART_BYTES,
                    max_copy_part_bytes: int = MAX_COPY_PART_BYTES, client_part_bytes: int = CLIENT_PART_BYTES,
                    max_parts: int = MAX_PARTS) -> list[Part]:
    """The parts of one object: ``header_bytes`` of header from the client, then ``spans`` in order.

    Every part but the last is at least ``min_part_bytes``; a copy part is at most
    ``max_copy_part_bytes``, a client part at most ``client_part_bytes``. More than ``max_parts``
    parts raise :class:`~shardkit.errors.ShardkitWriteError`. An object under ``min_part_bytes``
    in all is one client part (the writer then puts it in one request).
    """
    if max_copy_part_bytes < 2 * min_part_bytes:
        raise ValueError("max_copy_part_bytes must be at least twice min_part_bytes")
    planner = _Planner(min_part_bytes=min_part_bytes, max_copy_part_bytes=max_copy_part_bytes,
                       client_part_bytes=client_part_bytes)
    if header_bytes:
        planner.send(Piece(None, 0, header_bytes))
    for run in _runs(spans):
        planner.run(run)
    planner.flush()
    if len(planner.parts) > max_parts:
        raise ShardkitWriteError(f"{len(planner.parts)} parts is more than the store's {max_parts}; "
                                 "choose a smaller max shard size")
    return planner.parts


def copied_bytes(parts: Sequence[Part]) -> int:
    """Bytes the store copies itself (none of them cross the network to the client)."""
    return sum(p.nbytes for p in parts if isinstance(p, CopyPart))


def client_bytes(parts: Sequence[Part]) -> int:
    """Bytes sent through the client (header and ranged GETs)."""
    return sum(p.nbytes for p in parts if isinstance(p, ClientPart))


REFUSED_CODES = frozenset({"NotImplemented", "XNotImplemented", "AccessDenied", "InvalidRequest", "MethodNotAllowed",
                           "501", "405", "403"})


@contextlib.contextmanager
def refused_copy(where: str) -> Iterator[None]:
    """A store's refusal of a copy (not implemented, not allowed) raised as :class:`CopyRefusedError`."""
    try:
        yield
    except Exception as e:
        response = getattr(e, "response", None)
        error = response.get("Error", {}) if isinstance(response, dict) else {}
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode") if isinstance(response, dict) else None
        code = str(error.get("Code") or status or "") if isinstance(error, dict) else ""
        if code in REFUSED_CODES:
            raise CopyRefusedError(f"{where}: the store refused a server-side copy ({code})") from e
        raise
