"""A GGUF in ``s3://`` (a real SeaweedFS) or ``hf://`` (the offline Hub) read by range, not fetched whole.

:func:`shardkit.sources.gguf.remote_gguf` (what ``convert`` of a remote GGUF reads through): each part's header fetched
into a stand-in, every tensor's bytes by ranged reads. Bytes equal the local file's; the bytes moved are counted where
they cross (the delay proxy in front of SeaweedFS, the Hub server's own count), never timed.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
from conftest import assert_one_line_error
from helpers_gguf import tiny_llama_folder
from helpers_s3 import DelayProxy

import shardkit
from shardkit.errors import HeaderError, StoreError
from shardkit.formats.gguf import read_gguf
from shardkit.sources.gguf import GgufSource, remote_gguf
from shardkit.stores import gguf_fetch

pytestmark = pytest.mark.filterwarnings("ignore:.*no tokenizer.json:shardkit.errors.ShardkitWarning")

ONE = "model.norm.weight"  # a 1 KiB F32 tensor of a multi-MB file


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A ~8 MB F32 Llama GGUF (``one``) and the same as a split of three or more parts (``split``)."""
    root = tmp_path_factory.mktemp("gguf-remote")
    tiny_llama_folder(root / "llama", hidden_size=256, intermediate_size=768, vocab_size=1024)
    (root / "split").mkdir()
    shardkit.convert(root / "llama", root / "m.gguf", to="gguf")
    parts = shardkit.convert(root / "llama", root / "split" / "m.gguf", to="gguf", max_shard_size="3MB").files
    assert len(parts) >= 3 and (root / "m.gguf").stat().st_size > 8_000_000
    return {"one": root / "m.gguf", "split": root / "split"}


def _entry_bytes(src: GgufSource, name: str) -> bytes:
    entry = {e.name: e for e in src.entries()}[name]
    return bytes(src.read(entry, 0, entry.nbytes))


def _every_tensor(src: GgufSource) -> dict[str, bytes]:
    return {e.name: bytes(src.read(e, 0, e.nbytes)) for e in src.entries()}


@pytest.fixture
def proxy(s3_env, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN001, ANN201 - the conftest fixture; a DelayProxy
    """The delay proxy (no delay) in front of SeaweedFS: ``sent_bytes`` counts what the store sent."""
    with DelayProxy(s3_env.server.port, delay_ms=0) as counting:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{counting.port}")
        yield counting


# ----------------------------------------------------------------------------- s3://


def test_one_tensor_moves_its_bytes_and_the_header_not_the_file(big: dict[str, Path], s3_env, proxy) -> None:
    size = big["one"].stat().st_size
    s3_env.put("m/m.gguf", big["one"].read_bytes())
    url = f"s3://{s3_env.bucket}/m/m.gguf"
    proxy.sent_bytes = 0
    with remote_gguf(url) as local, GgufSource(local) as src, GgufSource(str(big["one"])) as ref:
        assert src.by_range and not src.kernel_copy and src.description == url
        assert os.stat(local).st_blocks * 512 < size // 4, "the stand-in is a header, then a hole"
        assert _entry_bytes(src, ONE) == _entry_bytes(ref, ONE)
        one_bytes = proxy.sent_bytes
        assert one_bytes < size // 4, (one_bytes, size)  # the header's requests and 1 KiB of tensor, not ~8 MB
        assert _every_tensor(src) == _every_tensor(ref)  # quantized, permuted and plain: the local bytes
    print(f"one tensor of a {size}-byte GGUF by range: {one_bytes} bytes from the store")


def test_a_split_set_is_read_by_range_part_by_part(big: dict[str, Path], s3_env, proxy, tmp_path: Path) -> None:
    parts = sorted(big["split"].iterdir())
    total = s3_env.put_folder(big["split"], "split")
    url = f"s3://{s3_env.bucket}/split/{parts[0].name}"
    proxy.sent_bytes = 0
    with remote_gguf(url) as local, GgufSource(local) as src, GgufSource(str(parts[0])) as ref:
        assert [os.path.basename(p) for p in src.paths] == [p.name for p in parts]
        last = read_gguf(parts[-1]).tensors[-1].name
        hf_name = next(name for name, t in src.names.items() if t.name == last)
        assert _entry_bytes(src, hf_name) == _entry_bytes(ref, hf_name)
        assert proxy.sent_bytes < total // 4, (proxy.sent_bytes, total)  # every header, one tensor
        assert _every_tensor(src) == _every_tensor(ref)
    shardkit.convert(url, tmp_path / "back.gguf", to="gguf")  # convert reads the split by range too
    assert (tmp_path / "back.gguf").read_bytes() == big["one"].read_bytes()


def test_convert_from_a_bucket_moves_the_file_once_and_leaves_no_copy(big: dict[str, Path], s3_env, proxy,
                                                                     tmp_path: Path) -> None:
    size = big["one"].stat().st_size
    s3_env.put("m/m.gguf", big["one"].read_bytes())
    proxy.sent_bytes = 0
    shardkit.convert(f"s3://{s3_env.bucket}/m/m.gguf", tmp_path / "out", dtype="fp32")
    shardkit.convert(big["one"], tmp_path / "local", dtype="fp32")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "local" / "model.safetensors").read_bytes()
    assert size <= proxy.sent_bytes < size + 1_000_000, (proxy.sent_bytes, size)  # each byte once, plus requests


def _header(*fields: bytes) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, 1, 1) + b"".join(fields)


def test_a_hostile_or_truncated_header_is_one_line_and_reads_little(big: dict[str, Path], s3_env, proxy, run_cli,
                                                                    tmp_path: Path) -> None:
    """Lengths and counts larger than the object are refused before anything that size is read or allocated."""
    key = struct.pack("<Q", 4) + b"name" + struct.pack("<I", 8)  # a string value...
    cases = {
        "key.gguf": (b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 1 << 40) + bytes(4000), "over the 1024-byte limit"),
        "value.gguf": (_header(key, struct.pack("<Q", 60 << 20), b"x" * 4000), "needs 62914560 bytes"),
        "counts.gguf": (b"GGUF" + struct.pack("<IQQ", 3, 1 << 60, 1 << 60) + bytes(4000), "cannot fit"),
        "cut.gguf": (big["one"].read_bytes()[:40_000], "truncated"),
    }
    for name, (data, problem) in cases.items():
        s3_env.put(f"bad/{name}", data)
        url = f"s3://{s3_env.bucket}/bad/{name}"
        proxy.sent_bytes = 0
        line = assert_one_line_error(run_cli("convert", url, tmp_path / "x.gguf", "--to", "gguf"), contains=problem)
        assert url in line and "/tmp" not in line, line
        assert proxy.sent_bytes < 200_000, (name, proxy.sent_bytes)
    assert not (tmp_path / "x.gguf").exists()


def test_a_header_past_its_bound_is_refused_before_it_is_read(big: dict[str, Path], s3_env, proxy,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """:data:`~shardkit.formats.gguf.MAX_HEADER_BYTES` bounds what a header may make shardkit read and hold."""
    monkeypatch.setattr("shardkit.formats.gguf.MAX_HEADER_BYTES", 4096)
    key = struct.pack("<Q", 4) + b"name" + struct.pack("<I", 8)
    s3_env.put("bad/long.gguf", _header(key, struct.pack("<Q", 3 << 20), b"x" * (4 << 20)))
    proxy.sent_bytes = 0
    with pytest.raises(HeaderError, match=r"bad/long\.gguf: metadata 'name' \(3145728 bytes at offset 48\) runs the "
                                          "header past 4096 bytes"):
        shardkit.convert(f"s3://{s3_env.bucket}/bad/long.gguf", "never.gguf", to="gguf")
    assert proxy.sent_bytes < 100_000, proxy.sent_bytes
    assert not Path("never.gguf").exists()


def test_a_write_of_zero_bytes_is_an_error_naming_the_file(big: dict[str, Path], s3_env,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The fetch's writes: a short one is continued (the bytes stay exact), one that writes nothing is an error."""
    s3_env.put("m/m.gguf", big["one"].read_bytes())
    url = f"s3://{s3_env.bucket}/m/m.gguf"
    pwrite = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: pwrite(fd, bytes(data)[:4093], offset))
    with gguf_fetch.fetched_gguf(url) as local:
        assert Path(local).read_bytes() == big["one"].read_bytes()
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: 0)
    for opening in (gguf_fetch.fetched_gguf, remote_gguf):
        with pytest.raises(StoreError, match=rf"^{url}: writing its local copy failed \(took 0 of \d+ bytes at offset 0\); "
                                             "free space in .*, or point TMPDIR elsewhere$"), opening(url):
            pass


# ----------------------------------------------------------------------------- hf://

_HF_READ = """
import sys
import shardkit
from shardkit.sources.gguf import GgufSource, remote_gguf

url, local, name, out = sys.argv[1:5]
if out == "-":  # one tensor, by range
    with remote_gguf(url) as stand_in, GgufSource(stand_in) as src, GgufSource(local) as ref:
        entry, kept = ({e.name: e for e in s.entries()}[name] for s in (src, ref))
        assert src.by_range and src.description == url, src.description
        assert bytes(src.read(entry, 0, entry.nbytes)) == bytes(ref.read(kept, 0, kept.nbytes))
else:  # cache=False: by range, no local copy; the default fetches the file whole, checked against its LFS sha256
    shardkit.convert(url, out, to="gguf", cache=False)
"""


def test_a_gguf_on_the_hub_is_read_by_range_with_cache_false(big: dict[str, Path], hub, tmp_path: Path) -> None:
    from helpers_hub import hub_env, run_python

    env = hub_env(hub, tmp_path / "home")
    size = big["one"].stat().st_size
    hub.state.add_repo("alice/llama-gguf", {"m.gguf": big["one"].read_bytes()})
    url = "hf://alice/llama-gguf/m.gguf"
    before = hub.state.bytes_sent()
    run_python(_HF_READ, env, url, big["one"], ONE, "-")
    one_bytes = hub.state.bytes_sent() - before
    assert one_bytes < size // 4, (one_bytes, size)
    before = hub.state.bytes_sent()
    run_python(_HF_READ, env, url, big["one"], ONE, tmp_path / "back.gguf")
    assert (tmp_path / "back.gguf").read_bytes() == big["one"].read_bytes()
    assert size <= hub.state.bytes_sent() - before < size + 1_000_000
    assert not (tmp_path / "home" / "hub").exists() or not any((tmp_path / "home" / "hub").rglob("*.gguf"))


def test_open_and_load_of_a_remote_gguf_say_what_to_do(s3_env, proxy, run_cli) -> None:
    """As for a local GGUF: ``open``/``load_model`` read safetensors; the message names the location and ``convert``."""
    url = f"s3://{s3_env.bucket}/m/m.gguf"
    for call in (lambda: shardkit.open(url), lambda: shardkit.load_model("transformers:LlamaForCausalLM", url)):
        with pytest.raises(shardkit.InvalidInputError, match=rf"^{url}: not a safetensors checkpoint \(a GGUF file\); "
                                                             "convert it first, e.g. shardkit.convert"):
            call()
    assert proxy.requests == {}


def test_torch_tensors_of_a_remote_gguf_equal_the_local_ones(big: dict[str, Path], s3_env) -> None:
    """What ``to='diffusers'`` reads a GGUF through: by range every tensor is read into memory (none mapped)."""
    import torch

    from shardkit.sources.gguf import load_gguf_tensors

    s3_env.put("m/m.gguf", big["one"].read_bytes())
    with remote_gguf(f"s3://{s3_env.bucket}/m/m.gguf") as local:
        remote, offsets, _ = load_gguf_tensors(local, dequantize_to="F32")
    kept, kept_offsets, _ = load_gguf_tensors(str(big["one"]), dequantize_to="F32")
    assert offsets == {} and kept_offsets and remote.keys() == kept.keys()
    assert all(remote[k].dtype == kept[k].dtype and torch.equal(remote[k], kept[k]) for k in kept)


def test_verify_without_data_reads_the_headers_only(big: dict[str, Path], s3_env, proxy) -> None:
    """``verify`` reads every byte (each file's sha256: fetched whole); with ``read_data=False`` the headers only."""
    size = big["one"].stat().st_size
    s3_env.put("m/m.gguf", big["one"].read_bytes())
    url = f"s3://{s3_env.bucket}/m/m.gguf"
    proxy.sent_bytes = 0
    report = shardkit.verify(url, read_data=False)
    assert report.ok and report.path == url and report.files == []
    assert proxy.sent_bytes < size // 4, proxy.sent_bytes
    proxy.sent_bytes = 0
    report = shardkit.verify(url)
    assert report.ok and [f.name for f in report.files] == ["m.gguf"] and proxy.sent_bytes >= size
