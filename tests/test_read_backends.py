"""Read backends (mmap, pread, direct, auto), the ring pipeline and ``read=`` in open/load_model."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

import pytest
import safetensors.torch
import torch
from conftest import make_state_dict, tensor_bytes
from safetensors import safe_open

import shardkit
from shardkit.errors import HeaderError, InvalidInputError
from shardkit.loading.bulk import read_batch
from shardkit.loading.device_reads import Want
from shardkit.reading import readers
from shardkit.reading.residency import choose_backend, evict, remote_filesystem

BACKENDS = ["mmap", "pread", "direct"]
ODD_SHAPES = [(), (0,), (7,), (5, 3)]  # scalars, empty tensors, odd byte counts: later offsets go odd


def _checkpoint(tmp_path, name="w.safetensors"):
    tensors = {"a_odd": torch.arange(3, dtype=torch.uint8), **make_state_dict(shapes=ODD_SHAPES)}
    path = tmp_path / name
    safetensors.torch.save_file(tensors, path)
    return path, tensors


@pytest.mark.parametrize("read", BACKENDS)
def test_each_backend_is_byte_exact_against_safe_open(tmp_path, read, caplog) -> None:
    path, tensors = _checkpoint(tmp_path)
    caplog.set_level(logging.DEBUG, logger="shardkit")
    with shardkit.open(path, read=read) as ckpt, safe_open(path, framework="pt") as ref:
        odd = [n for n in ckpt if ckpt.entry(n).offset % 2]
        assert odd, "the fixture must place tensors at odd offsets"
        for name in tensors:
            got, want = ckpt[name], ref.get_tensor(name)
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert tensor_bytes(got) == tensor_bytes(want), name
        state = ckpt.to_state_dict()
        assert all(tensor_bytes(state[n]) == tensor_bytes(tensors[n]) for n in tensors)
        (report,) = ckpt.read_report()
    assert report["path"] == str(path)
    if read == "direct" and report["backend"] == "pread":  # a filesystem without O_DIRECT: said once
        assert any("O_DIRECT is not supported" in r.getMessage() for r in caplog.records)
    else:
        assert report["backend"] == read
    assert any(f"read backend {report['backend']}" in r.getMessage() for r in caplog.records)


def test_direct_reader_reads_across_bounce_buffers_and_unaligned_ends(tmp_path) -> None:
    path = tmp_path / "blob.bin"
    data = os.urandom(3 * 8192 + 123)
    path.write_bytes(data)
    try:
        reader = readers.DirectReader(str(path), bounce_bytes=8192)
    except OSError as e:
        pytest.skip(f"O_DIRECT unsupported on {tmp_path}: {e}")
    with reader:
        out = torch.empty(len(data) - 1001, dtype=torch.uint8)
        reader.read_all([readers.job_for(out, offset=1001, nbytes=out.numel(), where="blob")])
    assert out.numpy().tobytes() == data[1001:]


@pytest.mark.parametrize("read", BACKENDS)
def test_file_shorter_than_its_header_says_is_a_one_line_error_naming_it(tmp_path, read) -> None:
    path, _ = _checkpoint(tmp_path)
    os.truncate(path, path.stat().st_size - 5)
    with pytest.raises(HeaderError) as err:
        with shardkit.open(path, read=read) as ckpt:
            ckpt["layers.F32.3"]
    assert str(path) in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("read", BACKENDS)
def test_file_changed_on_disk_while_open_is_refused_not_a_crash(tmp_path, read) -> None:
    path, tensors = _checkpoint(tmp_path)
    with shardkit.open(path, read=read) as ckpt:
        assert tensor_bytes(ckpt["layers.F32.3"]) == tensor_bytes(tensors["layers.F32.3"])
        os.truncate(path, 100)  # a mapped view of the lost pages would die of SIGBUS
        with pytest.raises(InvalidInputError, match="changed on disk while open") as err:
            ckpt["layers.F64.3"]
        assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_pread_past_the_end_names_the_file_and_short_reads_are_retried(tmp_path, monkeypatch) -> None:
    path = tmp_path / "blob.bin"
    data = os.urandom(10_000)
    path.write_bytes(data)
    real = os.preadv
    monkeypatch.setattr(readers.os, "preadv", lambda fd, bufs, off: real(fd, [bufs[0][:999]], off))
    out = torch.empty(10_000, dtype=torch.uint8)
    with readers.Reader(str(path)) as reader:
        reader.read_all([readers.job_for(out, offset=0, nbytes=10_000, where=f"{path}: tensor 'x'")])
        assert out.numpy().tobytes() == data
        with pytest.raises(HeaderError, match="file ended at byte 10000") as err:
            reader.read_one(readers.ReadJob(out.data_ptr(), 5_000, 6_000, f"{path}: tensor 'x'"))
    assert str(path) in str(err.value)


def test_unknown_read_backend_is_refused(tmp_path) -> None:
    path, _ = _checkpoint(tmp_path)
    with pytest.raises(InvalidInputError, match="read='fast' is not a read backend"):
        shardkit.open(path, read="fast")


# ----------------------------------------------------------------------------- auto


def _evict(path) -> float | None:
    return evict(str(path))


def test_auto_reads_an_evicted_file_with_pread_and_a_warm_one_with_mmap(tmp_path) -> None:
    if remote_filesystem(str(tmp_path)):
        pytest.skip(f"{tmp_path} is on {remote_filesystem(str(tmp_path))}: auto always reads it with pread")
    path = tmp_path / "w.safetensors"
    safetensors.torch.save_file({"w": torch.randn(256, 1024)}, path)  # 1 MiB: 256 pages
    if (_evict(path) or 0.0) > 0.5:
        pytest.skip(f"the page cache of {tmp_path} cannot be evicted with posix_fadvise (tmpfs?)")
    with shardkit.open(path) as ckpt:
        ckpt["w"]
        (report,) = ckpt.read_report()
    assert report["backend"] == "pread" and "cold" in report["reason"], report
    path.read_bytes()  # warm: every page cached
    assert choose_backend(str(path), "auto").backend == "mmap"
    with shardkit.open(path) as ckpt:
        ckpt["w"]
        assert ckpt.read_report()[0]["backend"] == "mmap"


@pytest.fixture
def bindfs_mount(tmp_path):
    """A bindfs (FUSE passthrough) mount of ``tmp_path/src``; installs bindfs when missing (root)."""
    if shutil.which("bindfs") is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "install", "-y", "-q", "bindfs"], env=env, capture_output=True)
    if shutil.which("bindfs") is None:
        pytest.skip("bindfs is not installed and cannot be (needs root and apt-get)")
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse: FUSE is unavailable in this container")
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    done = subprocess.run(["bindfs", "--no-allow-other", str(src), str(mnt)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"bindfs mount failed: {done.stderr.strip()}")
    try:
        yield src, mnt
    finally:
        subprocess.run(["fusermount", "-u", str(mnt)], capture_output=True)
        if os.path.ismount(mnt):
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_auto_reads_a_fuse_mounted_file_by_what_its_requests_cost(bindfs_mount) -> None:
    """A passthrough FUSE mount (bindfs) is judged by a timed request, not by its kind: where it answers
    like a local disk, mapped with parallel read-ahead (safetensors' CPU, more requests in flight); else
    O_DIRECT with many requests in flight."""
    src, mnt = bindfs_mount
    tensors = make_state_dict(shapes=ODD_SHAPES)
    safetensors.torch.save_file(tensors, src / "w.safetensors")
    (mnt / "w.safetensors").read_bytes()  # bindfs drops a file's cache at each open: cold again
    assert remote_filesystem(str(mnt)) == "fuse"
    with shardkit.open(mnt / "w.safetensors") as ckpt:
        assert all(tensor_bytes(ckpt[n]) == tensor_bytes(t) for n, t in tensors.items())
        (report,) = ckpt.read_report()
        reader = ckpt.reader_of("layers.F32.3")
    assert "fuse filesystem" in report["reason"] and "ms per request" in report["reason"], report
    if "like a local disk" in report["reason"]:  # the usual verdict for bindfs over a local disk
        assert (report["backend"], reader) == ("mmap", None) and "read ahead" in report["reason"], report
    else:  # a machine too busy to answer within a millisecond: read as a network mount
        assert reader is not None and report["backend"] in ("direct", "pread"), report
        assert reader.chunk_bytes == readers.REMOTE_CHUNK_BYTES, report


def test_auto_reads_a_mount_with_latency_with_many_large_requests_in_flight(tmp_path) -> None:
    from helpers_latency import mount_or_skip

    mount = mount_or_skip(tmp_path, latency_ms=10)
    try:
        tensors = make_state_dict(shapes=ODD_SHAPES)
        safetensors.torch.save_file(tensors, tmp_path / "src" / "w.safetensors")
        with shardkit.open(tmp_path / "mnt" / "w.safetensors") as ckpt:
            assert all(tensor_bytes(ckpt[n]) == tensor_bytes(t) for n, t in tensors.items())
            (report,) = ckpt.read_report()
            chunk_bytes = ckpt.reader_of("layers.F32.3").chunk_bytes
    finally:
        mount.stop()
    assert report["backend"] in ("direct", "pread") and chunk_bytes == readers.REMOTE_CHUNK_BYTES, report
    assert "fuse filesystem," in report["reason"] and "like a local disk" not in report["reason"], report


@pytest.mark.parametrize("remote, latency_s, want", [
    (None, None, ("pread", None, "local")),                 # a local disk is never probed
    ("fuse", 0.00005, ("mmap", None, "passthrough")),       # bindfs over a local disk: mapped, read ahead
    ("fuse", 0.0021, ("direct", "fuse", "round-trip")),     # a round trip per request: many in flight
    ("nfs", 0.0009, ("mmap", None, "passthrough")),
    ("nfs", None, ("direct", "nfs", "round-trip")),         # O_DIRECT refused, nothing timed: by kind, as before
])
def test_auto_picks_the_cold_backend_from_the_timed_request(tmp_path, monkeypatch, remote, latency_s, want) -> None:
    from shardkit.reading import residency

    residency.forget_mount_latencies()
    paths = [tmp_path / f"w{i}.safetensors" for i in range(3)]
    for path in paths:
        safetensors.torch.save_file({"w": torch.ones(8)}, path)
    probed = []
    monkeypatch.setattr(residency, "remote_filesystem", lambda p: remote)
    monkeypatch.setattr(residency, "cached_fraction", lambda p, **kw: 0.0)
    monkeypatch.setattr(residency, "request_latency_s", lambda p, **kw: probed.append(p) or latency_s)
    choices = [choose_backend(str(path), "auto") for path in paths]
    assert {(c.backend, c.remote, c.tuning) for c in choices} == {want}
    assert probed == ([str(paths[0])] if remote else [])  # once per mount: its other files reuse the answer
    with shardkit.open(paths[1]) as ckpt:  # and the reader is sized by the tuning (a map has none)
        reader = ckpt.reader_of("w")
        if want[0] == "mmap":
            assert reader is None and ckpt.read_report()[0]["backend"] == "mmap"
        else:
            assert reader is not None and reader.chunk_bytes == readers.TUNINGS[want[2]].chunk_bytes
    monkeypatch.setattr(residency, "cached_fraction", lambda p, **kw: 1.0)
    assert choose_backend(str(path), "auto").backend == "mmap"  # warm: no probe needed
    residency.forget_mount_latencies()


def test_the_mount_probe_is_timed_again_on_another_mount(tmp_path, monkeypatch) -> None:
    from shardkit.reading import residency

    residency.forget_mount_latencies()
    path = tmp_path / "w.safetensors"
    safetensors.torch.save_file({"w": torch.ones(8)}, path)
    latencies = iter([0.004, 0.0001])
    monkeypatch.setattr(residency, "remote_filesystem", lambda p: "fuse")
    monkeypatch.setattr(residency, "cached_fraction", lambda p, **kw: 0.0)
    monkeypatch.setattr(residency, "request_latency_s", lambda p, **kw: next(latencies))
    assert choose_backend(str(path), "auto").tuning == "round-trip"
    assert choose_backend(str(path), "auto").tuning == "round-trip"  # remembered, not timed again
    real_stat = os.stat
    monkeypatch.setattr(residency.os, "stat", lambda p, *a, **kw: os.stat_result(
        (*real_stat(p)[:2], real_stat(p).st_dev + 1, *real_stat(p)[3:])))
    assert choose_backend(str(path), "auto").tuning == "passthrough"  # another st_dev: timed
    residency.forget_mount_latencies()


# ----------------------------------------------------------------------------- read_batch through the ring


def test_read_batch_through_the_pipeline_matches_get_tensor(tmp_path) -> None:
    path, tensors = _checkpoint(tmp_path)
    with shardkit.open(path, read="pread") as ckpt:
        wants = {n: Want(n, "cpu", ckpt.dtype_of(n)) for n in tensors}
        wants["layers.F32.3"] = Want("layers.F32.3", "cpu", torch.float64)  # a cast after the copy
        values, report = read_batch(ckpt, wants, pipe_host=True)
        for name in tensors:
            want = ckpt.get_tensor(name, dtype=wants[name].dtype)
            assert values[name].dtype == want.dtype and tensor_bytes(values[name]) == tensor_bytes(want), name
    assert report.pipelined_bytes == sum(t.numel() * t.element_size() for t in tensors.values())


# ----------------------------------------------------------------------------- load_model


def test_load_model_pread_equals_mmap_and_reports_the_backend(tmp_path) -> None:
    from diffusers import AutoencoderKL
    from helpers_load import TINY_VAE_CONFIG, save_model, tiny_vae

    folder = save_model(tiny_vae(), tmp_path / "ckpt", max_shard_size="16KB")
    mapped = shardkit.load_model(AutoencoderKL, folder, config=TINY_VAE_CONFIG, read="mmap")
    pread = shardkit.load_model(AutoencoderKL, folder, config=TINY_VAE_CONFIG, read="pread")
    a, b = mapped.state_dict(), pread.state_dict()
    assert sorted(a) == sorted(b)
    assert all(tensor_bytes(a[n]) == tensor_bytes(b[n]) for n in a)
    files = pread.shardkit_load_report["files"]
    assert len(files) > 1 and {f["backend"] for f in files} == {"pread"}
    assert pread.shardkit_load_report["host_batch_bytes"] > 0
    assert {f["backend"] for f in mapped.shardkit_load_report["files"]} == {"mmap"}


# ----------------------------------------------------------------------------- real CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("read", ["mmap", "pread"])
def test_load_model_to_cuda_goes_through_the_pipeline(tmp_path, read) -> None:
    from diffusers import AutoencoderKL
    from helpers_load import TINY_VAE_CONFIG, save_model, tiny_vae

    eager = tiny_vae()
    folder = save_model(eager, tmp_path / "ckpt", max_shard_size="16KB")
    model = shardkit.load_model(AutoencoderKL, folder, config=TINY_VAE_CONFIG, device_map={"": 0}, read=read)
    got, want = model.state_dict(), eager.state_dict()
    assert all(got[n].device.type == "cuda" and tensor_bytes(got[n]) == tensor_bytes(want[n]) for n in want)
    assert model.shardkit_load_report["pipelined_bytes"] > 0


@pytest.mark.slow
def test_load_pipeline_pread_loads_components_with_shardkit_and_equals_mmap(tmp_path) -> None:
    from helpers_offload import staged_script

    folder = tmp_path / "pipe"
    staged_script().build_tiny_flux_pipeline().save_pretrained(folder)
    mapped = shardkit.load_pipeline(folder, device_map="cpu", read="mmap")
    pread = shardkit.load_pipeline(folder, device_map="cpu", read="pread")
    assert mapped.shardkit_load_report == {}
    report = pread.shardkit_load_report
    assert report["transformer"]["loaded_by"] == "shardkit", report
    assert {f["backend"] for f in report["transformer"]["files"]} == {"pread"}
    for name, component in mapped.components.items():
        if isinstance(component, torch.nn.Module):
            a, b = component.state_dict(), getattr(pread, name).state_dict()
            assert sorted(a) == sorted(b), name
            assert all(tensor_bytes(a[k]) == tensor_bytes(b[k]) for k in a), name
