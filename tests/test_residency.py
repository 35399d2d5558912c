"""Page-cache residency (`mincore` in sampled runs): what `auto` reads warm files with."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from shardkit.reading import residency

PAGE = mmap.PAGESIZE


def _file(tmp_path: Path, pages: int) -> Path:
    path = tmp_path / "blob.bin"
    path.write_bytes(os.urandom(pages * PAGE - 100))  # a partial last page
    return path


def _cache_only(path: Path, first_page: int, last_page: int) -> None:
    """Evict ``path`` then bring pages ``first_page:last_page`` back into the page cache."""
    if residency.evict(str(path)) is None:
        pytest.skip("mincore is not available here")
    if residency.cached_fraction(str(path), sample_pages=10**9) != 0.0:
        pytest.skip("this filesystem keeps evicted pages cached (tmpfs?)")
    fd = os.open(path, os.O_RDONLY)
    try:
        os.pread(fd, (last_page - first_page) * PAGE, first_page * PAGE)
    finally:
        os.close(fd)


def test_a_warm_file_is_all_resident_and_an_evicted_one_none(tmp_path: Path) -> None:
    path = _file(tmp_path, 20_000)
    assert residency.cached_fraction(str(path)) == 1.0  # written just now: in the page cache
    _cache_only(path, 0, 0)
    assert residency.cached_fraction(str(path)) == 0.0


@pytest.mark.parametrize("sample_pages", [4096, 64, 10**9])
def test_the_sampled_share_follows_what_is_cached(tmp_path: Path, sample_pages: int) -> None:
    pages = 20_000
    path = _file(tmp_path, pages)
    _cache_only(path, 0, pages // 2)  # the first half (read-ahead may add a little past it)
    fraction = residency.cached_fraction(str(path), sample_pages=sample_pages)
    assert fraction is not None and 0.4 <= fraction <= 0.65, fraction
    _cache_only(path, pages - pages // 4, pages)  # the last quarter
    fraction = residency.cached_fraction(str(path), sample_pages=sample_pages)
    assert fraction is not None and 0.15 <= fraction <= 0.35, fraction
