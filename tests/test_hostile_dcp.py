"""Hostile torch DCP and pickle folders (issue 41): every file opened inside the folder, nothing amplified.

Policies proved here, each through the real CLI (one line, exit 2, nothing outside read or created)
and the Python API:

* ``.metadata`` names its data files by relative names inside the folder: an absolute
  ``relative_path``, one with ``..``, or a data file that is a symlink leading outside is refused
  before anything behind it is opened.
* ``info`` reads a DCP ``.metadata``, a ``.distcp``, a folder's ``pytorch_model.bin`` and the
  ``.bin`` shards an index names through the folder boundary, as ``convert`` and ``verify`` do.
* A chunk record with a compressed member (a zip bomb: ``torch.save`` never compresses) is
  refused before anything is inflated: under 1 GiB and in seconds.
* A tensor's chunks must tile its declared shape exactly: a shape they leave uncovered, chunks
  that overlap or leave it, are refused instead of being filled with zeros.
"""

from __future__ import annotations

import io
import json
import pickle
import tracemalloc
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import helpers_boundary as b
import pytest
import torch
from conftest import assert_one_line_error, invoke_cli

import shardkit
from shardkit.errors import InvalidInputError, ShardkitError

SECRET = 7.25  # every value of the tensors outside the folder


def _dcp_save(state: dict, folder: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    return folder


def _handmade(folder: Path, shape: tuple[int, ...], pieces: list[tuple[tuple[int, ...], torch.Tensor]], *,
              record: Callable[[bytes], bytes] = lambda raw: raw) -> Path:
    """A DCP folder holding tensor ``w`` of ``shape`` declared as ``pieces`` (offsets, tensor), one data file;
    ``record`` rewrites each chunk's ``torch.save`` bytes."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    folder.mkdir(parents=True)
    data, storage, chunks = io.BytesIO(), {}, []
    for offsets, piece in pieces:
        buf = io.BytesIO()
        torch.save(piece.clone(), buf)
        raw = record(buf.getvalue())
        storage[MetadataIndex("w", offsets)] = _StorageInfo("__0_0.distcp", data.tell(), len(raw))
        data.write(raw)
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=piece.size()))
    (folder / "__0_0.distcp").write_bytes(data.getvalue())
    meta = TensorStorageMetadata(TensorProperties(dtype=pieces[0][1].dtype), torch.Size(shape), chunks)
    (folder / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={"w": meta}, storage_data=storage)))
    return folder


def _set_paths(folder: Path, relative_path: str) -> None:
    """Rewrite every chunk's ``relative_path`` in ``folder/.metadata`` (a test's own file: plain pickle)."""
    meta = pickle.loads((folder / ".metadata").read_bytes())
    for info in meta.storage_data.values():
        info.relative_path = relative_path
    (folder / ".metadata").write_bytes(pickle.dumps(meta))


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """Another project's DCP checkpoint, beside the folder under test."""
    return _dcp_save({"w": torch.full((2, 4), SECRET), "b": torch.full((3,), SECRET)}, tmp_path / "victim")


def _refused_everywhere(folder: Path, tmp_path: Path, *, contains: str, api: type[Exception] = InvalidInputError) -> None:
    """info and convert refuse in one line (exit 2), create nothing and change nothing outside; the API raises."""
    before = b.outside_state(tmp_path, skip=folder)
    for args in (["info", folder], ["convert", folder, tmp_path / "out", "-q"]):
        line = assert_one_line_error(invoke_cli(*args), code=2)
        assert contains in line.lower(), line
        assert str(SECRET) not in line
    assert not (tmp_path / "out").exists()
    assert b.outside_state(tmp_path, skip=folder) == before
    with pytest.raises(api):
        shardkit.info(folder)
    with pytest.raises(api):
        shardkit.convert(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- item 1: relative_path


@pytest.mark.parametrize("case", ["absolute", "dotdot", "dotdot-inner", "empty-part", "control-char"])
def test_relative_path_leaving_the_folder_is_refused(case: str, victim: Path, tmp_path: Path) -> None:
    """Before: info listed, and convert copied into the output (exit 0), another project's tensors."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes((victim / ".metadata").read_bytes())  # a folder holding only .metadata
    rel = {"absolute": str(victim / "__0_0.distcp"), "dotdot": "../victim/__0_0.distcp",
           "dotdot-inner": "sub/../../victim/__0_0.distcp", "empty-part": "//__0_0.distcp",
           "control-char": "__0_0\n.distcp"}[case]
    _set_paths(folder, rel)
    _refused_everywhere(folder, tmp_path, contains=".metadata")


def test_relative_path_in_a_subfolder_inside_is_followed(victim: Path, tmp_path: Path) -> None:
    """The control: a relative name inside the folder (here in a subfolder) is read as before."""
    folder = tmp_path / "ckpt"
    (folder / "data").mkdir(parents=True)
    (folder / ".metadata").write_bytes((victim / ".metadata").read_bytes())
    (folder / "data" / "__0_0.distcp").write_bytes((victim / "__0_0.distcp").read_bytes())
    _set_paths(folder, "data/__0_0.distcp")
    shardkit.convert(folder, tmp_path / "out")
    from safetensors.torch import load_file

    assert load_file(tmp_path / "out" / "model.safetensors")["w"].eq(SECRET).all()


# ----------------------------------------------------------------------------- item 3: links leading outside


@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp"])
def test_dcp_file_linked_outside_is_refused_by_info(name: str, victim: Path, tmp_path: Path) -> None:
    """Before: info read the outside file (exit 0); convert refused only through its side-file check."""
    folder = _dcp_save({"w": torch.zeros(2, 4), "b": torch.zeros(3)}, tmp_path / "ckpt")
    (folder / name).unlink()
    (folder / name).symlink_to(victim / name)
    _refused_everywhere(folder, tmp_path, contains="outside")
    run = b.run_bounded("info", folder)
    b.assert_refused(run, contains="outside")


def _pickle(path: Path, state: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return path


def test_folder_pytorch_model_bin_linked_outside_is_refused(tmp_path: Path) -> None:
    """Before: info unpickled the outside file and listed its tensors (exit 0)."""
    outside = _pickle(tmp_path / "elsewhere" / "secret.bin", {"secret_weight": torch.full((4,), SECRET)})
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "pytorch_model.bin").symlink_to(outside)
    _refused_everywhere(folder, tmp_path, contains="outside")
    b.assert_refused(b.run_bounded("info", folder), contains="outside")
    # named by the user, the same link is followed: their choice, not a file found in a folder
    assert shardkit.info(folder / "pytorch_model.bin").tensor_count == 1


def _sharded_bin(folder: Path) -> list[Path]:
    shards = [_pickle(folder / f"pytorch_model-0000{i}-of-00002.bin", {f"w{i}": torch.zeros(4)}) for i in (1, 2)]
    weight_map = {f"w{i}": shard.name for i, shard in zip((1, 2), shards, strict=True)}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return shards


@pytest.mark.parametrize("target", ["index-folder", "index-file"])
def test_bin_shard_named_by_its_index_linked_outside_is_refused(target: str, tmp_path: Path) -> None:
    """Before: info unpickled the outside shard the index named (exit 0)."""
    folder = tmp_path / "ckpt"
    shards = _sharded_bin(folder)
    outside = _pickle(tmp_path / "elsewhere" / shards[1].name, {"w2": torch.full((4,), SECRET)})
    shards[1].unlink()
    shards[1].symlink_to(outside)
    path = folder if target == "index-folder" else folder / "pytorch_model.bin.index.json"
    before = b.outside_state(tmp_path, skip=folder)
    for args in (["info", path], ["convert", path, tmp_path / "out", "-q"]):
        assert_one_line_error(invoke_cli(*args), code=2, contains="outside")
    assert not (tmp_path / "out").exists()
    assert b.outside_state(tmp_path, skip=folder) == before
    with pytest.raises(InvalidInputError, match="outside"):
        shardkit.info(path)


def test_pickle_index_linked_outside_is_refused(tmp_path: Path) -> None:
    """An index found in the folder is read under the boundary too (named by the user, it is followed)."""
    folder = tmp_path / "ckpt"
    _sharded_bin(folder)
    index = folder / "pytorch_model.bin.index.json"
    outside = tmp_path / "elsewhere" / index.name
    outside.parent.mkdir()
    index.rename(outside)
    index.symlink_to(outside)
    assert_one_line_error(invoke_cli("info", folder), code=2, contains="outside")


def test_links_inside_the_folder_are_followed(tmp_path: Path) -> None:
    """The control: a .bin shard and a .distcp linked to files inside the folder are read as before."""
    folder = tmp_path / "ckpt"
    shards = _sharded_bin(folder)
    real = shards[1].rename(folder / "real.bin.data")
    shards[1].symlink_to(real.name)
    assert shardkit.info(folder).tensor_count == 2
    dcp_folder = _dcp_save({"w": torch.zeros(2, 4)}, tmp_path / "dcp")
    (dcp_folder / "__0_0.distcp").rename(dcp_folder / "data.bin")
    (dcp_folder / "__0_0.distcp").symlink_to("data.bin")
    assert shardkit.info(dcp_folder).tensor_count == 1


# ----------------------------------------------------------------------------- item 4: zip bombs

BOMB_BYTES = 64 << 20  # inflated size of each bomb: small enough to build fast, plain in tracemalloc


def _bomb(method: int, member: str) -> Callable[[bytes], bytes]:
    """Rewrite a torch.save record so that its ``member`` (data.pkl or data/0) inflates to BOMB_BYTES of zeros."""
    def rewrite(raw: bytes) -> bytes:
        out = io.BytesIO()
        with zipfile.ZipFile(io.BytesIO(raw)) as src, zipfile.ZipFile(out, "w") as dst:
            for info in src.infolist():
                if info.filename.endswith(member):
                    dst.writestr(info.filename, bytes(BOMB_BYTES), compress_type=method)
                else:
                    dst.writestr(info, src.read(info))
        return out.getvalue()

    return rewrite


@pytest.mark.parametrize("method,member", [(zipfile.ZIP_BZIP2, "data.pkl"), (zipfile.ZIP_DEFLATED, "data/0")])
def test_a_compressed_chunk_member_is_refused_before_inflating(method: int, member: str, tmp_path: Path) -> None:
    """Before: a 968-byte chunk whose data.pkl was bzip2 took info and convert to 2.45 GB RSS (info exit 0)."""
    folder = _handmade(tmp_path / "ckpt", (2, 4), [((0, 0), torch.ones(2, 4))], record=_bomb(method, member))
    assert (folder / "__0_0.distcp").stat().st_size < 1 << 20  # a bomb: tiny on disk
    line = b.assert_refused(b.run_bounded("info", folder), contains="compressed")  # under 1 GiB
    assert "__0_0.distcp" in line
    assert_one_line_error(invoke_cli("convert", folder, tmp_path / "out", "-q"), code=2, contains="compressed")
    assert not (tmp_path / "out").exists()
    tracemalloc.start()
    try:
        with pytest.raises(InvalidInputError, match="compressed"):
            shardkit.info(folder)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < BOMB_BYTES // 4, f"{peak} bytes allocated: the member was inflated"


# ----------------------------------------------------------------------------- item 5: chunks must tile


def _rows(*starts: int, width: int = 4) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    return [((s, 0), torch.full((2, width), float(i + 1))) for i, s in enumerate(starts)]


@pytest.mark.parametrize("case", ["uncovered-huge", "uncovered-row", "overlap", "outside", "rank"])
def test_chunks_that_do_not_tile_the_shape_are_refused(case: str, tmp_path: Path) -> None:
    """Before: [4, 2**22] over two 2x4 chunks made convert write 67 MB of zeros from a 4 KB folder (exit 0)."""
    shape, pieces = {
        "uncovered-huge": ((4, 2**22), _rows(0, 2)),
        "uncovered-row": ((6, 4), _rows(0, 2)),
        "overlap": ((4, 4), [((0, 0), torch.ones(3, 4)), ((1, 0), torch.ones(1, 4))]),  # 16 elements, one row twice
        "outside": ((4, 4), _rows(0, 3)),
        "rank": ((8,), _rows(0, 2)),
    }[case]
    folder = _handmade(tmp_path / "ckpt", shape, pieces)
    before = b.outside_state(tmp_path, skip=folder)
    for args in (["info", folder], ["convert", folder, tmp_path / "out", "-q"]):
        line = assert_one_line_error(invoke_cli(*args), code=2, contains="chunk")
        assert "'w'" in line and "re-save" in line
    assert not (tmp_path / "out").exists()
    assert b.outside_state(tmp_path, skip=folder) == before
    with pytest.raises(InvalidInputError, match="chunk"):
        shardkit.convert(folder, tmp_path / "out")


def test_chunks_that_tile_exactly_still_convert(tmp_path: Path) -> None:
    """The control: the same two chunks over the shape they tile convert bit-exactly."""
    folder = _handmade(tmp_path / "ckpt", (4, 4), _rows(0, 2))
    shardkit.convert(folder, tmp_path / "out")
    from safetensors.torch import load_file

    w = load_file(tmp_path / "out" / "model.safetensors")["w"]
    assert w[:2].eq(1).all() and w[2:].eq(2).all()


def test_a_chunk_record_of_another_shape_is_refused(tmp_path: Path) -> None:
    """.metadata declaring a 2x4 chunk whose record holds 1x4 (a record swapped in) is one line, not a short read."""
    folder = _handmade(tmp_path / "ckpt", (2, 4), [((0, 0), torch.ones(2, 4))])
    meta = pickle.loads((folder / ".metadata").read_bytes())
    buf = io.BytesIO()
    torch.save(torch.ones(1, 4), buf)
    (folder / "__0_0.distcp").write_bytes(buf.getvalue())
    for info in meta.storage_data.values():
        info.length = len(buf.getvalue())
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    assert_one_line_error(invoke_cli("convert", folder, tmp_path / "out", "-q"), code=2, contains="shape")
    with pytest.raises(ShardkitError):
        shardkit.info(folder)

