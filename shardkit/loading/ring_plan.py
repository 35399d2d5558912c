"""The ring's pure planner: what each slot reads from a file and copies out, in file order.

A *piece* is one slot's worth of work: the reads that fill it (one page-aligned range, or for a
strided tensor-parallel slice many small ones packed together) and the copies out of it into the
destination tensors. Planning touches no file and no device.

pieces = plan_pieces(jobs, source=0, slot_bytes=16 << 20, gap_bytes=1 << 20)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PAGE_BYTES = 4096


@dataclass(frozen=True)
class CopyJob:
    """``nbytes`` of the file at ``offset`` into ``dest`` (any device) starting at its byte ``dest_offset``."""

    dest: torch.Tensor   # flat uint8 view of the destination tensor
    dest_offset: int
    offset: int
    nbytes: int
    where: str


@dataclass(frozen=True)
class SlotCopy:
    """``nbytes`` from byte ``slot_offset`` of a filled slot into ``dest`` at ``dest_offset``."""

    dest: torch.Tensor
    dest_offset: int
    slot_offset: int
    nbytes: int


@dataclass(frozen=True)
class SlotRead:
    """``nbytes`` of the file at ``offset`` into the slot at ``slot_offset``."""

    offset: int
    nbytes: int
    slot_offset: int
    where: str
    padded: bool = False   # the slot's memory around it, to whole pages, is free to overwrite (O_DIRECT in place)


@dataclass
class Piece:
    """One slot's worth of work: the reads that fill it, the copies out of it, and which file."""

    source: int                     # index of the file in the ``run_ring`` list
    reads: list[SlotRead] = field(default_factory=list)
    copies: list[SlotCopy] = field(default_factory=list)
    # A strided piece's reads as plain ``(file offset, nbytes, slot offset)`` tuples (reads[0] names it).
    spans: list[tuple[int, int, int]] | None = None

    @property
    def read_bytes(self) -> int:
        return sum(n for _, n, _ in self.spans) if self.spans is not None else sum(r.nbytes for r in self.reads)


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous tensor of any dtype (fp8, bool, scalars included)."""
    import torch

    return tensor.reshape(-1).view(torch.uint8)


def plan_pieces(jobs: Sequence[CopyJob], *, source: int, slot_bytes: int, gap_bytes: int) -> list[Piece]:
    """Cut one file's copies into slot-sized pieces in file order.

    Copies closer than ``gap_bytes`` share one read (the bytes between are read and dropped); each
    read starts on a page boundary and its page-rounded end stays inside the slot, so an ``O_DIRECT``
    reader fills the slot in place. A copy larger than what is left of a slot continues in the next piece.

    >>> import torch
    >>> dest = torch.empty(10_000, dtype=torch.uint8)
    >>> jobs = [CopyJob(dest, 0, 5000, 6000, "w"), CopyJob(dest, 6000, 12_000, 4000, "b")]
    >>> [(r.offset, r.nbytes) for p in plan_pieces(jobs, source=0, slot_bytes=8192, gap_bytes=4096) for r in p.reads]
    [(4096, 8192), (12288, 3712)]
    >>> [[(c.slot_offset, c.nbytes) for c in p.copies] for p in plan_pieces(jobs, source=0, slot_bytes=8192, gap_bytes=0)]
    [[(904, 6000)], [(3808, 4000)]]
    """
    pieces: list[Piece] = []
    piece = Piece(source)
    start = end = 0  # the current piece's read: file bytes [start, end)
    for job in sorted(jobs, key=lambda j: j.offset):
        done = 0
        while done < job.nbytes:
            at = job.offset + done
            if not (piece.copies and start <= at <= end + gap_bytes and at < start + slot_bytes):
                _close(pieces, piece, start, end)
                piece = Piece(source)
                start = end = at - at % PAGE_BYTES
            take = min(job.nbytes - done, start + slot_bytes - at)
            piece.copies.append(SlotCopy(job.dest, job.dest_offset + done, at - start, take))
            if not piece.reads:
                piece.reads.append(SlotRead(start, 0, 0, job.where, padded=True))
            end = max(end, at + take)
            done += take
    _close(pieces, piece, start, end)
    return pieces


def _close(pieces: list[Piece], piece: Piece, start: int, end: int) -> None:
    if piece.copies:
        piece.reads[0] = SlotRead(start, end - start, 0, piece.reads[0].where, padded=True)
        pieces.append(piece)


def plan_strided(dest: torch.Tensor, ranges: Sequence[tuple[int, int]], *, source: int, slot_bytes: int,
                 where: str) -> list[Piece]:
    """Pieces for many small file ranges that fill ``dest`` (a flat byte view) back to back, in
    order (the rows of a tensor-parallel slice): each range is its own read, packed into the slot,
    and each piece is one copy out of its slot. Only the bytes asked for are read.

    >>> import torch
    >>> p, = plan_strided(torch.empty(8, dtype=torch.uint8), [(0, 4), (100, 4)], source=0, slot_bytes=4096, where="w")
    >>> p.spans, [(c.dest_offset, c.slot_offset, c.nbytes) for c in p.copies]
    ([(0, 4, 0), (100, 4, 4)], [(0, 0, 8)])
    """
    pieces: list[Piece] = []
    spans: list[tuple[int, int, int]] = []
    used = start = 0  # bytes packed into the current slot; where in ``dest`` the slot's bytes go
    for offset, nbytes in ranges:
        done = 0
        while done < nbytes:
            if used == slot_bytes:
                pieces.append(_strided(dest, spans, start, used, source, where))
                spans, start, used = [], start + used, 0
            take = min(nbytes - done, slot_bytes - used)
            spans.append((offset + done, take, used))
            used += take
            done += take
    if used:
        pieces.append(_strided(dest, spans, start, used, source, where))
    return pieces


def _strided(dest: torch.Tensor, spans: list[tuple[int, int, int]], start: int, used: int, source: int,
             where: str) -> Piece:
    first = spans[0]
    return Piece(source, reads=[SlotRead(first[0], first[1], 0, where)], copies=[SlotCopy(dest, start, 0, used)],
                 spans=spans)
