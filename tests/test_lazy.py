"""shardkit.open: a lazy read-only mapping over safetensors files and sharded folders."""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import safetensors.torch
import torch
from conftest import make_state_dict, tensor_bytes

import shardkit
from shardkit.errors import CheckpointIndexError, HeaderError, InvalidInputError, SourceNotFoundError
from shardkit.loading import shards
from shardkit.reading import host_reads


def _sharded(tmp_path, tensors, *, max_shard_size="200B", **kwargs):
    out = tmp_path / "ckpt"
    shardkit.save_sharded(tensors, out, max_shard_size=max_shard_size, **kwargs)
    return out


def test_sharded_folder_reads_every_dtype_bit_exact(tmp_path) -> None:
    tensors = make_state_dict(shapes=[(), (0,), (5, 3), (2, 3, 4)])
    out = _sharded(tmp_path, tensors)
    assert len(list(out.glob("*.safetensors"))) > 3
    with shardkit.open(out) as ckpt:
        assert len(ckpt) == len(tensors) and set(ckpt) == set(tensors)
        assert "layers.F32.2" in ckpt and "nope" not in ckpt
        for name, want in tensors.items():
            got = ckpt[name]
            assert got.dtype == want.dtype and got.shape == want.shape
            assert tensor_bytes(got) == tensor_bytes(want), name
            assert ckpt.shape_of(name) == tuple(want.shape) and ckpt.dtype_of(name) == want.dtype
            assert ckpt.nbytes(name) == want.numel() * want.element_size()
        assert ckpt.nbytes() == sum(t.numel() * t.element_size() for t in tensors.values())
        assert ckpt.metadata["format"] == "pt"
        with pytest.raises(KeyError):
            ckpt["nope"]


@pytest.mark.parametrize("layout", ["single", "index-path", "diffusers-variant"])
def test_single_file_index_path_and_diffusers_variant(tmp_path, layout) -> None:
    tensors = {"a": torch.randn(4, 4), "b": torch.arange(6)}
    if layout == "single":
        path = tmp_path / "w.safetensors"
        safetensors.torch.save_file(tensors, path, metadata={"k": "v"})
    elif layout == "index-path":
        path = _sharded(tmp_path, tensors, max_shard_size="40B") / "model.safetensors.index.json"
    else:
        folder = _sharded(tmp_path, tensors, max_shard_size="40B", name="diffusion_pytorch_model", variant="fp16")
        shardkit.save_sharded({"a": torch.zeros(1)}, folder / "other")  # a decoy checkpoint elsewhere
        assert (folder / "diffusion_pytorch_model.safetensors.index.fp16.json").exists()
        path = folder
    with shardkit.open(path, variant="fp16" if layout == "diffusers-variant" else None) as ckpt:
        assert sorted(ckpt) == ["a", "b"]
        assert torch.equal(ckpt["a"], tensors["a"]) and torch.equal(ckpt["b"], tensors["b"])


def test_getitem_is_zero_copy_and_private(tmp_path) -> None:
    path = tmp_path / "w.safetensors"
    safetensors.torch.save_file({"w": torch.ones(1024)}, path)
    before = path.read_bytes()
    with shardkit.open(path) as ckpt:
        first, second = ckpt["w"], ckpt["w"]
        assert first.data_ptr() == second.data_ptr(), "both reads must view the same mapped pages"
        first.mul_(3)  # copy-on-write: the file never changes
        assert ckpt.get_tensor("w", copy=True).sum().item() == 1024
    assert path.read_bytes() == before
    assert first.sum().item() == 3 * 1024, "tensors stay valid after close"


def _mapped_rss(path) -> int:
    """Resident bytes of this process's mappings of ``path`` (pages actually touched)."""
    real = os.path.realpath(path)
    return sum(m.rss for m in psutil.Process().memory_maps(grouped=False) if m.path == real)


def test_reads_only_the_tensors_asked_for(tmp_path, monkeypatch) -> None:
    big, small = torch.randn(4 * 2**20 // 4), torch.randn(16)  # 4 MiB and 64 bytes, one file
    path = tmp_path / "w.safetensors"
    safetensors.torch.save_file({"big": big, "small": small}, path)
    read_bytes = []
    real_read_into = host_reads.read_into
    monkeypatch.setattr(host_reads, "read_into", lambda fd, t, off, n, **kw: (read_bytes.append(n), real_read_into(fd, t, off, n, **kw)))
    with shardkit.open(path) as ckpt:
        assert torch.equal(ckpt["small"], small)
        assert ckpt.get_tensor("small", dtype=torch.float64).dtype == torch.float64
        assert ckpt.shape_of("big") == tuple(big.shape)  # headers only
        assert read_bytes == [64], "a cast reads exactly the tensor's bytes, nothing else"
        assert _mapped_rss(path) < 1 * 2**20, "the 4 MiB tensor must not be paged in"
        rows = ckpt.get_slice("big")[:1024]
        assert torch.equal(rows, big[:1024]) and ckpt.get_slice("big").get_shape() == [big.numel()]
        assert _mapped_rss(path) < 1 * 2**20, "a slice pages in only its own rows"
        assert torch.equal(ckpt["big"], big)
        assert _mapped_rss(path) >= 4 * 2**20 - 8192


def test_each_shard_opened_once_and_threads_agree(tmp_path, monkeypatch) -> None:
    tensors = {f"t{i}": torch.randn(64) for i in range(40)}
    out = _sharded(tmp_path, tensors, max_shard_size="1KB")
    opened: list[str] = []
    real_open = os.open
    monkeypatch.setattr(shards.os, "open",  # every module shares os: one patch sees each open
                        lambda p, *a, **k: (opened.append(os.fspath(p)), real_open(p, *a, **k))[1])
    ckpt = shardkit.open(out)
    barrier = threading.Barrier(4)

    def read(name: str) -> bool:
        if name in ("t0", "t1", "t2", "t3"):
            barrier.wait(timeout=10)
        return torch.equal(ckpt[name], tensors[name]) and torch.equal(ckpt.get_tensor(name, copy=True), tensors[name])

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(read, [*tensors] * 3))
    shard_files = [p for p in opened if p.endswith(".safetensors")]
    assert len(shard_files) == len(set(shard_files)) == len(list(out.glob("*.safetensors")))
    state = ckpt.to_state_dict(dtype=torch.float16)
    assert all(t.dtype == torch.float16 for t in state.values())
    ckpt.close()
    with pytest.raises(InvalidInputError, match="closed"):
        ckpt["t0"]


@pytest.mark.parametrize("how", ["read_many", "load_model"])
def test_shards_open_together_not_one_after_another(tmp_path, monkeypatch, how) -> None:
    """Each shard's open (descriptor, header, a mount's timed request) costs round trips on a network
    mount: reading many tensors opens all shards at once, each still once."""
    from shardkit.loading import lazy

    tensors = {f"t{i}": torch.randn(64) for i in range(12)}
    out = _sharded(tmp_path, tensors, max_shard_size="1KB")
    assert len(list(out.glob("*.safetensors"))) >= 3
    lock = threading.Lock()
    now = {"in": 0, "peak": 0}
    calls: list[str] = []
    two_in = threading.Event()
    real_open_shard = lazy.open_shard

    def open_shard(shard, read):
        with lock:
            calls.append(shard.path)
            now["in"] += 1
            now["peak"] = max(now["peak"], now["in"])
            if now["in"] >= 2:
                two_in.set()
        two_in.wait(timeout=5)  # one at a time (the old lock) never gets here twice: 5 s each, then on
        try:
            real_open_shard(shard, read)
        finally:
            with lock:
                now["in"] -= 1

    monkeypatch.setattr(lazy, "open_shard", open_shard)
    if how == "read_many":
        with shardkit.open(out, read="pread") as ckpt:
            state = ckpt.read_many(list(ckpt))
    else:
        model = shardkit.load_model(lambda: _Params(tensors), out, read="pread")
        state = model.state_dict()
    assert all(torch.equal(state[n], t) for n, t in tensors.items())
    assert now["peak"] >= 2, now
    assert len(calls) == len(set(calls)) == len(list(out.glob("*.safetensors")))


class _Params(torch.nn.Module):
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, t in tensors.items():
            self.register_parameter(name, torch.nn.Parameter(torch.empty_like(t), requires_grad=False))


def test_to_state_dict_casts_only_floating_tensors(tmp_path) -> None:
    tensors = {"f": torch.randn(3), "i": torch.arange(3), "b": torch.tensor([True, False])}
    with shardkit.open(_sharded(tmp_path, tensors, max_shard_size="1GB")) as ckpt:
        state = ckpt.to_state_dict(dtype=torch.bfloat16)
    assert state["f"].dtype == torch.bfloat16 and state["i"].dtype == torch.int64 and state["b"].dtype == torch.bool


def test_corrupt_shard_errors_at_first_touch_only(tmp_path) -> None:
    tensors = {"a": torch.randn(8), "b": torch.randn(8), "c": torch.randn(8)}
    out = _sharded(tmp_path, tensors, max_shard_size="32B")
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    (out / index["b"]).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage-garbage")
    with shardkit.open(out) as ckpt:  # opening reads no shard
        assert torch.equal(ckpt["a"], tensors["a"])
        with pytest.raises(HeaderError, match=index["b"]):
            ckpt["b"]
        with pytest.raises(HeaderError):
            ckpt.shape_of("b")
        assert torch.equal(ckpt["c"], tensors["c"])


def test_truncated_shard_and_shard_not_matching_index(tmp_path) -> None:
    tensors = {"a": torch.randn(8), "b": torch.randn(8)}
    out = _sharded(tmp_path, tensors, max_shard_size="32B")
    index_path = out / "model.safetensors.index.json"
    doc = json.loads(index_path.read_text())
    shard_a = out / doc["weight_map"]["a"]
    shard_a.write_bytes(shard_a.read_bytes()[:-4])
    with shardkit.open(out) as ckpt, pytest.raises(HeaderError, match="truncated"):
        ckpt["a"]
    doc["weight_map"]["a"] = doc["weight_map"]["b"]
    index_path.write_text(json.dumps(doc))
    with shardkit.open(out) as ckpt, pytest.raises(CheckpointIndexError, match="does not match the index"):
        ckpt["b"]


def test_missing_shard_errors_at_open(tmp_path) -> None:
    out = _sharded(tmp_path, {"a": torch.randn(8), "b": torch.randn(8)}, max_shard_size="32B")
    victim = sorted(out.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointIndexError, match=victim.name):
        shardkit.open(out)


def test_refuses_journal_pipeline_folders_pickles_and_missing_paths(tmp_path) -> None:
    out = _sharded(tmp_path, {"a": torch.randn(8)}, max_shard_size="1GB")
    journal = out / ".shardkit-journal.json"
    journal.write_text("{}")
    with pytest.raises(InvalidInputError, match="shardkit recover"):
        shardkit.open(out)
    assert journal.exists(), "opening must never modify the folder"
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    (pipe / "model_index.json").write_text("{}")
    with pytest.raises(InvalidInputError, match="pipeline folder"):
        shardkit.open(pipe)
    torch.save({"a": torch.randn(2)}, tmp_path / "w.bin")
    with pytest.raises(InvalidInputError, match="shardkit split"):
        shardkit.open(tmp_path / "w.bin")
    with pytest.raises(SourceNotFoundError):
        shardkit.open(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceNotFoundError, match="no .safetensors"):
        shardkit.open(tmp_path / "empty")


UNCLOSED_LOOP = """
import os, sys
import shardkit
path, stop = sys.argv[1], int(sys.argv[2])
fd = os.open(path, os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold: reads are in flight, not served from the cache
os.close(fd)
ck = shardkit.open(path, read="pread")
for i, k in enumerate(ck):
    ck[k].sum()
    if i == stop:
        break  # leave the read-ahead running
print("done")
"""


def test_unclosed_checkpoint_exits_cleanly_at_interpreter_exit(tmp_path) -> None:
    """Issue 34: ``ck = shardkit.open(p); for k in ck: ck[k]`` with no close() must exit 0 with nothing
    on stderr: the read-ahead is cancelled and the reader threads joined before interpreter shutdown
    (they used to be left running: a warning every time, SIGABRT sometimes)."""
    import subprocess
    import sys

    path = tmp_path / "big.safetensors"
    safetensors.torch.save_file({f"w{i}": torch.randn(1 << 20) for i in range(24)}, str(path))  # 96 MiB
    script = tmp_path / "loop.py"
    script.write_text(UNCLOSED_LOOP)
    for run in range(4):
        stop = -1 if run % 2 else 0  # the whole loop, or stop after the first tensor with reads in flight
        done = subprocess.run([sys.executable, str(script), str(path), str(stop)], capture_output=True, text=True,
                              timeout=120)
        assert (done.returncode, done.stderr, done.stdout) == (0, "", "done\n"), f"run {run}"
