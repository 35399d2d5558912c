"""Reads pinned to the listed ETag (issue 41, item 7), on the real SeaweedFS: a replaced object is never mixed in.

The hostile endpoint (tests/test_s3_hostile.py) covers a store that ignores ``If-Match``; here the
store honours it, for ranged GETs and for server-side copy parts (``CopySourceIfMatch``).
"""

from __future__ import annotations

import pytest

from shardkit.errors import StoreError
from shardkit.stores import open_store


def test_a_ranged_read_of_a_replaced_object_fails_in_one_line(s3_env) -> None:
    s3_env.put("p/x.bin", b"a" * 100)
    with open_store(f"s3://{s3_env.bucket}/p") as store:
        (listed,) = store.list_objects()
        first = bytearray(10)
        store.read_into("x.bin", 0, memoryview(first))
        s3_env.put("p/x.bin", b"b" * 100)  # same size, new bytes: only the ETag tells
        with pytest.raises(StoreError, match="changed while it was being read") as caught:
            store.read_into("x.bin", 10, memoryview(bytearray(10)))
    assert first == b"a" * 10 and listed.etag
    assert "\n" not in str(caught.value) and f"s3://{s3_env.bucket}/p/x.bin" in str(caught.value)


def test_a_store_copy_of_a_replaced_source_fails_and_leaves_no_upload(s3_env) -> None:
    s3_env.put("src/x.bin", b"a" * (6 << 20))
    with open_store(f"s3://{s3_env.bucket}/src") as src, open_store(f"s3://{s3_env.bucket}/dst") as dst:
        src.list_objects()
        s3_env.put("src/x.bin", b"b" * (6 << 20))
        with pytest.raises(StoreError, match="changed while it was being read"), dst.writer("y.bin") as writer:
            writer.copy_range(s3_env.bucket, "src/x.bin", 0, 6 << 20, etag=src.pinned_etag("x.bin"))
            writer.commit()
    assert s3_env.keys("dst/") == [] and s3_env.uploads() == []
