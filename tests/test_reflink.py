"""Copy-on-write reshards on real XFS (reflink) and btrfs filesystems, mounted from loop images.

split, convert and merge must clone their tensor bytes: bit-equal output, the shards' extents
marked shared (FIEMAP, cross-checked with ``filefrag -v``), and the filesystem's free space
shrinking by under 1% of the checkpoint. Needs root and mkfs.xfs / mkfs.btrfs (installed with
apt-get when missing); where a loop mount is impossible the tests skip with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_bit_equal, invoke_cli, load_folder

import shardkit
from shardkit.atomic.extents import shared_bytes

IMAGE_BYTES = 512 * 2**20  # XFS needs 300 MB at least
MKFS = {"xfs": ["mkfs.xfs", "-q", "-f", "-m", "reflink=1"], "btrfs": ["mkfs.btrfs", "-q", "-f"]}
PACKAGES = {"xfs": "xfsprogs", "btrfs": "btrfs-progs"}
TENSOR_ELEMS = 2**21  # 8 MiB of F32 per large tensor


def _ensure_mkfs(fs: str) -> str | None:
    """Install the mkfs tool when missing; the reason it cannot be used, or None."""
    if shutil.which(MKFS[fs][0]):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return f"{MKFS[fs][0]} is missing and cannot be installed here (needs root and apt-get)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", PACKAGES[fs]]
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
        subprocess.run(install, env=env, capture_output=True)
    return None if shutil.which(MKFS[fs][0]) else f"apt-get could not install {PACKAGES[fs]}"


@pytest.fixture(scope="module", params=["xfs", "btrfs"])
def cow_fs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A freshly made filesystem of the given kind, loop-mounted under tmp; unmounted afterwards."""
    fs = request.param
    if os.geteuid() != 0:
        pytest.skip(f"{fs}: mounting a loop image needs root")
    reason = _ensure_mkfs(fs)
    if reason:
        pytest.skip(reason)
    base = tmp_path_factory.mktemp(f"cow-{fs}")
    image, mount = base / f"{fs}.img", base / "mnt"
    with open(image, "wb") as f:
        f.truncate(IMAGE_BYTES)
    mount.mkdir()
    made = subprocess.run([*MKFS[fs], str(image)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"{MKFS[fs][0]} failed: {made.stderr.strip()}")
    mounted = subprocess.run(["mount", "-o", "loop", str(image), str(mount)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot loop-mount a {fs} image here: {mounted.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)
        image.unlink(missing_ok=True)


def _state_dict() -> dict[str, Any]:
    """~34 MB: large weights and small odd-sized biases, so runs start anywhere inside a block."""
    import torch

    g = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {}
    for i in range(4):
        out[f"block{i}.weight"] = torch.randn(TENSOR_ELEMS, generator=g)
        out[f"block{i}.bias"] = torch.randn(37 + i, generator=g)
    out["flag"] = torch.ones(3, dtype=torch.bool)
    return out


def _free_bytes(path: Path) -> int:
    os.sync()
    st = os.statvfs(path)
    return st.f_bfree * st.f_frsize


def _assert_cloned(files: list[Path], total_bytes: int, free_before: int, root: Path) -> None:
    shared = sum(shared_bytes(f) or 0 for f in files)
    assert shared >= 0.99 * total_bytes, f"only {shared} of {total_bytes} bytes share extents"
    grown = free_before - _free_bytes(root)
    assert grown < 0.01 * total_bytes, f"disk usage grew by {grown} bytes for a {total_bytes}-byte checkpoint"
    frag = subprocess.run(["filefrag", "-v", str(files[0])], capture_output=True, text=True)
    if frag.returncode == 0:  # the independent cross-check of the FIEMAP reading
        assert "shared" in frag.stdout


def test_split_clones_every_shard(cow_fs: Path) -> None:
    from safetensors.torch import save_file

    tensors = _state_dict()
    src = cow_fs / "split-src" / "model.safetensors"
    src.parent.mkdir()
    save_file(tensors, str(src), metadata={"format": "pt"})
    total = sum(t.nbytes for t in tensors.values())
    before = _free_bytes(cow_fs)
    proc = invoke_cli("split", src, cow_fs / "split-out", "--max-shard-size", "17MB")
    assert proc.exit_code == 0, proc.stderr
    assert "cloned " in proc.stdout and "copied " in proc.stdout
    shards = sorted((cow_fs / "split-out").glob("*.safetensors"))
    assert len(shards) >= 2
    assert_bit_equal(load_folder(cow_fs / "split-out"), tensors)
    _assert_cloned(shards, total, before, cow_fs)
    info = json.loads(invoke_cli("info", cow_fs / "split-out", "--json").stdout)
    assert info["shared_bytes"] >= 0.99 * total


def test_split_api_reports_cloned_and_merge_clones_back(cow_fs: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = _state_dict()
    src = cow_fs / "merge-src.safetensors"
    save_file(tensors, str(src), metadata={"format": "pt"})
    total = sum(t.nbytes for t in tensors.values())
    result = shardkit.split(src, cow_fs / "merge-shards", max_shard_size="10MB")
    assert result.cloned_bytes >= 0.99 * total and result.copied_bytes == total - result.cloned_bytes
    assert result.to_dict()["cloned_bytes"] == result.cloned_bytes
    before = _free_bytes(cow_fs)
    merged = shardkit.merge(cow_fs / "merge-shards", cow_fs / "merged.safetensors")
    assert_bit_equal(load_file(str(cow_fs / "merged.safetensors")), tensors)
    assert merged.cloned_bytes >= 0.99 * total
    _assert_cloned([cow_fs / "merged.safetensors"], total, before, cow_fs)


def test_convert_of_a_zip_pickle_clones_one_tensor_per_shard(cow_fs: Path) -> None:
    """A zip pickle stores each tensor as its own record: a shard per large tensor clones it whole."""
    import torch

    tensors = _state_dict()
    src = cow_fs / "pytorch_model.bin"
    torch.save(tensors, src)
    total = sum(t.nbytes for t in tensors.values())
    before = _free_bytes(cow_fs)
    result = shardkit.convert(src, cow_fs / "convert-out", max_shard_size=4 * TENSOR_ELEMS)
    assert_bit_equal(load_folder(cow_fs / "convert-out"), tensors)
    assert result.cloned_bytes >= 0.99 * total
    _assert_cloned(sorted((cow_fs / "convert-out").glob("*.safetensors")), total, before, cow_fs)


def test_torchrun_convert_reports_the_bytes_every_rank_cloned(cow_fs: Path) -> None:
    """The collective writer shares the single-process publish path: cloned bytes summed over ranks."""
    import sys

    from safetensors.torch import save_file

    tensors = _state_dict()
    src = cow_fs / "collective-src.safetensors"
    save_file(tensors, str(src), metadata={"format": "pt"})
    total = sum(t.nbytes for t in tensors.values())
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "shardkit", "convert", str(src), str(cow_fs / "collective-out"),
                          "--max-shard-size", "10MB", "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    reported = json.loads(run.stdout)
    assert reported["cloned_bytes"] >= 0.99 * total and reported["copied_bytes"] == total - reported["cloned_bytes"]
    shards = sorted((cow_fs / "collective-out").glob("*.safetensors"))
    assert reported["cloned_bytes"] <= sum(shared_bytes(f) or 0 for f in shards)
    assert_bit_equal(load_folder(cow_fs / "collective-out"), tensors)


def _cached_pages(path: Path) -> int:
    """Pages of ``path`` in the page cache (mincore over every page)."""
    from shardkit.reading.residency import cached_fraction

    pages = (path.stat().st_size + 4095) // 4096
    fraction = cached_fraction(str(path), sample_pages=pages)
    assert fraction is not None
    return round(fraction * pages)


def test_manifest_of_a_foreign_split_reads_no_byte_of_the_clones(cow_fs: Path) -> None:
    """Issue 34: the crc32 pass for the manifest hashes cloned tensors from the source's descriptor
    (whose pages the writer of the source left cached), never from the fresh clones, whose pages
    are not cached: reading them read every byte from the device (10x slower on a loop-mounted
    XFS). The clones' page cache stays empty but for headers and unaligned edges, and the manifest
    still matches the files byte for byte."""
    from safetensors.torch import save_file

    tensors = _state_dict()
    src = cow_fs / "foreign-src.safetensors"
    save_file(tensors, str(src), metadata={"format": "pt"})  # a foreign file: no manifest to carry crc32s from
    result = shardkit.split(src, cow_fs / "foreign-out", max_shard_size="17MB")
    shards = sorted((cow_fs / "foreign-out").glob("*.safetensors"))
    assert len(shards) >= 2 and result.cloned_bytes >= 0.99 * sum(t.nbytes for t in tensors.values())
    cached = {s.name: _cached_pages(s) for s in shards}
    assert all(n <= 8 for n in cached.values()), f"the crc32 pass read the clones back: {cached} pages cached"
    assert shardkit.verify(cow_fs / "foreign-out").ok  # the recorded crc32s are those of the files' bytes
    assert _cached_pages(shards[0]) > 1000  # verify read them: the count above would have shown it
