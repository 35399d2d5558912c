"""Side files (model_index.json, configs, tokenizer, README) are fsynced before they are published.

A copied file that is renamed into place while still only in the page cache can come back empty
after a power loss, beside complete shards; the commit fsyncs folders, not files, so the writer
must fsync each copy itself. ``os.fsync`` is recorded (by the path its descriptor names) and
every copied file must have been synced under its temporary, unpublished name.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import helpers_reliability as h
import pytest
from helpers_pipeline import write_pipeline_folder

import shardkit

_TMP_FILE = re.compile(r"^\.shardkit-tmp-\d+-[0-9a-f]+-")


@pytest.fixture()
def synced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every path fsynced from now on (files and folders), in call order, from any thread."""
    paths: list[str] = []
    real = os.fsync

    def recording(fd: int) -> None:
        paths.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    return paths


def _synced_before_publish(paths: list[str], out: Path) -> set[str]:
    """Output-relative names of the files fsynced while still staged or under a temporary name."""
    names = set()
    staging = f".{out.name}.shardkit-tmp-"
    for path in map(Path, paths):
        parts = path.relative_to(out.parent).parts if path.is_relative_to(out.parent) else ()
        if len(parts) > 1 and parts[0].startswith(staging):
            names.add(str(Path(*parts[1:])))  # a fresh output: files inside the staging folder
        elif path.is_relative_to(out) and _TMP_FILE.match(path.name):
            names.add(str(path.relative_to(out).parent / _TMP_FILE.sub("", path.name)).removeprefix("./"))
    return names


def _pipeline(folder: Path) -> Path:
    return write_pipeline_folder(folder, {"unet": h.make_tensors(12, seed=1, total_bytes=200_000),
                                          "text_encoder": h.make_tensors(8, seed=2, total_bytes=100_000)})


def test_pipeline_split_fsyncs_every_copied_file_before_publishing(tmp_path: Path, synced: list[str]) -> None:
    out = tmp_path / "out"
    result = shardkit.split(_pipeline(tmp_path / "pipe"), out, max_shard_size="60KB")
    assert {"model_index.json", "unet/config.json", "tokenizer/vocab.json", "README.md"} <= set(result.copied)
    missing = set(result.copied) - _synced_before_publish(synced, out)
    assert not missing, f"copied but never fsynced before the publish: {sorted(missing)}"
    assert set(result.plan.filenames()) <= _synced_before_publish(synced, out)  # shards too


def test_pipeline_split_over_an_old_output_fsyncs_every_copied_file(tmp_path: Path, synced: list[str]) -> None:
    """The replace path (temporary names inside the output, then a journal) syncs copies too."""
    out = _pipeline(tmp_path / "old")
    (out / "README.md").write_text("an older pipeline\n")
    result = shardkit.split(_pipeline(tmp_path / "pipe"), out, max_shard_size="60KB", overwrite=True)
    missing = set(result.copied) - _synced_before_publish(synced, out)
    assert not missing, f"copied but never fsynced before the publish: {sorted(missing)}"
    assert (out / "README.md").read_text() == "tiny test pipeline\n"


def test_folder_split_fsyncs_its_side_files(tmp_path: Path, synced: list[str]) -> None:
    src = h.write_checkpoint(tmp_path / "src", h.make_tensors(8, seed=3, total_bytes=100_000), shard_bytes=40_000)
    (src / "config.json").write_text('{"model_type": "tiny"}')
    (src / "README.md").write_text("a model card\n")
    out = tmp_path / "out"
    shardkit.split(src, out, max_shard_size="30KB")
    assert {"config.json", "README.md"} <= _synced_before_publish(synced, out)
    assert (out / "config.json").read_text() == '{"model_type": "tiny"}'
