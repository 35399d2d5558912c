"""shardkit.manifest.json: written with every output, checked by verify, kept consistent by the transaction."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import helpers_reliability as h
import pytest
import torch
from conftest import leftovers
from helpers_verify import build_pipeline, flip_byte, index_of, make_state_dict, read_raw_header, tensor_offset
from safetensors.torch import save_file

import shardkit
from shardkit.checking.verify import verify
from shardkit.errors import ShardkitWriteError
from shardkit.formats.manifest import MANIFEST_NAME, read_manifest
from shardkit.formats.suffixes import is_index_file, is_manifest_file, is_weight_file
from shardkit.sharding import digest

SHARD = 20_000


@pytest.fixture
def folder_source(tmp_path: Path) -> Path:
    """A plain checkpoint folder with a config.json, as another tool would leave it (no manifest)."""
    src = tmp_path / "src"
    src.mkdir()
    save_file(make_state_dict(), str(src / "model.safetensors"), metadata={"format": "pt"})
    (src / "config.json").write_text(json.dumps({"hidden_size": 40}))
    return src


@pytest.fixture
def out(tmp_path: Path, folder_source: Path, run_cli) -> Path:
    result = run_cli("split", folder_source, tmp_path / "out", "--max-shard-size", str(SHARD), "-q")
    assert result.exit_code == 0, result.stderr
    return tmp_path / "out"


def shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("model-*.safetensors"))


def crcs(folder: Path) -> dict[str, str]:
    """Tensor name → crc32, over every safetensors file the folder's manifest lists."""
    manifest = read_manifest(folder)
    assert manifest is not None
    return {name: t.crc32 for f in manifest.files.values() for name, t in f.tensors.items()}


def test_every_written_file_is_listed_with_its_sha256_and_tensor_digests(out: Path) -> None:
    import hashlib
    import zlib

    manifest = read_manifest(out)
    assert manifest is not None
    on_disk = sorted(p.name for p in out.iterdir() if p.name != MANIFEST_NAME)
    assert sorted(manifest.files) == on_disk  # shards, index and config.json
    for name, record in manifest.files.items():
        data = (out / name).read_bytes()
        # shards are covered by crc32s (header region + every tensor); other files by their sha256
        sha = None if name.endswith(".safetensors") else hashlib.sha256(data).hexdigest()
        assert (record.size_bytes, record.sha256) == (len(data), sha)
    shard = shards(out)[0]
    record, (header, start) = manifest.files[shard.name], read_raw_header(shard)
    data = shard.read_bytes()
    assert record.data_start == start and record.header_crc32 == f"{zlib.crc32(data[:start]):08x}"
    for name, spec in header.items():
        if name != "__metadata__":
            begin, end = spec["data_offsets"]
            assert (record.tensors[name].begin, record.tensors[name].end) == (begin, end)
            assert record.tensors[name].crc32 == f"{zlib.crc32(data[start + begin:start + end]):08x}"


def test_a_flipped_byte_in_any_shard_is_named_with_its_tensor(out: Path, run_cli) -> None:
    for shard in shards(out):
        header, _ = read_raw_header(shard)
        tensor = max((n for n in header if n != "__metadata__"),
                     key=lambda n: header[n]["data_offsets"][1] - header[n]["data_offsets"][0])
        original = shard.read_bytes()
        flip_byte(shard, tensor_offset(shard, tensor) + 3)
        result = run_cli("verify", out)
        assert result.exit_code == 1, result.stdout
        fails = [line for line in result.stdout.splitlines() if line.startswith("FAIL")]
        assert len(fails) == 1 and fails[0].startswith(f"FAIL {shard.name}: tensor {tensor!r}: data changed"), fails
        report = verify(out)
        assert [(f.file, f.tensor) for f in report.findings] == [(shard.name, tensor)]
        shard.write_bytes(original)
    assert run_cli("verify", out).exit_code == 0


def test_a_flipped_byte_in_the_header_or_config_is_named(out: Path, run_cli) -> None:
    shard = shards(out)[0]
    raw = shard.read_bytes()
    flip_byte(shard, 20)  # inside the header JSON
    result = run_cli("verify", out)
    assert result.exit_code == 1
    fails = [line for line in result.stdout.splitlines() if line.startswith("FAIL")]
    assert fails and all(line.startswith(f"FAIL {shard.name}") for line in fails), result.stdout
    shard.write_bytes(raw)

    flip_byte(out / "config.json", 3)
    result = run_cli("verify", out)
    assert result.exit_code == 1
    fails = [line for line in result.stdout.splitlines() if line.startswith("FAIL")]
    assert len(fails) == 1 and fails[0].startswith("FAIL config.json: changed since shardkit wrote it: sha256"), fails


def test_header_region_damage_is_located_when_it_still_parses(out: Path) -> None:
    shard = shards(out)[0]
    _, start = read_raw_header(shard)
    raw = shard.read_bytes()
    pad = raw.rindex(b"  ", 0, start)  # the writer pads the header with spaces
    shard.write_bytes(raw[:pad] + b"\t" + raw[pad + 1:])
    report = verify(out)
    assert [(f.file, f.tensor) for f in report.findings] == [(shard.name, None)]
    assert report.findings[0].message.startswith(f"header bytes 0-{start} changed since shardkit wrote them")


def test_a_folder_without_a_manifest_says_structure_only(folder_source: Path, run_cli) -> None:
    result = run_cli("verify", folder_source)
    assert result.exit_code == 0
    assert "integrity: structure only for model.safetensors (no shardkit.manifest.json)" in result.stdout
    assert "pass --against SOURCE" in result.stdout
    report = verify(folder_source)
    assert report.ok and report.manifests == [] and report.structure_only == ["model.safetensors"]


def test_a_clean_output_reports_every_file_checked_against_the_manifest(out: Path, run_cli) -> None:
    result = run_cli("verify", out)
    assert result.exit_code == 0, result.stdout
    listed = len(read_manifest(out).files)
    assert f"integrity: {listed} file(s) match shardkit.manifest.json byte for byte" in result.stdout
    assert verify(out).structure_only == []
    report = json.loads(run_cli("verify", out, "--json").stdout)
    assert report["manifests"] == [MANIFEST_NAME] and {f["checked"] for f in report["files"]} == {"manifest"}


def test_manifest_survives_split_merge_convert_and_digests_carry(tmp_path: Path, out: Path) -> None:
    first = crcs(out)
    resharded = tmp_path / "resharded"
    shardkit.split(out, resharded, max_shard_size=SHARD * 2)  # the source's own manifest is not copied
    assert crcs(resharded) == first and verify(resharded).ok
    assert not any(is_manifest_file(n) for n in os.listdir(resharded) if n != MANIFEST_NAME)
    shardkit.merge(resharded, tmp_path / "merged.safetensors")  # the manifest is no shard: merge ignores it
    converted = tmp_path / "converted"
    shardkit.convert(tmp_path / "merged.safetensors", converted, max_shard_size=SHARD)
    assert crcs(converted) == first and verify(converted).ok
    shardkit.split(converted, converted, max_shard_size="1GB", overwrite=True)  # in place: replaced
    assert sorted(read_manifest(converted).files) == ["model.safetensors"]
    assert crcs(converted) == first and verify(converted).ok


def test_reshard_in_place_replaces_the_manifest_and_keeps_untouched_records(out: Path) -> None:
    config_record = read_manifest(out).files["config.json"]
    shardkit.split(out, out, max_shard_size=SHARD * 3, overwrite=True)
    manifest = read_manifest(out)
    assert sorted(manifest.files) == sorted(p.name for p in out.iterdir() if p.name != MANIFEST_NAME)
    assert manifest.files["config.json"] == config_record  # not rewritten: its original record is kept
    assert verify(out).ok


def test_a_source_that_changed_since_its_manifest_is_never_blessed(tmp_path: Path, out: Path, run_cli) -> None:
    """Copied tensors carry the source's crc32 instead of being read back: a copy-on-write reshard reads
    headers only. Damage in the source is then recorded as damage: the copy's manifest holds the
    crc32 the tensor had when shardkit wrote it, so verify names it in the copy too."""
    shard = shards(out)[1]
    header, _ = read_raw_header(shard)
    tensor = next(n for n in header if n != "__metadata__")
    flip_byte(shard, tensor_offset(shard, tensor))
    shardkit.split(out, tmp_path / "copy", max_shard_size=SHARD * 2)
    result = run_cli("verify", tmp_path / "copy")
    assert result.exit_code == 1 and tensor in result.stdout + result.stderr


def test_a_failed_write_leaves_no_manifest(tmp_path: Path, out: Path, monkeypatch) -> None:
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real = digest.digest_file
    calls = []

    def failing(path, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise ShardkitWriteError("disk went away")
        return real(path, **kwargs)

    monkeypatch.setattr(digest, "digest_file", failing)
    with pytest.raises(ShardkitWriteError, match="disk went away"):
        shardkit.split(out, tmp_path / "fresh", max_shard_size=SHARD * 2)
    assert not (tmp_path / "fresh").exists()
    assert leftovers(tmp_path) == []
    calls.clear()
    with pytest.raises(ShardkitWriteError, match="disk went away"):
        shardkit.split(out, out, max_shard_size=SHARD * 2, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # old files, old manifest


def test_killed_in_place_reshard_never_leaves_a_disagreeing_manifest(tmp_path: Path, out: Path) -> None:
    trace = tmp_path / "trace"
    probe = tmp_path / "probe"
    shutil.copytree(out, probe)
    args = ["split", probe, probe, "--max-shard-size", str(SHARD * 3), "--overwrite", "-q"]
    assert h.run_shardkit(args, SHARDKIT_FAULT_TRACE=trace).returncode == 0
    points = h.read_trace(trace)
    chosen = {"file-done", "write:small-file", "commit:before-commit-point", "commit:after-commit-point",
              "commit:renamed"}
    kills = [n for n, label, _ in points if label in chosen][::2][:5]
    assert len(kills) >= 3
    for n in kills:
        work = tmp_path / f"k{n}"
        shutil.copytree(out, work)
        args[1:3] = [work, work]
        assert h.run_shardkit(args, SHARDKIT_FAULT_KILL_AT=n).returncode == -9
        from shardkit.atomic.commit import recover

        assert recover(work)  # a pending commit is settled by recover; verify only reports it
        report = verify(work)
        assert report.ok, (n, [str(f) for f in report.findings])
        assert report.structure_only == []


def test_pipeline_gets_one_manifest_at_the_top_and_components_verify_alone(tmp_path: Path) -> None:
    pipe = build_pipeline(tmp_path / "pipe")
    out = tmp_path / "split"
    shardkit.split(pipe, out, max_shard_size="60KB")
    assert [p.relative_to(out).as_posix() for p in out.rglob(MANIFEST_NAME)] == [MANIFEST_NAME]
    listed = read_manifest(out).files
    assert "model_index.json" in listed and "scheduler/scheduler_config.json" in listed
    assert any(n.startswith("unet/diffusion_pytorch_model-") for n in listed)
    report = verify(out)
    assert report.ok and report.structure_only == [], report.structure_only
    unet_index = "diffusion_pytorch_model.safetensors.index.json"
    shard = out / "unet" / index_of(out / "unet", unet_index)["weight_map"]["conv_in.weight"]
    flip_byte(shard, tensor_offset(shard, "conv_in.weight") + 1)
    found = [(f.file, f.tensor) for f in verify(out).findings]
    assert found == [(f"unet/{shard.name}", "conv_in.weight")]
    alone = verify(out / "unet")  # the parent's manifest covers the component
    assert [(f.file, f.tensor) for f in alone.findings] == [(shard.name, "conv_in.weight")]
    assert alone.manifests == [os.path.join("..", MANIFEST_NAME)]


def test_component_resharded_in_place_has_its_own_manifest_which_wins(tmp_path: Path) -> None:
    pipe = build_pipeline(tmp_path / "pipe")
    out = tmp_path / "split"
    shardkit.split(pipe, out, max_shard_size="60KB")
    shardkit.split(out / "unet", out / "unet", max_shard_size="1GB", overwrite=True)
    assert (out / "unet" / MANIFEST_NAME).exists()
    report = verify(out)  # the top manifest's old unet records are superseded
    assert report.ok, [str(f) for f in report.findings]
    assert report.manifests == [MANIFEST_NAME, f"unet/{MANIFEST_NAME}"]
    shardkit.split(out, out, max_shard_size="60KB", overwrite=True)  # whole pipeline again: one manifest
    assert not (out / "unet" / MANIFEST_NAME).exists() and verify(out).ok


def test_save_sharded_writes_a_manifest_and_loaders_ignore_it(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    sd = {"a": torch.randn(64, 8), "b": torch.randn(8)}
    shardkit.save_sharded(sd, tmp_path / "mem", max_shard_size="1KB")
    assert (tmp_path / "mem" / MANIFEST_NAME).exists() and verify(tmp_path / "mem").ok
    assert not is_weight_file(MANIFEST_NAME) and not is_index_file(MANIFEST_NAME)
    with shardkit.open(tmp_path / "mem") as lazy:
        assert sorted(lazy.keys()) == ["a", "b"]
    merged = {k: v for p in (tmp_path / "mem").glob("*.safetensors") for k, v in load_file(str(p)).items()}
    assert torch.equal(merged["a"], sd["a"])


def test_an_unreadable_manifest_is_a_finding_not_a_crash(out: Path, run_cli) -> None:
    (out / MANIFEST_NAME).write_text("{oops")
    result = run_cli("verify", out)
    assert result.exit_code == 1
    assert f"FAIL {MANIFEST_NAME}: " in result.stdout and "unreadable manifest" in result.stdout


def test_a_reshard_of_a_checkpoint_with_a_manifest_reads_back_only_headers(tmp_path: Path, out: Path,
                                                                            monkeypatch) -> None:
    """The tensors' crc32s are carried from the source's manifest, so nothing but headers is re-read
    (what keeps a copy-on-write reshard at clone speed); the result still verifies byte for byte."""
    from shardkit.formats import manifest as manifest_module

    read = []
    real = manifest_module._crc_ranges
    monkeypatch.setattr(manifest_module, "_crc_ranges",
                        lambda path, ranges, cancelled: read.extend(e - b for _, b, e in ranges) or real(path, ranges,
                                                                                                          cancelled))
    shardkit.split(out, tmp_path / "again", max_shard_size=SHARD * 3)
    assert read and sum(read) < 4096 * len(read), read  # header regions only
    assert verify(tmp_path / "again").ok
    copied = read_manifest(tmp_path / "again")
    original = read_manifest(out)
    crcs = lambda m: {n: t.crc32 for f in m.files.values() for n, t in f.tensors.items()}  # noqa: E731
    assert crcs(copied) == crcs(original)


def test_no_manifest_writes_none_and_removes_a_stale_one(tmp_path: Path, out: Path, run_cli) -> None:
    result = run_cli("split", out, tmp_path / "plain", "--no-manifest", "--max-shard-size", str(SHARD * 3) + "B")
    assert result.exit_code == 0, result.stderr
    assert not (tmp_path / "plain" / MANIFEST_NAME).exists()
    assert "structure only" in run_cli("verify", tmp_path / "plain").stdout + run_cli("verify", tmp_path / "plain").stderr
    # in place: the old manifest would describe files that are gone, so it goes too
    shutil.copytree(out, tmp_path / "inplace")
    shardkit.split(tmp_path / "inplace", tmp_path / "inplace", max_shard_size=SHARD * 3, overwrite=True, manifest=False)
    assert not (tmp_path / "inplace" / MANIFEST_NAME).exists()


def test_verify_checks_shards_against_their_crc32s_in_its_one_read(out: Path, monkeypatch, run_cli) -> None:
    """The scan that computes each file's sha256 also computes the manifest ranges' crc32s: a clean
    folder is never read a second time, and a damaged one still names its tensor."""
    from shardkit.checking import integrity

    def second_read(*args, **kwargs):
        raise AssertionError("verify read a shard twice")

    monkeypatch.setattr(integrity, "read_digests", second_read)
    assert verify(out).ok
    shard = shards(out)[0]
    header, _ = read_raw_header(shard)
    tensor = next(n for n in header if n != "__metadata__")
    flip_byte(shard, tensor_offset(shard, tensor))
    report = verify(out)
    assert not report.ok and any(f.tensor == tensor for f in report.findings)


def test_tensors_written_through_python_are_crcd_on_the_way_not_read_back(tmp_path: Path, folder_source: Path,
                                                                        monkeypatch) -> None:
    """A cast (and any source read through Python: pickles, memory, a streamed repository) records
    the crc32 of the bytes as they are written; the manifest reads back only header regions, and
    its crc32s still match the files byte for byte."""
    from shardkit.formats import manifest as manifest_module

    read = []
    real = manifest_module._crc_ranges
    monkeypatch.setattr(manifest_module, "_crc_ranges",
                        lambda path, ranges, cancelled: read.extend(e - b for _, b, e in ranges) or real(path, ranges,
                                                                                                          cancelled))
    shardkit.split(folder_source, tmp_path / "bf16", max_shard_size=SHARD * 3, dtype="bf16")
    sd = {"a": torch.randn(64, 8), "b": torch.randn(8)}
    shardkit.save_sharded(sd, tmp_path / "mem", max_shard_size="1KB")
    assert read and sum(read) < 4096 * len(read), read  # header regions only
    assert verify(tmp_path / "bf16").ok and verify(tmp_path / "mem").ok
    shard = sorted((tmp_path / "bf16").glob("*.safetensors"))[0]
    flip_byte(shard, shard.stat().st_size - 1)
    assert not verify(tmp_path / "bf16").ok  # the recorded crc32s are real ones
