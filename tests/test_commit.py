"""Basic behaviour of the atomic output transaction (crash and full-disk cases live elsewhere)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import leftovers

from shardkit.atomic.commit import JOURNAL, OutputTransaction, atomic_output_file, publish_file, recover
from shardkit.errors import OutputExistsError, ShardkitError, ShardkitWriteError


def _write(tx: OutputTransaction, name: str, data: bytes) -> None:
    with open(tx.path_for(name), "xb") as f:
        f.write(data)


def test_fresh_output_appears_all_at_once(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with OutputTransaction(out) as tx:
        _write(tx, "a.safetensors", b"a")
        _write(tx, "unet/b.safetensors", b"b")
        tx.write_bytes("model.safetensors.index.json", b"{}")
        assert not out.exists(), "nothing is visible before commit"
        tx.commit(last="model.safetensors.index.json")
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [
        "a.safetensors", "model.safetensors.index.json", "unet", "unet/b.safetensors"]
    assert leftovers(tmp_path) == []


def test_empty_existing_folder_counts_as_fresh(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with OutputTransaction(out) as tx:
        _write(tx, "a.safetensors", b"a")
        tx.commit()
    assert (out / "a.safetensors").read_bytes() == b"a"
    assert leftovers(tmp_path) == []


def test_failure_before_commit_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(RuntimeError), OutputTransaction(out) as tx:
        _write(tx, "a.safetensors", b"a")
        raise RuntimeError("boom")
    assert not out.exists()
    assert os.listdir(tmp_path) == []


def test_existing_output_is_refused_without_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"old")
    with pytest.raises(OutputExistsError, match="overwrite=True"):
        OutputTransaction(out).__enter__()
    assert (out / "model.safetensors").read_bytes() == b"old"
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(OutputExistsError, match="is a file"):
        OutputTransaction(afile).__enter__()
    with pytest.raises(ShardkitWriteError, match="the folder the output goes into does not exist; create it first"):
        OutputTransaction(tmp_path / "no" / "such" / "out").__enter__()


def test_overwrite_replaces_checkpoint_files_and_keeps_others(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                 "model.safetensors.index.json", "config.json", "README.md"):
        (out / name).write_text("old " + name)
    stale = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    with OutputTransaction(out, overwrite=True, stale=stale) as tx:
        _write(tx, "model.safetensors", b"new")
        assert (out / "model.safetensors.index.json").exists(), "old checkpoint intact until commit"
        tx.commit()
    assert sorted(os.listdir(out)) == ["README.md", "config.json", "model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == b"new"
    assert (out / "config.json").read_text() == "old config.json"


def test_overwrite_failure_keeps_the_old_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"old")
    with pytest.raises(RuntimeError), OutputTransaction(out, overwrite=True, stale=["model.safetensors"]) as tx:
        _write(tx, "model.safetensors", b"new")
        raise RuntimeError("boom")
    assert os.listdir(out) == ["model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == b"old"


def test_a_second_writer_on_the_same_folder_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"old")
    with OutputTransaction(out, overwrite=True) as tx:
        with pytest.raises(OutputExistsError, match="another shardkit process"):
            OutputTransaction(out, overwrite=True).__enter__()
        tx.commit()


def test_recover_rolls_a_journal_forward_and_removes_temporaries(tmp_path: Path) -> None:
    (tmp_path / ".shardkit-tmp-1-abcd-model.safetensors").write_bytes(b"new")
    # The orphan's writer must be a pid that no process can have (pid 9 is a live kernel thread on
    # some machines, which made this test flaky): one past the kernel's pid_max.
    dead = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    (tmp_path / f".shardkit-tmp-{dead}-ffff-orphan.safetensors").write_bytes(b"junk")
    (tmp_path / "model.safetensors.index.json").write_text("old index")
    (tmp_path / "model-00001-of-00001.safetensors").write_bytes(b"old")
    (tmp_path / JOURNAL).write_text(json.dumps({
        "remove_first": ["model.safetensors.index.json"],
        "renames": [[".shardkit-tmp-1-abcd-model.safetensors", "model.safetensors"]],
        "delete": ["model-00001-of-00001.safetensors"],
    }))
    recover(str(tmp_path))
    assert os.listdir(tmp_path) == ["model.safetensors"]
    assert (tmp_path / "model.safetensors").read_bytes() == b"new"
    recover(str(tmp_path / "missing"))  # no-op


def test_path_for_refuses_escaping_names(tmp_path: Path) -> None:
    with OutputTransaction(tmp_path / "out") as tx:
        for bad in ("/abs.safetensors", "../up.safetensors", "a/../../b.safetensors"):
            with pytest.raises(ValueError):
                tx.path_for(bad)


def test_single_file_output(tmp_path: Path) -> None:
    target = tmp_path / "merged.safetensors"
    tmp = atomic_output_file(str(target))
    assert os.path.dirname(tmp) == str(tmp_path) and ".shardkit-tmp-" in tmp
    Path(tmp).write_bytes(b"data")
    publish_file(tmp, str(target))
    assert target.read_bytes() == b"data" and os.listdir(tmp_path) == ["merged.safetensors"]
    with pytest.raises(OutputExistsError):
        atomic_output_file(str(target))
    assert atomic_output_file(str(target), overwrite=True)
    with pytest.raises(OutputExistsError, match="folder"):
        atomic_output_file(str(tmp_path), overwrite=True)
    with pytest.raises(ShardkitError, match="does not exist"):
        atomic_output_file(str(tmp_path / "nope" / "x.safetensors"))


def test_side_files_are_replaced_by_rename_and_never_missing_during_an_in_place_commit(tmp_path: Path,
                                                                                         monkeypatch) -> None:
    """Only index files are removed first; model_index.json and configs are swapped atomically."""
    from shardkit import _faults

    out = tmp_path / "pipe"
    out.mkdir()
    for name, data in {"model_index.json": b"old", "config.json": b"old", "model.safetensors.index.json": b"old",
                       "model-00001-of-00001.safetensors": b"old"}.items():
        (out / name).write_bytes(data)
    seen: list[tuple[str, bool, bool]] = []

    def watch(label: str, nbytes: int = 0) -> None:
        seen.append((label, (out / "model_index.json").exists(), (out / "config.json").exists()))

    monkeypatch.setattr(_faults, "point", watch)
    with OutputTransaction(out, overwrite=True, stale=["model-00001-of-00001.safetensors"]) as tx:
        for name in ("model_index.json", "config.json", "model.safetensors.index.json", "model.safetensors"):
            tx.write_bytes(name, b"new")
        tx.commit(last="model.safetensors.index.json")
    assert [label for label, *_ in seen if label.startswith("commit:")], seen
    assert all(has_index and has_config for _, has_index, has_config in seen), seen
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "model.safetensors.index.json",
                                       "model_index.json"]
    assert (out / "model_index.json").read_bytes() == b"new"


def test_recover_command_says_what_it_rolled_forward_and_removed(run_cli, tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    dead = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    (folder / f".shardkit-tmp-{dead}-ffff-model-00001-of-00002.safetensors").write_bytes(b"x" * 600)
    (folder / f".shardkit-tmp-{dead}-abcd-model.safetensors").write_bytes(b"new")
    (folder / JOURNAL).write_text(json.dumps({
        "remove_first": [], "renames": [[f".shardkit-tmp-{dead}-abcd-model.safetensors", "model.safetensors"]],
        "delete": [],
    }))
    staging = tmp_path / f".ckpt2.shardkit-tmp-{dead}-beef"
    staging.mkdir()
    (staging / "model.safetensors").write_bytes(b"y" * 400)
    (tmp_path / "ckpt2").mkdir()

    result = run_cli("recover", folder, tmp_path / "ckpt2", "--json")
    assert result.exit_code == 0, result.stderr
    first, second = json.loads(result.stdout)
    assert first["rolled_forward"] == ["model.safetensors"]
    assert [os.path.basename(p) for p in first["removed"]] == [f".shardkit-tmp-{dead}-ffff-model-00001-of-00002.safetensors"]
    assert first["removed_bytes"] == 600
    assert second["removed"] == [str(staging)] and second["removed_bytes"] == 400
    assert sorted(os.listdir(folder)) == ["model.safetensors"] and not staging.exists()

    again = run_cli("recover", folder)
    assert again.exit_code == 0 and "consistent (nothing to do)" in again.stdout


def test_recover_command_prints_removed_bytes(run_cli, tmp_path: Path) -> None:
    dead = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    (tmp_path / f".shardkit-tmp-{dead}-ffff-orphan.safetensors").write_bytes(b"j" * 2000)
    result = run_cli("recover", tmp_path)
    assert result.exit_code == 0, result.stderr
    assert "removed 1 temporary file(s) of dead writers, 2.00 KB" in result.stdout
    assert result.stdout.strip().endswith("consistent")


def test_a_missing_folder_above_the_output_is_one_error_for_a_folder_and_a_file(tmp_path: Path) -> None:
    """The one check (output_folder): the same type and words whether the output is a folder or a file; nothing made."""
    errors = []
    for output in (tmp_path / "gone" / "out", tmp_path / "gone" / "m.safetensors"):
        with pytest.raises(ShardkitWriteError) as e:
            if output.suffix:
                atomic_output_file(str(output))
            else:
                OutputTransaction(output).__enter__()
        errors.append(str(e.value))
    assert errors == [f"{tmp_path / 'gone'}: the folder the output goes into does not exist; create it first"] * 2
    assert list(tmp_path.iterdir()) == []
