"""The checkpoint-folder boundary (issue 30): reads stay inside the folder, never hang, never grow.

Every file shardkit reads for a folder (index, manifest, config, shards, manifest-listed files,
pipeline components) is opened once through a checked descriptor: a symlink leaving the folder,
a symlinked parent, a FIFO, a device or a folder in a file's place is refused before any byte is
read, with one line (verify: a finding, exit 1), in seconds and under 1 GiB. Each case runs the
real CLI under a wall-clock limit, so a hang fails the test instead of blocking the run.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import helpers_boundary as b
import helpers_reliability as h
import pytest

INDEX = "model.safetensors.index.json"
MANIFEST = "shardkit.manifest.json"
MARKER = "OUTSIDE-MARKER-7f3a"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A split folder with 4 shards, an index, a config.json and a manifest."""
    import shardkit

    root = tmp_path_factory.mktemp("built")
    src = h.write_checkpoint(root / "src", h.make_tensors(6, total_bytes=6000))
    (src / "config.json").write_text(json.dumps({"a": 1}))
    shardkit.split(src, root / "ckpt", max_shard_size="2KB")
    return root / "ckpt"


def _copy(built: Path, tmp_path: Path) -> tuple[Path, Path]:
    folder = tmp_path / "ckpt"
    shutil.copytree(built, folder)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.json").write_text(json.dumps({"format": "shardkit.manifest", "version": MARKER, "secret": MARKER,
                                                     "weight_map": {"x": "y.safetensors"}}))
    return folder, outside


def _shard(folder: Path) -> Path:
    return sorted(folder.glob("model-*.safetensors"))[0]


def _move_out(path: Path, outside: Path) -> None:
    """Replace ``path`` with a symlink to its own bytes moved outside the folder."""
    target = outside / path.name
    path.rename(target)
    path.symlink_to(target)


def _replace(path: Path, kind: str, outside: Path) -> None:
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "directory":
        path.mkdir()
    elif kind == "outside-json":
        path.symlink_to(outside / "secret.json")
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize("name", [INDEX, MANIFEST, "config.json", "shard"])
def test_verify_never_follows_a_link_out_of_the_folder(name: str, built: Path, tmp_path: Path) -> None:
    """Before: verify followed each of these out of the folder and said ok (rc 0), or printed the outside
    file's size and sha256 while claiming nothing behind it was read."""
    import hashlib

    folder, outside = _copy(built, tmp_path)
    path = _shard(folder) if name == "shard" else folder / name
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    _move_out(path, outside)
    before = b.outside_state(tmp_path, skip=folder)
    run = b.run_bounded("verify", folder)
    b.assert_refused(run, code=1, contains="outside")
    assert digest not in run.stdout + run.stderr, "the outside file was read (its sha256 is printed)"
    assert b.outside_state(tmp_path, skip=folder) == before


def test_a_manifest_linked_to_outside_json_is_not_quoted(built: Path, tmp_path: Path) -> None:
    folder, outside = _copy(built, tmp_path)
    _replace(folder / MANIFEST, "outside-json", outside)
    run = b.run_bounded("verify", folder)
    b.assert_refused(run, code=1)
    assert MARKER not in run.stdout + run.stderr


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
@pytest.mark.parametrize("name", [INDEX, MANIFEST, "config.json", "shard"])
def test_verify_refuses_fifos_and_devices_in_seconds(name: str, kind: str, built: Path, tmp_path: Path) -> None:
    """Before: verify hung on a FIFO, and an index or manifest linked to /dev/zero grew past 6 GB."""
    folder, outside = _copy(built, tmp_path)
    _replace(_shard(folder) if name == "shard" else folder / name, kind, outside)
    b.assert_refused(b.run_bounded("verify", folder), code=1)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "directory"])
def test_a_manifest_listed_file_replaced_by_a_special_file_is_a_finding(kind: str, built: Path,
                                                                        tmp_path: Path) -> None:
    """Before: a listed config.json replaced by a FIFO, /dev/zero or a folder was skipped and verify said ok."""
    folder, outside = _copy(built, tmp_path)
    _replace(folder / "config.json", kind, outside)
    line = b.assert_refused(b.run_bounded("verify", folder), code=1)
    assert "config.json" in line or "config.json" in b.run_bounded("verify", folder).stdout


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_single_file_that_is_a_fifo_or_dev_zero(kind: str, tmp_path: Path) -> None:
    """Before: verify hung on a FIFO single file; one linked to /dev/zero spun forever ignoring Ctrl-C."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    _replace_new = folder / "model.safetensors"
    if kind == "fifo":
        os.mkfifo(_replace_new)
    else:
        _replace_new.symlink_to("/dev/zero")
    for command in ("verify", "info"):
        b.assert_refused(b.run_bounded(command, folder), code=(1, 2))
        b.assert_refused(b.run_bounded(command, _replace_new), code=(1, 2))


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "outside-json"])
@pytest.mark.parametrize("command", ["info", "split", "verify"])
def test_config_json_as_a_special_file(command: str, kind: str, built: Path, tmp_path: Path) -> None:
    """Before: config.json as a FIFO or /dev/zero hung or exhausted memory in info, split, verify."""
    folder, outside = _copy(built, tmp_path)
    _replace(folder / "config.json", kind, outside)
    args = [tmp_path / "out", "-q"] if command == "split" else []
    run = b.run_bounded(command, folder, *args)
    b.assert_refused(run, code=(1, 2))
    assert MARKER not in run.stdout + run.stderr
    assert not (tmp_path / "out").exists()


# dev-zero in the slow run: its refusal is the same regular-file check as the FIFO's, and
# test_config_json_as_a_special_file[...-dev-zero] checks it for info, split and verify in the default run.
@pytest.mark.parametrize("kind", ["fifo", pytest.param("dev-zero", marks=pytest.mark.slow)])
def test_fit_and_plan_refuse_a_special_config(kind: str, tmp_path: Path) -> None:
    from conftest import tiny_unet
    from helpers_load import save_model

    folder = save_model(tiny_unet(), tmp_path / "unet", dtype="fp16")
    _replace(folder / "config.json", kind, tmp_path)
    b.assert_refused(b.run_bounded("fit", folder, "--gpu", "1GB"))
    b.assert_refused(b.run_bounded("plan", folder, "--model", "diffusers:UNet2DConditionModel", "--gpu", "1GB"))


def test_a_pipeline_component_linked_outside_is_refused(tmp_path: Path) -> None:
    """Before: a component folder that is a link to a folder outside was verified and reported ok."""
    from helpers_pipeline import build_tiny_sd_pipeline

    import shardkit

    pipe = build_tiny_sd_pipeline(tmp_path / "scratch")
    folder = tmp_path / "pipe"
    pipe.save_pretrained(str(folder))
    outside = tmp_path / "outside"
    (folder / "vae").rename(outside)
    (folder / "vae").symlink_to(outside)
    before = b.outside_state(tmp_path, skip=folder)
    for command in ("verify", "info"):
        b.assert_refused(b.run_bounded(command, folder), code=(1, 2), contains="vae")
    b.assert_refused(b.run_bounded("split", folder, tmp_path / "out", "-q"), contains="vae")
    assert not (tmp_path / "out").exists()
    assert b.outside_state(tmp_path, skip=folder) == before
    with pytest.raises(shardkit.errors.ShardkitError):
        shardkit.verify(folder)


_LOAD_PIPELINE = """
import sys, shardkit
try:
    shardkit.load_pipeline(sys.argv[1], read=sys.argv[2])
except shardkit.errors.ShardkitError as e:
    print(type(e).__name__, e)
"""


@pytest.mark.parametrize("kind", ["outside-json", "fifo"])
@pytest.mark.parametrize("read", ["auto", "mmap"])
def test_load_pipeline_reads_model_index_inside_the_folder(kind: str, read: str, tmp_path: Path) -> None:
    """Issue 41: loading/pipeline.py read model_index.json with plain open/json.load (and read="mmap" left it
    to diffusers): a link leading outside was followed, a FIFO hung. Now the folder boundary refuses both."""
    import subprocess
    import sys

    folder = tmp_path / "pipe"
    folder.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline",
                                                          "unet": ["diffusers", "UNet2DConditionModel"]}))
    if kind == "fifo":
        os.mkfifo(folder / "model_index.json")
    else:
        (folder / "model_index.json").symlink_to(outside / "model_index.json")
    before = b.outside_state(tmp_path, skip=folder)
    proc = subprocess.run([sys.executable, "-c", _LOAD_PIPELINE, str(folder), read], capture_output=True, text=True,
                          timeout=60, env=h.clean_env())
    assert proc.stdout.startswith("OutsideFolderError"), proc.stdout + proc.stderr[-2000:]
    assert ("outside" if kind == "outside-json" else "FIFO") in proc.stdout
    assert b.outside_state(tmp_path, skip=folder) == before


def test_a_symlinked_parent_is_refused_by_the_boundary_itself(tmp_path: Path) -> None:
    """open_inside walks parents with O_NOFOLLOW: ``sub -> /outside`` makes ``sub/x`` unreadable."""
    from shardkit.formats.links import OutsideFolderError, check_write_target, open_inside, read_inside

    folder = tmp_path / "ckpt"
    folder.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x.json").write_text("{}")
    (folder / "sub").symlink_to(outside)
    (folder / "real").mkdir()
    (folder / "real" / "x.json").write_text("{}")
    (folder / "link.json").symlink_to(outside / "x.json")
    (folder / "inside.json").symlink_to("real/x.json")
    for name in ("sub/x.json", "../outside/x.json", "/etc/passwd", "real/../real/x.json", "a\nb", "link.json"):
        with pytest.raises(OutsideFolderError):
            open_inside(str(folder), name, where="t")
    with pytest.raises(OutsideFolderError):
        check_write_target(str(folder), "sub/new.json", where="t")
    with pytest.raises(OutsideFolderError):
        check_write_target(str(folder), "real", where="t")
    assert read_inside(str(folder), "real/x.json", where="t") == b"{}"
    assert read_inside(str(folder), "inside.json", where="t") == b"{}"
    with pytest.raises(OutsideFolderError, match="limit"):
        read_inside(str(folder), "real/x.json", where="t", max_bytes=1)
