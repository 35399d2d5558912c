"""The latency mount (tests/latency_mount.py) for tests; skips with the reason where FUSE is missing."""

from __future__ import annotations

import pytest
from latency_mount import LatencyMount, fuse_unavailable

__all__ = ["LatencyMount", "mount_or_skip"]


def mount_or_skip(tmp_path, **options) -> LatencyMount:
    """A started latency mount of ``tmp_path/src`` at ``tmp_path/mnt`` (stop it), or a skip saying why not."""
    reason = fuse_unavailable()
    if reason:
        pytest.skip(reason)
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir(exist_ok=True)
    try:
        return LatencyMount(src, mnt, **options).start()
    except RuntimeError as e:  # e.g. fusermount refused in an unprivileged container
        pytest.skip(str(e))
