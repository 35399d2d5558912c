"""WriteOptions: one validated options object behind split, convert, save_sharded and pipeline splits."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import helpers_reliability as h
import pytest
from helpers_pipeline import write_pipeline_folder

import shardkit
from shardkit.errors import InvalidInputError, InvalidSizeError, ShardkitWarning
from shardkit.sharding import convert, job, pipeline, split
from shardkit.sharding.options import WriteOptions


def test_sizes_are_parsed_once_at_the_edge_into_bytes() -> None:
    assert WriteOptions.parse(max_shard_size="2GiB").max_shard_bytes == 2 * 2**30
    assert WriteOptions.parse(max_shard_size=1234).max_shard_bytes == 1234
    assert WriteOptions().max_shard_bytes == 5 * 10**9  # the documented "5GB" default
    with pytest.raises(InvalidSizeError):
        WriteOptions(max_shard_bytes="5GB")  # type: ignore[arg-type]  # a size string is not a byte count
    for bad in (0, -1, True):
        with pytest.raises(InvalidSizeError):
            WriteOptions(max_shard_bytes=bad)


def test_casts_are_validated_when_the_options_are_made() -> None:
    assert WriteOptions(dtype="bf16").cast_to == "BF16"
    assert WriteOptions(dtype="torch.float16").cast_to == "F16"
    assert WriteOptions().cast_to is None
    with pytest.raises(InvalidInputError, match="allow_lossy=True"):
        WriteOptions(dtype="fp8_e4m3")
    assert WriteOptions(dtype="fp8_e4m3", allow_lossy=True).cast_to == "F8_E4M3"


def test_options_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        WriteOptions().overwrite = True  # type: ignore[misc]


@pytest.mark.parametrize("fn", [shardkit.split, shardkit.convert, shardkit.save_sharded, shardkit.merge,
                                split.split_with, convert.convert_with, pipeline.split_pipeline])
def test_public_functions_take_options_by_keyword_only(fn) -> None:
    params = list(inspect.signature(fn).parameters.values())
    assert [p.kind for p in params[:2]] == [inspect.Parameter.POSITIONAL_OR_KEYWORD] * 2
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[2:] if p.name != "shorthands")
    assert all(p.kind is inspect.Parameter.VAR_KEYWORD for p in params if p.name == "shorthands")


def test_split_convert_and_save_sharded_run_the_same_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One job: each public function ends in job.split_source with the options it was given."""
    import torch

    seen: list[WriteOptions] = []
    real = job.split_source

    def spy(src, output, *, options, **kw):  # type: ignore[no-untyped-def]
        seen.append(options)
        return real(src, output, options=options, **kw)

    monkeypatch.setattr(split, "split_source", spy)
    monkeypatch.setattr(convert, "split_source", spy)
    src = h.write_checkpoint(tmp_path / "src", h.make_tensors(6, seed=5, total_bytes=30_000))
    shardkit.split(src, tmp_path / "a", max_shard_size="10KB", variant="v")
    shardkit.convert(src, tmp_path / "b", max_shard_size="10KB", variant="v", rename={"layers.": "blocks."})
    shardkit.save_sharded({"x": torch.ones(4)}, tmp_path / "c", max_shard_size="10KB", variant="v")
    assert [(o.max_shard_bytes, o.variant) for o in seen] == [(10_000, "v")] * 3


def test_pipeline_dry_run_warns_like_any_other_dry_run(tmp_path: Path) -> None:
    pipe = write_pipeline_folder(tmp_path / "pipe", {"unet": h.make_tensors(4, seed=6, total_bytes=20_000)})
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    with pytest.warns(ShardkitWarning, match="needs overwrite=True"):
        result = shardkit.split(pipe, tmp_path / "taken", dry_run=True)
    assert result.dry_run and sorted(p.name for p in (tmp_path / "taken").iterdir()) == ["x"]
