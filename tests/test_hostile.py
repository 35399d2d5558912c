"""Hostile inputs: each gets a one-line error (exit 2), runs no code, reads nothing outside, leaves nothing behind.

Policies proved here:

* Pickles are loaded with ``torch.load(weights_only=True)``: a ``__reduce__`` payload never runs
  and any global that is not a tensor building block is refused. Every payload below is shown to
  be live by a control that loads it unsafely in a child process and sees the marker appear.
* Index shard names are file names: no ``..``, no absolute path, no separator, no control
  character, ``.safetensors`` only.
* A file found in a checkpoint folder that is a symlink is followed only to a regular file inside
  the folder, or into the ``blobs/`` of the Hugging Face cache repo holding the snapshot.
* Headers: the 100 MB cap is checked before anything is read; shapes whose byte size overflows
  64 bits, data past the end of the file and over-long integers are refused.
* Tensor names are data, never paths: ``../x``, ``a/b`` or control characters round-trip
  unchanged and create no file; messages print names with ``repr`` so no raw control character
  reaches a terminal.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import helpers_reliability as h
import pytest
from conftest import assert_one_line_error, invoke_cli


def _refused(result: Any, *, contains: str | None = None, case: str) -> str:
    try:
        return assert_one_line_error(result, code=2, contains=contains)
    except AssertionError as e:
        raise AssertionError(f"hostile input {case} was not refused in one line: {e}") from e


# ----------------------------------------------------------------------------- pickles

class Payload:
    """Pickles as a call to ``os.system('touch MARKER')``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


class EvalPayload(Payload):
    def __reduce__(self) -> tuple:
        return (eval, (f"open({str(self.marker)!r}, 'w').close()",))


class Custom:
    """An arbitrary class: refused as a global even though it runs nothing."""

    def __init__(self) -> None:
        self.value = 1


def _save_torch(obj: Any, path: Path, *, legacy: bool = False) -> Path:
    import torch

    torch.save(obj, str(path), _use_new_zipfile_serialization=not legacy)
    return path


def _payload_runs_when_loaded_unsafely(path: Path, marker: Path) -> bool:
    """Control: the payload is live (a plain ``torch.load(weights_only=False)`` runs it)."""
    code = "import sys, torch; torch.load(sys.argv[1], weights_only=False)"
    subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, timeout=120)
    ran = marker.exists()
    marker.unlink(missing_ok=True)
    return ran


def _tensor() -> Any:
    import torch

    return torch.arange(6, dtype=torch.float32)


PICKLES = {
    "reduce-os-system-zip": lambda m: {"w": _tensor(), "evil": Payload(m)},
    "reduce-eval-zip": lambda m: {"w": _tensor(), "evil": EvalPayload(m)},
    "reduce-os-system-legacy": lambda m: ("legacy", {"w": _tensor(), "evil": Payload(m)}),
    "nested-state-dict-reduce": lambda m: {"state_dict": {"w": _tensor()}, "optimizer": Payload(m)},
}


@pytest.mark.parametrize("case", list(PICKLES))
@pytest.mark.parametrize("command", ["split", "convert"])
def test_pickle_payload_never_runs(case: str, command: str, tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    obj = PICKLES[case](marker)
    legacy = isinstance(obj, tuple)
    path = _save_torch(obj[1] if legacy else obj, tmp_path / "evil.bin", legacy=legacy)
    if command == "split":  # the control, once per payload
        assert _payload_runs_when_loaded_unsafely(path, marker), "control: the payload should be live"
    result = invoke_cli(command, path, tmp_path / "out", "-q")
    _refused(result, case=f"pickle:{case}:{command}")
    assert not marker.exists()
    assert not (tmp_path / "out").exists()
    assert not h.leftovers(tmp_path / "out")


GLOBALS = {
    "os.system": lambda: {"w": _tensor(), "f": os.system},
    "builtins.eval": lambda: {"w": _tensor(), "f": eval},
    "custom-class": lambda: {"w": _tensor(), "obj": Custom()},
    "subprocess.Popen": lambda: {"w": _tensor(), "p": subprocess.Popen},
}


@pytest.mark.parametrize("case", list(GLOBALS))
def test_pickle_with_arbitrary_globals_is_refused(case: str, tmp_path: Path) -> None:
    path = _save_torch(GLOBALS[case](), tmp_path / "globals.pt")
    result = invoke_cli("split", path, tmp_path / "out", "-q")
    line = _refused(result, case=f"pickle-global:{case}")
    assert "never executes pickled code" in line or "not tensors" in line or "refused" in line
    assert not (tmp_path / "out").exists()


def test_raw_pickle_reduce_without_torch_framing(tmp_path: Path) -> None:
    """A plain ``pickle.dump`` (no torch container at all) named .ckpt."""
    marker = tmp_path / "PWNED"
    path = tmp_path / "model.ckpt"
    path.write_bytes(pickle.dumps(Payload(marker)))
    code = "import pickle, sys; pickle.load(open(sys.argv[1], 'rb'))"
    subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, cwd=Path(__file__).parent)
    assert marker.exists(), "control: the payload should be live"
    marker.unlink()
    _refused(invoke_cli("split", path, tmp_path / "out", "-q"), case="pickle:raw-reduce")
    assert not marker.exists()


# ----------------------------------------------------------------------------- indexes

def _sharded(folder: Path) -> Path:
    return h.write_checkpoint(folder, h.make_tensors(8, total_bytes=4000), shard_bytes=2000)


def _shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("model-*.safetensors"))


BAD_SHARD_NAMES = {
    "dotdot": "../model-00001-of-00002.safetensors",
    "absolute": "/etc/passwd.safetensors",
    "subfolder": "sub/model-00001-of-00002.safetensors",
    "backslash": "..\\model-00001-of-00002.safetensors",
    "newline": "model-00001-of-00002.safetensors\n",
    "escape": "\x1b[2Jmodel.safetensors",
    "not-safetensors": "model-00001-of-00002.bin",
    "empty": "",
    "not-a-string": 7,
}


@pytest.mark.parametrize("case", list(BAD_SHARD_NAMES))
def test_index_naming_a_path_is_refused_before_opening(case: str, tmp_path: Path) -> None:
    folder = _sharded(tmp_path / "ckpt")
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = BAD_SHARD_NAMES[case]
    index_path.write_text(json.dumps(index))
    line = _refused(invoke_cli("split", folder, tmp_path / "out", "-q"), case=f"index:{case}")
    assert "\x1b" not in line
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- symlinks

def test_shard_symlink_leading_outside_the_folder_is_refused(tmp_path: Path) -> None:
    folder = _sharded(tmp_path / "ckpt")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shard = _shards(folder)[0]
    shard.rename(elsewhere / "secret.safetensors")
    shard.symlink_to(elsewhere / "secret.safetensors")
    line = _refused(invoke_cli("split", folder, tmp_path / "out", "-q"), contains="symlink", case="symlink:outside")
    assert "outside" in line
    import shardkit
    from shardkit.errors import CheckpointIndexError

    with pytest.raises(CheckpointIndexError, match="outside"):
        shardkit.open(str(folder))


def test_side_file_symlink_cannot_smuggle_a_file_into_the_output(tmp_path: Path) -> None:
    folder = _sharded(tmp_path / "ckpt")
    secret = tmp_path / "id_rsa"
    secret.write_text("PRIVATE KEY")
    (folder / "config.json").symlink_to(secret)
    _refused(invoke_cli("split", folder, tmp_path / "out", "-q"), contains="symlink", case="symlink:side-file")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["evil\nname.txt", "\x1b[2J\x1b]0;owned\x07.json", "sub\tdir/config.json", "del\x7f.md"])
@pytest.mark.parametrize("command", ["split", "convert"])
def test_side_file_with_control_characters_is_refused(name: str, command: str, tmp_path: Path) -> None:
    """Issue 41: docs/reliability.md says such names are refused; before, split and convert copied them (exit 0)."""
    folder = _sharded(tmp_path / "ckpt")
    (folder / name).parent.mkdir(exist_ok=True)
    (folder / name).write_text("side")
    proc = h.run_shardkit([command, folder, tmp_path / "out", "-q"])
    line = _refused(proc, contains="control characters", case=f"side-file:{name!r}")
    assert not any(c in proc.stderr for c in "\x1b\x07\t\x7f"), proc.stderr  # printed escaped, never raw
    assert not (tmp_path / "out").exists()
    assert "rename" in line
    import shardkit
    from shardkit.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="control characters"):
        shardkit.split(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["dangling", "directory"])
def test_shard_symlink_to_nothing_or_a_folder_is_refused(kind: str, tmp_path: Path) -> None:
    folder = _sharded(tmp_path / "ckpt")
    shard = _shards(folder)[-1]
    shard.unlink()
    shard.symlink_to(tmp_path / "missing" if kind == "dangling" else tmp_path)
    _refused(invoke_cli("split", folder, tmp_path / "out", "-q"), case=f"symlink:{kind}")


def test_symlinks_inside_the_folder_and_hf_cache_blobs_are_followed(tmp_path: Path) -> None:
    """The Hugging Face cache layout: snapshots/<rev>/<file> -> ../../blobs/<sha>."""
    from safetensors.numpy import load_file

    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    built = _sharded(tmp_path / "built")
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, path in enumerate(sorted(built.iterdir())):
        blob = repo / "blobs" / f"sha{i}"
        path.rename(blob)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    result = invoke_cli("split", snapshot, tmp_path / "out", "--max-shard-size", "1MB", "-q")
    assert result.exit_code == 0, result.stderr
    assert sorted(load_file(str(tmp_path / "out" / "model.safetensors"))) == sorted(h.make_tensors(8, total_bytes=4000))
    inside = _sharded(tmp_path / "inside")  # a link to a file in the same folder is fine too
    first = _shards(inside)[0]
    first.rename(inside / "real.safetensors.data")
    first.symlink_to("real.safetensors.data")
    assert invoke_cli("split", inside, tmp_path / "out2", "-q").exit_code == 0


# ----------------------------------------------------------------------------- headers

def _raw(path: Path, header: bytes, *, length: int | None = None, data: bytes = b"") -> Path:
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)
    return path


def _entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


HEADERS = {
    "shape-overflows-64-bits": (json.dumps({"w": _entry("F32", [2**32, 2**32, 16], 0, 4)}).encode(), None, b"\0" * 4,
                                "overflow"),
    "header-claims-a-terabyte": (b"{}", 2**40, b"", "limit"),
    "header-claims-past-eof": (b"{}", 90_000_000, b"", "past the end"),
    "data-claims-a-terabyte": (json.dumps({"w": _entry("U8", [10**12], 0, 10**12)}).encode(), None, b"", "file has"),
    "integer-with-5000-digits": (b'{"w":{"dtype":"F32","shape":[' + b"1" * 5000 + b'],"data_offsets":[0,4]}}', None,
                                 b"\0" * 4, "json"),
    "nesting-100k-deep": (b'{"w":' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, b"", "json"),
    "lone-surrogate-name": (b'{"\\ud800":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', None, b"\0", "unicode"),
    "negative-shape": (json.dumps({"w": _entry("F32", [-1], 0, 4)}).encode(), None, b"\0" * 4, "shape"),
    "metadata-not-strings": (json.dumps({"__metadata__": {"a": 1}}).encode(), None, b"", "metadata"),
}


@pytest.mark.parametrize("case", list(HEADERS))
def test_hostile_header_is_refused(case: str, tmp_path: Path) -> None:
    header, length, data, expect = HEADERS[case]
    path = _raw(tmp_path / "model.safetensors", header, length=length, data=data)
    _refused(invoke_cli("split", path, tmp_path / "out", "-q"), contains=expect, case=f"header:{case}")
    assert not (tmp_path / "out").exists()


def test_header_cap_is_checked_before_reading(tmp_path: Path) -> None:
    """A sparse 300 MB file whose prefix claims a 200 MB header: refused with ~no memory used."""
    from shardkit.errors import HeaderError
    from shardkit.formats.header import read_header

    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", 200_000_000) + b"{")
        f.truncate(300_000_000)
    for claimed in (200_000_000, 2**63):
        with open(path, "r+b") as f:
            f.write(struct.pack("<Q", claimed))
        tracemalloc.start()
        with pytest.raises(HeaderError, match="limit"):
            read_header(path)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 1_000_000, f"read_header allocated {peak} bytes before refusing"


@pytest.mark.parametrize("name", ["model.safetensors", "model.bin", "model.pt", "model.safetensors.index.json"])
def test_zero_length_file_is_refused(name: str, tmp_path: Path) -> None:
    path = tmp_path / name
    path.write_bytes(b"")
    _refused(invoke_cli("split", path, tmp_path / "out", "-q"), case=f"zero-length:{name}")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- tensor names

ODD_NAMES = ["../../escape", "/abs/name", "a/b\\c", "ctrl\x1b]0;pwned\x07", "nul\x00byte", "tab\tand\nnewline"]


def test_tensor_names_are_data_not_paths(tmp_path: Path) -> None:
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import save_file

    tensors = {name: np.full((3,), i, dtype=np.float32) for i, name in enumerate(ODD_NAMES)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    before = sorted(p.name for p in tmp_path.parent.iterdir())
    result = invoke_cli("split", tmp_path / "model.safetensors", tmp_path / "out", "--max-shard-size", "20B", "-q")
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in tmp_path.parent.iterdir()) == before  # nothing created beside
    assert not any(p.name == "escape" for p in tmp_path.rglob("*"))
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(ODD_NAMES)
    for name, shard in index["weight_map"].items():
        with safe_open(str(tmp_path / "out" / shard), framework="numpy") as f:
            assert f.get_tensor(name).tolist() == tensors[name].tolist()


def test_control_characters_in_names_never_reach_the_terminal(tmp_path: Path) -> None:
    """An error about a tensor named with escape sequences prints it escaped (repr)."""
    import numpy as np
    from safetensors.numpy import save_file

    evil = "\x1b[2J\x1b]0;owned\x07w"
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file({evil: np.zeros(2, np.float32)}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({evil: np.zeros(2, np.float32)}, str(folder / "model-00002-of-00002.safetensors"))
    weight_map = {evil: "model-00001-of-00002.safetensors", "x": "model-00002-of-00002.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    proc = h.run_shardkit(["split", folder, tmp_path / "out", "-q"])
    line = _refused(proc, case="names:control-characters-in-error")
    assert "\x1b" not in proc.stderr and "\x07" not in proc.stderr
    assert "\\x1b" in line
