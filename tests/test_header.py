"""The safetensors header reader/writer, checked against the reference implementation."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from conftest import TORCH_DTYPE_CODES, make_state_dict, raw_header, write_raw_safetensors

from shardkit.errors import HeaderError, SourceNotFoundError
from shardkit.formats.header import MAX_HEADER_BYTES, TensorEntry, build_header, parse_header, read_header
from shardkit.units import DTYPE_BITS, tensor_nbytes


def _reference_rejects(path: Path) -> bool:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            list(f.keys())
    except (SafetensorError, OSError, ValueError):
        return True
    return False


# ------------------------------------------------------------------ golden bytes

def test_build_header_golden_bytes() -> None:
    entries = [TensorEntry("w", "F32", (2,), 8), TensorEntry("b", "BF16", (1, 3), 6)]
    head, begins = build_header(entries, metadata={"format": "pt"})
    expected_json = (
        b'{"__metadata__":{"format":"pt"},'
        b'"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
        b'"b":{"dtype":"BF16","shape":[1,3],"data_offsets":[8,14]}}'
    )
    padded = expected_json + b" " * (-len(expected_json) % 8)
    assert head == struct.pack("<Q", len(padded)) + padded
    assert len(head) % 8 == 0
    assert begins == [0, 8]


def test_build_header_golden_no_metadata_and_unicode_names() -> None:
    head, begins = build_header([TensorEntry("größe.ü", "U8", (3,), 3)])
    raw = '{"größe.ü":{"dtype":"U8","shape":[3],"data_offsets":[0,3]}}'.encode()
    raw += b" " * (-len(raw) % 8)
    assert head == struct.pack("<Q", len(raw)) + raw
    assert begins == [0]


def test_build_header_matches_the_reference_serializer() -> None:
    """Given the reference's tensor order, our header bytes are exactly the reference's."""
    import safetensors.torch

    tensors = make_state_dict(shapes=[(), (0,), (3, 5)])
    metadata = {"format": "pt", "note": "ünïcode"}
    blob = safetensors.torch.save(tensors, metadata=metadata)
    (n,) = struct.unpack("<Q", blob[:8])
    reference = parse_header(blob[8:8 + n], file_bytes=len(blob))
    assert reference.metadata == metadata
    ours, _ = build_header(  # the reference orders metadata keys by hash: give ours in its order
        [TensorEntry(e.name, e.dtype, e.shape, e.nbytes) for e in reference.entries], metadata=reference.metadata
    )
    assert ours == blob[:8 + n]


def test_build_header_refuses_duplicates_and_reserved_name() -> None:
    with pytest.raises(HeaderError, match="twice"):
        build_header([TensorEntry("a", "U8", (1,), 1), TensorEntry("a", "U8", (1,), 1)])
    with pytest.raises(HeaderError):
        build_header([TensorEntry("__metadata__", "U8", (1,), 1)])


# ------------------------------------------------------------------ reading valid files

def test_read_header_of_reference_files_for_every_dtype(safetensors_file: Path, state_dict: dict) -> None:
    header = read_header(safetensors_file)
    assert header.metadata == {"format": "pt"}
    assert header.file_bytes == safetensors_file.stat().st_size
    by_name = header.by_name()
    assert set(by_name) == set(state_dict)
    blob = safetensors_file.read_bytes()
    from conftest import tensor_bytes

    from shardkit.formats.dtypes import from_torch

    for name, tensor in state_dict.items():
        entry = by_name[name]
        assert entry.dtype == from_torch(tensor.dtype)
        assert entry.shape == tuple(tensor.shape)
        assert entry.file == str(safetensors_file)
        assert blob[entry.offset:entry.offset + entry.nbytes] == tensor_bytes(tensor)
    offsets = [e.offset for e in header.entries]
    assert offsets == sorted(offsets)


@pytest.mark.parametrize("dtype, shape, nbytes", [
    ("F4", [3], 2), ("F4", [2, 2], 2), ("F6_E2M3", [4], 3), ("F6_E3M2", [5], 4), ("F4", [0], 0),
    ("F8_E8M0", [3], 3),
])
def test_sub_byte_and_exotic_dtypes_parse_from_hand_built_headers(tmp_path: Path, dtype: str, shape: list,
                                                                  nbytes: int) -> None:
    doc, size = raw_header([("x", dtype, shape, nbytes), ("y", "U8", [2], 2)])
    path = write_raw_safetensors(tmp_path / "sub.safetensors", doc, bytes(range(size)))
    header = read_header(path)
    x = header.by_name()["x"]
    assert (x.dtype, x.shape, x.nbytes) == (dtype, tuple(shape), nbytes)
    assert header.by_name()["y"].offset == header.data_start + nbytes


def test_header_padding_and_empty_file_of_tensors(tmp_path: Path) -> None:
    path = write_raw_safetensors(tmp_path / "empty.safetensors", {"__metadata__": {"a": "b"}}, pad=True)
    header = read_header(path)
    assert header.entries == [] and header.metadata == {"a": "b"}
    assert header.data_start == path.stat().st_size


def test_every_dtype_round_trips_through_build_and_parse() -> None:
    entries = [TensorEntry(f"t.{code}", code, (3, 2), tensor_nbytes(code, (3, 2))) for code in DTYPE_BITS]
    head, begins = build_header(entries)
    buffer_bytes = sum(e.nbytes for e in entries)
    parsed = parse_header(head[8:], file_bytes=len(head) + buffer_bytes)
    assert [(e.name, e.dtype, e.shape, e.nbytes) for e in parsed.entries] == [
        (e.name, e.dtype, e.shape, e.nbytes) for e in entries
    ]
    assert [e.offset - parsed.data_start for e in parsed.entries] == begins


# ------------------------------------------------------------------ malformed files

def _good_doc() -> dict:
    doc, _ = raw_header([("a", "F32", [2], 8), ("b", "F16", [2], 4)])
    return doc


BAD_HEADERS = {
    # name: (header or callable(doc) -> doc, data bytes, message fragment)
    "not utf-8": (b'{"a":"\xff\xfe"}', b"", "utf-8"),
    "not json": (b"{this is not json}", b"", "not valid json"),
    "not an object": (b"[1, 2, 3]", b"", "does not start with '{'"),
    "json array after brace": (b"{}" + b"[]", b"", "not valid json"),
    "entry not an object": ({"a": [1, 2]}, b"", "must be an object"),
    "missing dtype": ({"a": {"shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "missing field(s) dtype"),
    "missing shape": ({"a": {"dtype": "F32", "data_offsets": [0, 8]}}, b"\0" * 8, "missing field(s) shape"),
    "missing offsets": ({"a": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, "data_offsets"),
    "dtype not a string": ({"a": {"dtype": 7, "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "unknown dtype"),
    "unknown dtype": ({"a": {"dtype": "F12", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "unknown dtype 'F12'"),
    "negative shape": ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, "shape"),
    "float shape": ({"a": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}, b"\0" * 8, "shape"),
    "bool shape": ({"a": {"dtype": "F32", "shape": [True, True], "data_offsets": [0, 4]}}, b"\0" * 4, "shape"),
    "shape not a list": ({"a": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}}, b"\0" * 8, "shape"),
    "string offsets": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]}}, b"\0" * 8, "data_offsets"),
    "three offsets": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4, 8]}}, b"\0" * 8, "data_offsets"),
    "negative offsets": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}, b"", "data_offsets"),
    "reversed offsets": ({"a": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}}, b"\0" * 8, "reversed"),
    "size mismatch": ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "needs 12"),
    "out of bounds": ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, "truncated"),
    "trailing data": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 12, "trailing"),
    "gap": ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
             "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}, b"\0" * 12, "gap"),
    "gap at start": ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, "gap"),
    "overlap": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                 "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, "overlaps"),
    "same range twice": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                          "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "overlaps"),
    "duplicate name": ('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                       '"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}', b"\0\0", "tensor 'a' appears twice"),
    "lone surrogate name": ('{"\\ud800":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\0", "unicode"),
    "lone surrogate metadata": ('{"__metadata__":{"k":"\\udfff"}}', b"", "__metadata__"),
    "huge integer": ('{"a":{"dtype":"U8","shape":[1' + "0" * 5000 + '],"data_offsets":[0,1]}}', b"\0", "json"),
    "metadata not strings": ({"__metadata__": {"a": 1}}, b"", "__metadata__"),
    "metadata not object": ({"__metadata__": ["a"]}, b"", "__metadata__"),
    "shape overflows": ({"a": {"dtype": "F64", "shape": [2**40, 2**40], "data_offsets": [0, 8]}}, b"\0" * 8,
                        "overflow"),
}


@pytest.mark.parametrize("case", sorted(BAD_HEADERS))
def test_malformed_headers_are_refused_like_the_reference_does(tmp_path: Path, case: str) -> None:
    header, data, fragment = BAD_HEADERS[case]
    path = write_raw_safetensors(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(HeaderError) as info:
        read_header(path)
    message = str(info.value)
    assert str(path) in message and fragment.lower() in message.lower(), message
    assert "\n" not in message
    assert _reference_rejects(path), "the reference reader accepts this file, so we should too"


def test_truncated_files(tmp_path: Path) -> None:
    (tmp_path / "zero.safetensors").write_bytes(b"")
    (tmp_path / "short.safetensors").write_bytes(b"\x10\x00\x00")
    for name in ("zero.safetensors", "short.safetensors"):
        with pytest.raises(HeaderError, match="too short"):
            read_header(tmp_path / name)
    doc, size = raw_header([("a", "F32", [100], 400)])
    good = write_raw_safetensors(tmp_path / "good.safetensors", doc, b"\1" * size)
    blob = good.read_bytes()
    for cut in (len(blob) - 1, len(blob) - 400, 8 + 5):
        path = tmp_path / f"cut{cut}.safetensors"
        path.write_bytes(blob[:cut])
        with pytest.raises(HeaderError, match="truncated"):
            read_header(path)
        assert _reference_rejects(path)


def test_header_length_past_end_of_file_or_over_limit(tmp_path: Path) -> None:
    doc = _good_doc()
    past = write_raw_safetensors(tmp_path / "past.safetensors", doc, b"\0" * 12, length=10_000)
    with pytest.raises(HeaderError, match="past the end"):
        read_header(past)
    huge = write_raw_safetensors(tmp_path / "huge.safetensors", doc, b"\0" * 12, length=MAX_HEADER_BYTES + 1)
    with pytest.raises(HeaderError, match="limit"):
        read_header(huge)
    giant = write_raw_safetensors(tmp_path / "giant.safetensors", doc, b"", length=2**64 - 1)
    with pytest.raises(HeaderError, match="limit"):
        read_header(giant)
    tiny = write_raw_safetensors(tmp_path / "tiny.safetensors", b"{", b"")
    with pytest.raises(HeaderError):
        read_header(tiny)
    for path in (past, huge, giant, tiny):
        assert _reference_rejects(path)


def test_header_just_under_the_limit_is_checked_without_reading_past_eof(tmp_path: Path) -> None:
    """A claimed 99 MB header in a small file fails fast on length, never allocating 99 MB."""
    path = write_raw_safetensors(tmp_path / "x.safetensors", b"{}", length=MAX_HEADER_BYTES - 8)
    with pytest.raises(HeaderError, match="past the end"):
        read_header(path)


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(SourceNotFoundError):
        read_header(tmp_path / "nope.safetensors")
    with pytest.raises(HeaderError, match="directory"):
        read_header(tmp_path)


def test_parse_header_without_file_size_computes_the_end() -> None:
    raw = json.dumps(_good_doc()).encode()
    header = parse_header(raw)
    assert header.file_bytes == 8 + len(raw) + 12
    assert [e.name for e in header.entries] == ["a", "b"]


def test_all_torch_codes_are_known_to_the_format() -> None:
    assert set(TORCH_DTYPE_CODES) <= set(DTYPE_BITS)


# ------------------------------------------------------------------ fuzzing: only HeaderError, ever

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
_entries = st.fixed_dictionaries(
    {}, optional={"dtype": st.sampled_from([*DTYPE_BITS, "F7", 3, None]) | _json_values,
                  "shape": st.lists(st.integers(min_value=-2, max_value=2**40), max_size=4) | _json_values,
                  "data_offsets": st.lists(st.integers(min_value=-2, max_value=64), max_size=3) | _json_values})
_headers = st.dictionaries(st.text(max_size=5), _entries | _json_values, max_size=4)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=_headers, data_bytes=st.integers(min_value=0, max_value=80))
def test_structured_garbage_raises_only_header_errors(doc: dict, data_bytes: int) -> None:
    raw = json.dumps(doc).encode()
    try:
        header = parse_header(raw, file_bytes=8 + len(raw) + data_bytes)
    except HeaderError as e:
        assert "\n" not in str(e)
        return
    cursor = header.data_start
    for entry in header.entries:  # whatever we accept must tile the buffer exactly
        assert entry.offset == cursor
        cursor += entry.nbytes
    assert cursor == header.file_bytes


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=64))
def test_random_bytes_raise_only_header_errors(raw: bytes) -> None:
    try:
        parse_header(raw, file_bytes=8 + len(raw))
    except HeaderError:
        pass


@pytest.mark.parametrize("data_start_mod", [0, 8, 1004, 4095])
def test_padded_header_puts_the_data_where_asked_and_loads_everywhere(tmp_path: Path, data_start_mod: int) -> None:
    """Copy-on-write padding: trailing spaces move the data buffer, and readers take it unchanged."""
    from safetensors.numpy import load_file

    entries = [TensorEntry("a", "U8", (3,), 3), TensorEntry("b", "U8", (5,), 5)]
    head, begins = build_header(entries, metadata={"format": "pt"}, data_start_mod=data_start_mod)
    assert len(head) % 4096 == data_start_mod and begins == [0, 3]
    assert len(head) - len(build_header(entries, metadata={"format": "pt"})[0]) < 4096
    assert head.endswith(b" ") or len(head) == len(build_header(entries, metadata={"format": "pt"})[0])
    path = tmp_path / "padded.safetensors"
    path.write_bytes(head + bytes(range(8)))
    header = read_header(path)
    assert header.data_start == len(head) and header.metadata == {"format": "pt"}
    assert [e.offset for e in header.entries] == [len(head), len(head) + 3]
    loaded = load_file(str(path))
    assert loaded["a"].tolist() == [0, 1, 2] and loaded["b"].tolist() == [3, 4, 5, 6, 7]
