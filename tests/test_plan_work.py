"""A plan's work folder (shardkit/distributed/plan_work.py): its small records are written with every write's
count checked."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from shardkit.distributed import plan_work
from shardkit.errors import ShardkitError, ShardkitWriteError


def writes_nothing_under(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``os.write`` to a file under ``folder`` writes nothing (as a broken filesystem might); after 100 such calls
    it raises, so that a loop that does not check the count fails instead of spinning forever."""
    real: Callable[[int, bytes], int] = os.write
    calls = [0]

    def write(fd: int, data: bytes) -> int:
        if not os.readlink(f"/proc/self/fd/{fd}").startswith(str(folder)):
            return real(fd, data)
        calls[0] += 1
        if calls[0] > 100:
            raise RuntimeError("a write loop kept calling os.write after it wrote nothing")
        return 0

    monkeypatch.setattr(os, "write", write)


def test_a_record_write_that_writes_nothing_is_an_error_naming_the_record(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "done").mkdir()
    plan_work.write_small(str(tmp_path), "done/00000.json", b"{}")
    assert (tmp_path / "done" / "00000.json").read_bytes() == b"{}"
    writes_nothing_under(tmp_path, monkeypatch)
    with pytest.raises(ShardkitWriteError, match="00001.json") as e:
        plan_work.write_small(str(tmp_path), "done/00001.json", b"{}")
    assert isinstance(e.value, ShardkitError)
    assert sorted(os.listdir(tmp_path / "done")) == ["00000.json"]  # no record, no temporary left
