"""The test object store itself: SeaweedFS with credentials, the delay proxy, and a stop that leaves nothing."""

from __future__ import annotations

import os
import time

import pytest
from botocore.exceptions import ClientError
from helpers_s3 import DelayProxy, SeaweedS3, start_or_skip


def test_the_server_refuses_a_wrong_secret_and_serves_ranges(s3_env) -> None:
    data = os.urandom(3 << 20)
    s3_env.put("a/blob.bin", data)
    client = s3_env.client()
    try:
        got = client.get_object(Bucket=s3_env.bucket, Key="a/blob.bin", Range="bytes=1000-1999")["Body"].read()
    finally:
        client.close()
    assert got == data[1000:2000]
    wrong = SeaweedS3(s3_env.server.data_dir, secret_key="not-the-secret")
    wrong.port = s3_env.server.port
    client = wrong.client()
    try:
        with pytest.raises(ClientError) as e:
            client.get_object(Bucket=s3_env.bucket, Key="a/blob.bin")
    finally:
        client.close()
    assert e.value.response["Error"]["Code"] in {"SignatureDoesNotMatch", "AccessDenied", "InvalidAccessKeyId"}


def test_a_missing_bucket_is_not_created_on_upload(s3_env) -> None:
    client = s3_env.client()
    try:
        with pytest.raises(ClientError) as e:
            client.put_object(Bucket="no-such-bucket-here", Key="x", Body=b"x")
    finally:
        client.close()
    assert e.value.response["Error"]["Code"] == "NoSuchBucket"


def test_the_proxy_delays_each_way_and_counts_bytes(s3_env) -> None:
    data = os.urandom(1 << 20)
    s3_env.put("blob", data)
    with DelayProxy(s3_env.server.port, delay_ms=40) as proxy:
        client = s3_env.client(port=proxy.port)
        try:
            client.head_object(Bucket=s3_env.bucket, Key="blob")  # connect first
            start = time.monotonic()
            got = client.get_object(Bucket=s3_env.bucket, Key="blob")["Body"].read()
            elapsed = time.monotonic() - start
        finally:
            client.close()
    assert got == data
    assert elapsed >= 0.08, "a request and its reply each wait 40 ms"
    assert proxy.sent_bytes > len(data) and proxy.received_bytes > 0
    assert proxy.connections >= 1


def test_stop_kills_the_whole_process_group_with_a_bound(tmp_path) -> None:
    server = start_or_skip(tmp_path / "weed")
    pid = server.process.pid
    start = time.monotonic()
    server.stop()
    assert time.monotonic() - start < 15
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)
    server.stop()  # idempotent


def test_ports_are_chosen_below_the_range_the_kernel_gives_clients() -> None:
    import s3_server

    ports = s3_server.free_ports(8)
    assert len(set(ports)) == 8
    assert all(p < s3_server._ephemeral_floor() for p in ports)


def test_a_port_taken_before_the_server_binds_it_is_retried_on_new_ones(tmp_path, monkeypatch) -> None:
    import socket

    import s3_server

    taken = socket.create_server(("127.0.0.1", 0))
    chosen: list[list[int]] = []
    real = s3_server.free_ports

    def first_one_taken(count: int) -> list[int]:
        ports = real(count)
        if not chosen:
            ports[2] = taken.getsockname()[1]  # the volume server's port, as in a CI failure
        chosen.append(ports)
        return ports

    monkeypatch.setattr(s3_server, "free_ports", first_one_taken)
    try:
        server = start_or_skip(tmp_path / "weed")
        try:
            assert len(chosen) == 2 and server.port == chosen[1][0]
            assert "address already in use" in server.log_tail(100_000)
        finally:
            server.stop()
    finally:
        taken.close()
