"""The header-only mirror's local files (shardkit/stores/mirror.py): written with every write's count checked."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shardkit.errors import StoreError
from shardkit.stores import mirror


def test_a_mirror_write_that_writes_nothing_is_a_store_error_naming_the_file(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Short writes are continued (the bytes exact, the sparse size kept); one that writes nothing is the stores'
    error naming the file (shown as the location under ``renamed_errors``) and the fix, not a bare OSError."""
    real = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real(fd, bytes(data)[:7]))
    mirror._write_new(str(tmp_path / "a" / "m.safetensors"), b"0123456789" * 3, size_bytes=100)
    mirror._write_new(str(tmp_path / "a" / "m.safetensors"), b"more", size_bytes=104, append=True)
    assert (tmp_path / "a" / "m.safetensors").read_bytes() == b"0123456789" * 3 + b"\0" * 70 + b"more"
    monkeypatch.setattr(os, "write", lambda fd, data: 0)
    with pytest.raises(StoreError, match=r"^s3://b/ckpt/x\.json: writing its local copy failed \(took 0 of 2 "
                                         r"bytes\); free space in .*, or point TMPDIR elsewhere$"):
        with mirror.renamed_errors(str(tmp_path), "s3://b/ckpt"):
            mirror._write_new(str(tmp_path / "x.json"), b"{}", size_bytes=2)
