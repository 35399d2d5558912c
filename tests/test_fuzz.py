"""Fuzzing the parsers of untrusted input: safetensors headers, index files, size strings.

Structured inputs (headers and indexes built from random but well-typed parts, and mutations of
valid ones) and raw random bytes. Whatever comes in, only ``ShardkitError`` subclasses escape, no
example hangs (a 10 s alarm per example) and memory stays small (the header cap is checked
before reading). When shardkit accepts a header, the official safetensors reader must accept the
same file and see the same tensors. Fixed budget, derandomized: the same cases every CI run.
``SHARDKIT_FUZZ_EXAMPLES`` scales the budget (e.g. 20000 for a long run).
"""

from __future__ import annotations

import json
import os
import signal
import struct
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardkit.errors import ShardkitError
from shardkit.formats.header import parse_header, read_header
from shardkit.formats.index import load_index, parse_index
from shardkit.units import DTYPE_BITS, parse_size

EXAMPLES = int(os.environ.get("SHARDKIT_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
MEMORY_LIMIT_BYTES = 64 * 2**20


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder for the examples that need a file (module-scoped: hypothesis reruns the test body)."""
    return tmp_path_factory.mktemp("fuzz")


@contextmanager
def guarded(name: str) -> Iterator[None]:
    """Fail on a hang (10 s) and on any exception that is not a ShardkitError."""

    def hang(signum: int, frame: Any) -> None:
        raise AssertionError(f"{name}: one example ran for more than 10 s")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(10)
    try:
        yield
    except ShardkitError:
        pass
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@contextmanager
def bounded_memory() -> Iterator[None]:
    tracemalloc.start()
    try:
        yield
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MEMORY_LIMIT_BYTES, f"peak traced memory {peak} bytes"


# ----------------------------------------------------------------------------- strategies

DTYPES = sorted(DTYPE_BITS)
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                         st.text(max_size=8))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                  st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                           max_leaves=12)
dims = st.one_of(st.integers(0, 9), st.integers(0, 2**64), st.integers(-5, -1), st.just(2**32))


@st.composite
def tensor_layouts(draw: Callable) -> tuple[dict, int]:
    """A header dict whose entries are mostly consistent, sometimes subtly wrong."""
    n = draw(st.integers(0, 6))
    doc: dict[str, Any] = {}
    cursor = 0
    for i in range(n):
        dtype = draw(st.sampled_from(DTYPES + ["F128", "", "f32"]))
        shape = draw(st.lists(st.integers(0, 7), max_size=3))
        numel = 1
        for d in shape:
            numel *= d
        nbytes = (numel * DTYPE_BITS.get(dtype, 8) + 7) // 8
        begin = cursor + draw(st.sampled_from([0, 0, 0, 0, 1, -1]))
        end = begin + nbytes + draw(st.sampled_from([0, 0, 0, 0, 1, -1]))
        cursor = max(cursor, end)
        name = draw(st.one_of(st.text(max_size=12), st.just(f"t{i}")))
        entry: dict[str, Any] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
        if draw(st.integers(0, 9)) == 0:  # now and then a field goes missing or changes type
            key = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
            if draw(st.booleans()):
                del entry[key]
            else:
                entry[key] = draw(json_values)
        if draw(st.integers(0, 19)) == 0:
            entry["shape"] = draw(st.lists(dims, max_size=4))
        doc[name] = entry
    if draw(st.booleans()):
        doc["__metadata__"] = draw(st.one_of(st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3),
                                             json_values))
    return doc, max(cursor, 0)


def _encode(doc: dict, *, pad: bool) -> bytes:
    raw = json.dumps(doc, ensure_ascii=False).encode("utf-8", "surrogatepass")
    return raw + b" " * (-len(raw) % 8) if pad else raw


# ----------------------------------------------------------------------------- headers

@FUZZ
@given(layout=tensor_layouts(), pad=st.booleans(), trailing=st.integers(-2, 2))
def test_parse_header_structured(layout: tuple[dict, int], pad: bool, trailing: int) -> None:
    doc, buffer_bytes = layout
    raw = _encode(doc, pad=pad)
    with guarded("parse_header structured"):
        header = parse_header(raw, path="fuzz", file_bytes=8 + len(raw) + buffer_bytes + trailing)
        # accepted: the entries tile the buffer exactly and the buffer ends where the file ends
        file_bytes = 8 + len(raw) + buffer_bytes + trailing
        assert sum(entry.nbytes for entry in header.entries) == file_bytes - 8 - len(raw)
        for entry in header.entries:
            assert entry.nbytes >= 0 and entry.offset >= 8 + len(raw)
            assert entry.offset + entry.nbytes <= file_bytes


@FUZZ
@given(raw=st.binary(max_size=512), file_bytes=st.one_of(st.none(), st.integers(0, 2**64)))
def test_parse_header_random_bytes(raw: bytes, file_bytes: int | None) -> None:
    with guarded("parse_header random bytes"):
        parse_header(raw, path="fuzz", file_bytes=file_bytes)


@FUZZ
@given(raw=st.text(max_size=200).map(lambda t: ("{" + t).encode("utf-8", "surrogatepass")))
def test_parse_header_json_like_text(raw: bytes) -> None:
    with guarded("parse_header json-like"):
        parse_header(raw, path="fuzz")


@FUZZ
@given(layout=tensor_layouts(), flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=4),
       claimed=st.one_of(st.none(), st.integers(0, 2**64 - 1)), cut=st.integers(0, 64))
def test_read_header_files_agree_with_safetensors(scratch: Path, layout: tuple[dict, int], flips: list,
                                                  claimed: int | None, cut: int) -> None:
    """Files on disk: mutated bytes, lying length prefixes, truncation. If shardkit accepts, so does safetensors."""
    doc, buffer_bytes = layout
    raw = bytearray(_encode(doc, pad=True))
    for position, value in flips:
        if raw:
            raw[position % len(raw)] = value
    data = struct.pack("<Q", len(raw) if claimed is None else claimed) + bytes(raw) + bytes(buffer_bytes)
    if cut:
        data = data[: max(0, len(data) - cut)] if cut % 2 else data
    path = scratch / "fuzz.safetensors"  # one file, rewritten by each example
    path.write_bytes(data)
    accepted = None
    with guarded("read_header files"), bounded_memory():
        accepted = read_header(str(path))
    if accepted is not None and _official_knows(accepted):
        from safetensors import safe_open

        with safe_open(str(path), framework="numpy") as official:
            assert set(official.keys()) == {e.name for e in accepted.entries}


def _official_knows(header: Any) -> bool:
    """safetensors 0.8 reads every dtype shardkit knows except the sub-byte ones (numpy has no F4/F6/F8)."""
    return all(e.dtype not in ("F4", "F6_E2M3", "F6_E3M2") and not e.dtype.startswith("F8") for e in header.entries)


def test_header_cap_holds_for_every_lying_length(tmp_path: Any) -> None:
    """Small files whose prefix claims anything up to 2^64-1: refused without reading that much."""
    path = tmp_path / "lie.safetensors"
    for claimed in [0, 1, 2, 7, 100, 99_999_999, 100_000_000, 100_000_001, 2**32, 2**63, 2**64 - 1]:
        path.write_bytes(struct.pack("<Q", claimed) + b'{"a":1}')
        with guarded("read_header lying length"), bounded_memory():
            read_header(path)
            raise AssertionError(f"a file claiming a {claimed}-byte header was accepted")


# ----------------------------------------------------------------------------- indexes

shard_names = st.one_of(st.text(max_size=20), st.sampled_from(["model-00001-of-00002.safetensors", "../x.safetensors",
                                                               "/abs.safetensors", "a/b.safetensors", "x.bin"]),
                        json_values)


@FUZZ
@given(weight_map=st.one_of(st.dictionaries(st.text(max_size=10), shard_names, max_size=6), json_values),
       metadata=st.one_of(st.none(), json_values, st.fixed_dictionaries({"total_size": json_values})),
       extra=st.dictionaries(st.text(max_size=5), json_values, max_size=2))
def test_parse_index_structured(weight_map: Any, metadata: Any, extra: dict) -> None:
    doc = {**extra, "weight_map": weight_map, "metadata": metadata}
    raw = json.dumps(doc, ensure_ascii=False).encode("utf-8", "surrogatepass")
    with guarded("parse_index structured"):
        index = parse_index(raw, path="fuzz.index.json")
        for name in index.shard_names():
            assert "/" not in name and ".." != name and name.endswith(".safetensors")


@FUZZ
@given(raw=st.binary(max_size=512))
def test_parse_index_random_bytes(raw: bytes) -> None:
    with guarded("parse_index random bytes"):
        parse_index(raw, path="fuzz.index.json")


@FUZZ
@given(raw=st.binary(max_size=256))
def test_load_index_files(scratch: Path, raw: bytes) -> None:
    path = scratch / "model.safetensors.index.json"  # one file, rewritten by each example
    path.write_bytes(b'{"weight_map": ' + raw + b"}")
    with guarded("load_index files"):
        load_index(str(path))


# ----------------------------------------------------------------------------- sizes

size_like = st.builds(lambda n, sep, unit: f"{n}{sep}{unit}",
                      st.one_of(st.integers(-10, 10**30).map(str), st.floats(allow_nan=True, allow_infinity=True).map(str),
                                st.text("0123456789.", max_size=40), st.integers(300, 5000).map(lambda n: "9" * n),
                                st.integers(1, 400).map(lambda n: "0." + "0" * n + "1")),
                      st.sampled_from(["", " ", "\t"]),
                      st.sampled_from(["", "B", "KB", "MB", "GB", "TB", "KiB", "GiB", "TiB", "XB", "gib", "e5"]))


@FUZZ
@given(value=st.one_of(st.text(max_size=40), size_like, st.integers(), st.integers(2**60, 10**5000), st.booleans()))
def test_parse_size(value: Any) -> None:
    with guarded("parse_size"):
        size = parse_size(value)
        assert isinstance(size, int) and size > 0
