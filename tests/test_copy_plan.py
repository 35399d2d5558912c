"""shardkit.stores.copy_plan: which parts of an output object are copied in the store (pure, no server)."""

from __future__ import annotations

import random

import pytest

from shardkit.errors import ShardkitWriteError
from shardkit.stores.copy_plan import (
    ClientPart,
    CopyPart,
    SourceSpan,
    client_bytes,
    copied_bytes,
    plan_copy_parts,
)

MiB = 1 << 20
MIN = 5 * MiB


def _bytes_of(parts, header: int) -> list[tuple[str | None, int]]:
    """Every output byte as (object, offset) runs: what the parts compose, in order (run-length)."""
    out: list[tuple[str | None, int, int]] = []
    for part in parts:
        pieces = part.pieces if isinstance(part, ClientPart) else [part]
        for p in pieces:
            if out and out[-1][0] == p.name and out[-1][2] == p.begin:
                out[-1] = (p.name, out[-1][1], p.end)
            else:
                out.append((p.name, p.begin, p.end))
    return out


def _expected(header: int, spans: list[SourceSpan]) -> list[tuple[str | None, int, int]]:
    out: list[tuple[str | None, int, int]] = [(None, 0, header)] if header else []
    for s in spans:
        if not s.nbytes:
            continue
        if out and out[-1][0] == s.name and out[-1][2] == s.begin:
            out[-1] = (s.name, out[-1][1], s.end)
        else:
            out.append((s.name, s.begin, s.end))
    return out


def _check_limits(parts, *, min_bytes: int = MIN, max_copy: int = 5 << 30, client_max: int = 16 * MiB) -> None:
    for i, part in enumerate(parts):
        assert part.nbytes > 0
        if i < len(parts) - 1:
            assert part.nbytes >= min_bytes, (i, part)
        if isinstance(part, CopyPart):
            assert part.nbytes <= max_copy
        else:
            assert part.nbytes <= client_max


def test_header_and_one_large_tensor_spanning_the_5mib_mark() -> None:
    header = 4096
    spans = [SourceSpan("a.safetensors", 8000, 8000 + 12 * MiB)]
    parts = plan_copy_parts(header, spans)
    assert isinstance(parts[0], ClientPart) and parts[0].nbytes == MIN
    assert parts[0].pieces[1].end == 8000 + MIN - header  # the tensor is cut at the 5 MiB mark
    assert parts[1] == CopyPart("a.safetensors", 8000 + MIN - header, 8000 + 12 * MiB)
    assert client_bytes(parts) == MIN and copied_bytes(parts) == 12 * MiB + header - MIN
    assert _bytes_of(parts, header) == _expected(header, spans)


def test_tiny_checkpoint_goes_through_the_client_in_one_part() -> None:
    spans = [SourceSpan("a", 100, 200), SourceSpan("a", 200, 300), SourceSpan("b", 0, 1000)]
    parts = plan_copy_parts(80, spans)
    assert len(parts) == 1 and isinstance(parts[0], ClientPart)
    assert copied_bytes(parts) == 0 and client_bytes(parts) == 80 + 1200
    assert _bytes_of(parts, 80) == _expected(80, spans)


def test_contiguous_tensors_become_one_copy_part() -> None:
    spans = [SourceSpan("a", 0, 0)] + [SourceSpan("a", 1000 + i * 3 * MiB, 1000 + (i + 1) * 3 * MiB)
                                       for i in range(10)]
    parts = plan_copy_parts(500, spans)
    assert [type(p) for p in parts] == [ClientPart, CopyPart]
    assert parts[1].end == 1000 + 30 * MiB
    _check_limits(parts)


def test_small_pieces_between_runs_merge_into_client_parts() -> None:
    # big run in a, a tiny tensor from b, another big run in a (not adjacent), a small tail
    spans = [SourceSpan("a", 0, 20 * MiB), SourceSpan("b", 0, 1000), SourceSpan("a", 30 * MiB, 50 * MiB),
             SourceSpan("c", 0, 2 * MiB)]
    parts = plan_copy_parts(4096, spans)
    _check_limits(parts)
    assert _bytes_of(parts, 4096) == _expected(4096, spans)
    kinds = [type(p).__name__ for p in parts]
    assert kinds == ["ClientPart", "CopyPart", "ClientPart", "CopyPart", "ClientPart"]
    assert parts[2].pieces[0].name == "b" and parts[2].nbytes == MIN  # 1000 bytes topped up from the next run
    assert parts[-1].nbytes == 2 * MiB  # the last part may be small


def test_a_run_too_short_after_the_top_up_goes_through_the_client() -> None:
    spans = [SourceSpan("a", 0, 8 * MiB)]  # header 1 MiB: topping up takes 4 MiB, 4 MiB left < 5 MiB
    parts = plan_copy_parts(MiB, spans)
    assert all(isinstance(p, ClientPart) for p in parts)
    _check_limits(parts)
    assert _bytes_of(parts, MiB) == _expected(MiB, spans)


def test_many_small_tensors_are_cut_into_client_parts_of_the_writer_size() -> None:
    spans = [SourceSpan(f"o{i}", 0, 3 * MiB) for i in range(20)]  # 60 MiB, nothing contiguous
    parts = plan_copy_parts(100, spans)
    assert all(isinstance(p, ClientPart) for p in parts)
    assert [p.nbytes for p in parts[:-1]] == [16 * MiB] * 3
    _check_limits(parts)
    assert _bytes_of(parts, 100) == _expected(100, spans)


def test_a_run_over_5gib_is_cut_evenly() -> None:
    size = 12 << 30
    parts = plan_copy_parts(1000, [SourceSpan("big", 64, 64 + size)])
    copies = [p for p in parts if isinstance(p, CopyPart)]
    assert len(copies) == 3
    assert all(MIN <= p.nbytes <= 5 << 30 for p in copies)
    assert max(p.nbytes for p in copies) - min(p.nbytes for p in copies) <= 1
    assert _bytes_of(parts, 1000) == _expected(1000, [SourceSpan("big", 64, 64 + size)])


def test_more_parts_than_the_store_allows_is_refused() -> None:
    spans = [SourceSpan(f"o{i}", 0, 6 * MiB) for i in range(20)]
    with pytest.raises(ShardkitWriteError, match="more than the store's 10"):
        plan_copy_parts(100, spans, max_parts=10)


def test_random_layouts_keep_every_byte_in_order_within_the_limits() -> None:
    rng = random.Random(7)
    for _ in range(300):
        spans, offsets = [], {"a": 0, "b": 0, "c": 0}
        for _ in range(rng.randint(0, 12)):
            name = rng.choice("abc")
            gap = rng.choice([0, 0, 0, 8, 4096])
            size = rng.choice([0, 10, 1000, MiB, 3 * MiB, 5 * MiB, 7 * MiB, 17 * MiB])
            begin = offsets[name] + gap
            spans.append(SourceSpan(name, begin, begin + size))
            offsets[name] = begin + size
        header = rng.choice([8, 4096, 6 * MiB])
        parts = plan_copy_parts(header, spans, max_copy_part_bytes=12 * MiB)
        _check_limits(parts, max_copy=12 * MiB)
        assert _bytes_of(parts, header) == _expected(header, spans)
