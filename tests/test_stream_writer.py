"""``stream_safetensors``: the same bytes as ``write_safetensors``, in order, into any sink (a store's writer too)."""

from __future__ import annotations

import zlib

import pytest
from conftest import make_state_dict

from shardkit.sharding.digest import digest_file
from shardkit.sharding.stream_writer import stream_safetensors
from shardkit.sharding.writer import tensor_write, write_safetensors
from shardkit.sources import open_source


class Sink:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes | memoryview) -> None:
        self.data += data


@pytest.mark.parametrize("cast_to", [None, "BF16"])
def test_streamed_shard_equals_the_written_file(tmp_path, cast_to) -> None:
    from safetensors.torch import save_file

    save_file(make_state_dict(["F32", "F16", "I64", "BOOL"], shapes=[(300, 70), (5,)]), tmp_path / "src.safetensors")
    with open_source(str(tmp_path / "src.safetensors")) as source:
        writes = [tensor_write(e, cast_to) for e in source.entries()][1:]  # an unaligned start: header padded
        written = write_safetensors(str(tmp_path / "out.safetensors"), writes, source, metadata={"format": "pt"})
        sink = Sink()
        streamed = stream_safetensors(sink, "out.safetensors", writes, source, metadata={"format": "pt"})
    data = (tmp_path / "out.safetensors").read_bytes()
    assert streamed.digest == digest_file(str(tmp_path / "out.safetensors"), safetensors=True), \
        "the manifest record taken on the way is the one hashed from the file"
    assert bytes(sink.data) == data and streamed.file_bytes == written.file_bytes == len(data)
    head = 8 + int.from_bytes(data[:8], "little")
    at = head
    for p in writes:  # every crc32 is the crc32 of the bytes the file holds for that tensor
        assert streamed.crc32s[p.out.name] == f"{zlib.crc32(data[at:at + p.out.nbytes]):08x}"
        at += p.out.nbytes


def test_streamed_into_a_store_object(s3_env, tmp_path) -> None:
    from safetensors.torch import save_file

    from shardkit.stores import open_store

    save_file(make_state_dict(["F32", "BF16"], shapes=[(2500, 2000)]), tmp_path / "src.safetensors")  # 30 MB
    with open_source(str(tmp_path / "src.safetensors")) as source:
        writes = [tensor_write(e, None) for e in source.entries()]
        write_safetensors(str(tmp_path / "out.safetensors"), writes, source)
        with open_store(f"s3://{s3_env.bucket}/p") as store, store.writer("model.safetensors") as writer:
            stream_safetensors(writer, writer.name, writes, source)
            writer.commit()
    assert s3_env.get("p/model.safetensors") == (tmp_path / "out.safetensors").read_bytes()
