"""GGUF in stores: ``s3://`` (a real SeaweedFS) and ``hf://`` (the offline Hub) as sources and destinations.

A GGUF in a store (a split's every part) is read by range, or fetched whole where every byte is checked (``verify``,
the Hub through its cache: :mod:`shardkit.stores.gguf_fetch`; by range: tests/test_gguf_remote.py);
``convert --to gguf`` into ``s3://.../NAME.gguf`` stages the file (or the split's files) and uploads them; a folder of
GGUFs is verified and pushed to the Hub. Every result is compared byte for byte with the local one.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import pytest
from conftest import assert_one_line_error
from helpers_gguf import tiny_llama_folder

import shardkit
from shardkit.formats.gguf import read_gguf

pytestmark = pytest.mark.filterwarnings("ignore:.*no tokenizer.json:shardkit.errors.ShardkitWarning")


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama folder, its q8_0 GGUF (``one``) and the same as a split of three or more parts (``split``)."""
    root = tmp_path_factory.mktemp("gguf")
    tiny_llama_folder(root / "llama")
    (root / "one").mkdir()
    (root / "split").mkdir()
    shardkit.convert(root / "llama", root / "one" / "m.gguf", to="gguf", quantize="q8_0")
    parts = shardkit.convert(root / "llama", root / "split" / "m.gguf", to="gguf", quantize="q8_0",
                             max_shard_size="40KB").files
    assert len(parts) >= 3
    return {"llama": root / "llama", "one": root / "one" / "m.gguf", "split": root / "split"}


def _parts(ggufs: dict[str, Path]) -> list[Path]:
    return sorted(ggufs["split"].iterdir())


@pytest.fixture
def no_leftovers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Temporary folders made under a folder of the test's own, to check that none is left."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


# ----------------------------------------------------------------------------- s3://


def test_a_gguf_and_a_split_written_into_a_bucket_are_the_local_bytes(ggufs: dict[str, Path], s3_env, run_cli,
                                                                      no_leftovers: Path) -> None:
    bucket = s3_env.bucket
    result = run_cli("convert", ggufs["llama"], f"s3://{bucket}/one/m.gguf", "--to", "gguf", "--quantize", "q8_0")
    assert result.exit_code == 0, result.stderr
    assert s3_env.keys("one/") == ["one/m.gguf"] and s3_env.get("one/m.gguf") == ggufs["one"].read_bytes()
    result = shardkit.convert(ggufs["llama"], f"s3://{bucket}/split/m.gguf", to="gguf", quantize="q8_0",
                              max_shard_size="40KB")
    parts = _parts(ggufs)
    assert result.files == [f"s3://{bucket}/split/{p.name}" for p in parts]
    assert s3_env.keys("split/") == [f"split/{p.name}" for p in parts]
    assert all(s3_env.get(f"split/{p.name}") == p.read_bytes() for p in parts)
    assert list(no_leftovers.iterdir()) == []


def test_an_output_prefix_without_a_gguf_name_is_one_line_naming_it(ggufs: dict[str, Path], s3_env, run_cli) -> None:
    line = assert_one_line_error(run_cli("convert", ggufs["llama"], f"s3://{s3_env.bucket}/out", "--to", "gguf"))
    assert f"s3://{s3_env.bucket}/out: --to gguf writes one file" in line and "/tmp" not in line
    assert s3_env.keys() == []


def test_a_gguf_in_a_bucket_is_a_source(ggufs: dict[str, Path], s3_env, run_cli, tmp_path: Path,
                                        no_leftovers: Path) -> None:
    """The whole file and the split's first part convert as the local files do: to a GGUF, and to a folder."""
    bucket = s3_env.bucket
    s3_env.put("one/m.gguf", ggufs["one"].read_bytes())
    s3_env.put_folder(ggufs["split"], "split")
    first = _parts(ggufs)[0].name
    result = run_cli("convert", f"s3://{bucket}/one/m.gguf", tmp_path / "a.gguf", "--to", "gguf")
    assert result.exit_code == 0, result.stderr
    shardkit.convert(f"s3://{bucket}/split/{first}", tmp_path / "b.gguf", to="gguf")
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes() == ggufs["one"].read_bytes()
    shardkit.convert(f"s3://{bucket}/split/{first}", tmp_path / "remote", dtype="fp32")
    shardkit.convert(ggufs["one"], tmp_path / "local", dtype="fp32")
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "remote" / name).read_bytes() == (tmp_path / "local" / name).read_bytes(), name
    assert list(no_leftovers.iterdir()) == []


def test_verify_of_a_split_in_a_bucket_reads_every_part(ggufs: dict[str, Path], s3_env, run_cli) -> None:
    parts = _parts(ggufs)
    s3_env.put_folder(ggufs["split"], "split")
    url = f"s3://{s3_env.bucket}/split/{parts[0].name}"
    report = shardkit.verify(url)
    assert report.ok and report.path == url and report.tensors_checked == 21
    assert [(f.name, f.sha256) for f in report.files] == [(p.name, hashlib.sha256(p.read_bytes()).hexdigest())
                                                          for p in parts]
    s3_env.client().delete_object(Bucket=s3_env.bucket, Key=f"split/{parts[1].name}")
    result = run_cli("verify", url)
    assert result.exit_code == 1 and f"FAIL {parts[1].name}: missing: part 2" in result.stdout
    assert "/tmp" not in result.stdout + result.stderr
    assert_one_line_error(run_cli("convert", url, "x.gguf", "--to", "gguf"), contains=f"{parts[1].name}: missing")


def test_info_of_a_split_in_a_bucket_reads_the_headers(ggufs: dict[str, Path], s3_env, run_cli,
                                                       no_leftovers: Path) -> None:
    """Each part's header fetched (the data left a hole): the same description as the local split, a shard per part."""
    parts = _parts(ggufs)
    s3_env.put_folder(ggufs["split"], "split")
    url = f"s3://{s3_env.bucket}/split/{parts[0].name}"
    remote, local = shardkit.info(url), shardkit.info(parts[0])
    assert remote.path == url and remote.quantization == local.quantization
    assert [(s.file, s.tensors, s.file_bytes) for s in remote.shards] == [
        (s.file, s.tensors, s.file_bytes) for s in local.shards] == [
        (p.name, len(read_gguf(p).tensors), p.stat().st_size) for p in parts]
    result = run_cli("info", url)
    assert result.exit_code == 0 and all(p.name in result.stdout for p in parts), result.stderr
    assert list(no_leftovers.iterdir()) == []


def test_a_missing_file_or_a_later_part_is_one_line(ggufs: dict[str, Path], s3_env, run_cli, tmp_path: Path) -> None:
    parts = _parts(ggufs)
    s3_env.put_folder(ggufs["split"], "split")
    line = assert_one_line_error(run_cli("convert", f"s3://{s3_env.bucket}/split/{parts[1].name}", tmp_path / "x.gguf",
                                         "--to", "gguf"), contains=f"give the first part, {parts[0].name}")
    assert f"s3://{s3_env.bucket}/split/{parts[1].name}: part 2 of a {len(parts)}-part split GGUF" in line
    assert_one_line_error(run_cli("convert", f"s3://{s3_env.bucket}/split/none.gguf", tmp_path / "x.gguf", "--to", "gguf"),
                          contains=f"s3://{s3_env.bucket}/split/none.gguf: no such object")
    assert not (tmp_path / "x.gguf").exists()


# ----------------------------------------------------------------------------- hf://


def test_a_split_pushed_to_the_hub_reads_back_as_the_local_file(ggufs: dict[str, Path], hub, tmp_path: Path) -> None:
    """``push`` verifies the folder of GGUFs (every part) and sends it; ``hf://.../NAME-00001-of-N.gguf`` is a source
    and a ``verify`` target, fetched with every part and checked against the Hub's LFS sha256s."""
    from helpers_hub import hub_env, run_shardkit

    env = hub_env(hub, tmp_path / "home")
    parts = _parts(ggufs)
    done = run_shardkit(env, "push", ggufs["split"], "alice/llama-gguf")
    assert done.returncode == 0, done.stderr
    assert sorted(set(hub.state.files_at("alice/llama-gguf")) - {".gitattributes"}) == [p.name for p in parts]
    url = f"hf://alice/llama-gguf/{parts[0].name}"
    done = run_shardkit(env, "convert", url, tmp_path / "back.gguf", "--to", "gguf")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "back.gguf").read_bytes() == ggufs["one"].read_bytes()
    done = run_shardkit(env, "verify", url)
    assert done.returncode == 0, done.stderr
    for p in parts:
        assert f"sha256 {hashlib.sha256(p.read_bytes()).hexdigest()}" in done.stdout
    done = run_shardkit(env, "convert", f"hf://alice/llama-gguf/{parts[-1].name}", tmp_path / "x.gguf", "--to", "gguf")
    assert_one_line_error(done, contains=f"give the first part, {parts[0].name}")


def test_a_folder_of_ggufs_is_verified_as_push_sends_it(ggufs: dict[str, Path], tmp_path: Path, run_cli) -> None:
    """What push checks first: every GGUF of the folder, a split from its first part; a part without its first is a
    finding."""
    parts = _parts(ggufs)
    folder = tmp_path / "folder"
    folder.mkdir()
    for path in [ggufs["one"], *parts]:
        (folder / path.name).write_bytes(path.read_bytes())
    report = shardkit.verify(folder)
    assert report.ok and [f.name for f in report.files] == sorted(p.name for p in [ggufs["one"], *parts])
    assert report.tensors_checked == 42
    (folder / parts[0].name).unlink()
    result = run_cli("verify", folder)
    assert result.exit_code == 1
    assert [line for line in result.stdout.splitlines() if line.startswith("FAIL")] == [
        f"FAIL {p.name}: a part of a split GGUF whose first part, {parts[0].name}, is not in the folder"
        for p in parts[1:]]
