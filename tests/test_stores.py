"""shardkit.stores against a real SeaweedFS: list, stat, ranged reads, multipart writes, errors, the AWS chain."""

from __future__ import annotations

import os
import sys

import pytest
from helpers_s3 import ACCESS_KEY, SECRET_KEY, DelayProxy

from shardkit.errors import InvalidInputError, ShardkitError, SourceNotFoundError, StoreError
from shardkit.formats.ranges import RangeFile
from shardkit.stores import (
    RangeRequest,
    RemoteObject,
    check_scheme,
    list_folder,
    open_store,
    parse_store_url,
    read_ranges,
)
from shardkit.stores.s3 import S3Store

# ----------------------------------------------------------------------------- URLs (no server)


@pytest.mark.parametrize("text", ["s3://ab", "s3://Bucket/x", "s3://-bad/x", "s3://a..b/x", "s3://bkt/a/../b",
                                  "s3://bkt/a//b", "s3://bkt/./b", "s3://bkt/a\\b", "s3://"])
def test_bad_urls_are_refused_in_one_line(text: str) -> None:
    with pytest.raises(InvalidInputError) as e:
        parse_store_url(text)
    assert text in str(e.value) and "\n" not in str(e.value)


def test_a_key_never_leaves_the_prefix() -> None:
    url = parse_store_url("s3://models/run/ckpt/")
    assert (url.bucket, url.prefix, str(url)) == ("models", "run/ckpt", "s3://models/run/ckpt")
    assert url.key("unet/model.safetensors") == "run/ckpt/unet/model.safetensors"
    for hostile in ("../x", "/abs", "a/../../x", "", "a//b"):
        with pytest.raises(InvalidInputError):
            url.key(hostile)


@pytest.mark.parametrize("path", ["gs://bucket/x", "ftp://host/x", "file:///tmp/x", "az://c/x"])
def test_unknown_schemes_are_refused(path: str) -> None:
    with pytest.raises(InvalidInputError, match="unknown scheme"):
        check_scheme(path, role="output")
    check_scheme("s3://bkt/x")
    check_scheme("hf://org/repo")
    check_scheme("./s3:/not-a-url")


# ----------------------------------------------------------------------------- against SeaweedFS


def _objects(s3_env) -> dict[str, bytes]:
    objects = {"ckpt/model.safetensors.index.json": b"{}", "ckpt/model-00001-of-00002.safetensors": os.urandom(70_001),
               "ckpt/unet/config.json": b'{"a": 1}', "ckpt-other/x.bin": b"not ours", "ckpt/folder/": b""}
    for key, data in objects.items():
        s3_env.put(key, data)
    return objects


def test_list_stat_and_ranged_reads(s3_env) -> None:
    objects = _objects(s3_env)
    with open_store(f"s3://{s3_env.bucket}/ckpt") as store:
        listed = list_folder(store)
        assert [o.name for o in listed] == ["model-00001-of-00002.safetensors", "model.safetensors.index.json",
                                            "unet/config.json"], "sorted, relative, folder markers and siblings left out"
        assert [o.name for o in store.list_objects("unet")] == ["unet/config.json"]
        shard = store.stat("model-00001-of-00002.safetensors")
        data = objects["ckpt/model-00001-of-00002.safetensors"]
        assert shard.size_bytes == len(data) == listed[0].size_bytes
        remote = RemoteObject(store, shard)
        assert isinstance(remote, RangeFile)
        assert remote.name == f"s3://{s3_env.bucket}/ckpt/model-00001-of-00002.safetensors"
        out = bytearray(1000)
        remote.read_into(12_345, memoryview(out))
        assert bytes(out) == data[12_345:13_345]
        with pytest.raises(StoreError, match="past its end"):
            remote.read_into(len(data) - 10, memoryview(bytearray(11)))
        whole = bytearray(len(data))
        config = bytearray(8)
        read_ranges(store, [RangeRequest(shard.name, 0, memoryview(whole)),
                            RangeRequest("unet/config.json", 0, memoryview(config))], threads=4, part_bytes=4096)
        assert bytes(whole) == data and bytes(config) == b'{"a": 1}'


def test_multipart_write_is_streamed_and_complete(s3_env) -> None:
    data = os.urandom(12 << 20)
    with S3Store(parse_store_url(f"s3://{s3_env.bucket}/out"), part_bytes=5 << 20) as store:  # 3 parts: 5, 5, 2 MiB
        with store.writer("model.safetensors") as w:
            for begin in range(0, len(data), 3_000_001):  # odd chunk sizes across 5 MiB parts
                w.write(data[begin:begin + 3_000_001])
            assert s3_env.keys("out/") == [], "nothing visible before commit"
            assert s3_env.uploads() == ["out/model.safetensors"], "two parts sent while writing"
            info = w.commit()
        assert info.size_bytes == len(data)
        with store.writer("small.json") as w:
            w.write(b'{"x": 1}')
            w.commit()
        store.put("index.json", b"{}")
    assert s3_env.get("out/model.safetensors") == data
    assert s3_env.get("out/small.json") == b'{"x": 1}'
    assert s3_env.uploads() == []


def test_a_failed_write_aborts_and_leaves_nothing(s3_env) -> None:
    with open_store(f"s3://{s3_env.bucket}/out") as store:
        with pytest.raises(RuntimeError), store.writer("model.safetensors") as w:
            w.write(os.urandom(17 << 20))  # one 16 MiB part sent
            assert s3_env.uploads() == ["out/model.safetensors"]
            raise RuntimeError("interrupted")
        w.abort()  # idempotent
        assert s3_env.uploads() == [] and s3_env.keys() == []
        pending = store.writer("left.bin")
        pending.write(os.urandom(17 << 20))  # a writer never ended: what `recover` finds and aborts
        assert [u.name for u in store.pending_uploads()] == ["left.bin"]
        for upload in store.pending_uploads():
            store.abort(upload)
        assert s3_env.uploads() == []


def test_a_cut_reply_is_retried(s3_env) -> None:
    data = os.urandom(3 << 20)
    s3_env.put("blob", data)
    with DelayProxy(s3_env.server.port, delay_ms=0, cut_after_bytes=1 << 20, cuts=1) as proxy:
        os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{proxy.port}"  # restored by the fixture's monkeypatch
        with open_store(f"s3://{s3_env.bucket}") as store:
            out = bytearray(len(data))
            store.read_into("blob", 0, memoryview(out))
        assert proxy.cuts == 0, "the first reply was cut"
    assert bytes(out) == data


def test_wrong_credentials_missing_bucket_and_prefix_are_one_line(s3_env, monkeypatch) -> None:
    with pytest.raises(SourceNotFoundError, match="no such bucket") as e:
        open_store("s3://no-such-bucket-here/ckpt")
    assert "s3://no-such-bucket-here" in str(e.value)
    with open_store(f"s3://{s3_env.bucket}/missing") as store, pytest.raises(SourceNotFoundError) as e:
        list_folder(store)
    assert f"s3://{s3_env.bucket}/missing: no objects" in str(e.value)
    with open_store(f"s3://{s3_env.bucket}") as store, pytest.raises(SourceNotFoundError, match="no such object"):
        store.stat("nothing.json")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value")
    with pytest.raises(StoreError) as e:
        open_store(f"s3://{s3_env.bucket}/ckpt")
    message = str(e.value)
    assert s3_env.bucket in message and "AWS_ACCESS_KEY_ID" in message and "\n" not in message
    assert "wrong-secret-value" not in message and SECRET_KEY not in message


def test_the_standard_aws_chain_profiles_and_s3_endpoint(s3_env, tmp_path, monkeypatch) -> None:
    s3_env.put("ckpt/a.json", b"{}")
    (tmp_path / "credentials").write_text(f"[ckpt]\naws_access_key_id = {ACCESS_KEY}\n"
                                          f"aws_secret_access_key = {SECRET_KEY}\n")
    (tmp_path / "config").write_text(f"[profile ckpt]\nregion = us-east-1\n"
                                     f"endpoint_url = http://127.0.0.1:{s3_env.server.port}\n")
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_PROFILE", "ckpt")
    with open_store(f"s3://{s3_env.bucket}/ckpt") as store:
        assert [o.name for o in store.list_objects()] == ["a.json"]
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:1")  # the service-specific variable wins
    with pytest.raises(StoreError, match="cannot reach the store at http://127.0.0.1:1"):
        open_store(f"s3://{s3_env.bucket}/ckpt")


def test_errors_are_shardkit_errors_with_exit_2() -> None:
    assert issubclass(StoreError, ShardkitError) and StoreError.exit_code == 2
    assert "shardkit.stores" in sys.modules


def test_import_shardkit_does_not_import_boto3() -> None:
    import subprocess

    code = "import shardkit, shardkit.stores, sys; assert 'boto3' not in sys.modules and 'botocore' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
