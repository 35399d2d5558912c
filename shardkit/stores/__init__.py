"""Remote object stores under one interface: ``s3://BUCKET/PREFIX`` today (boto3, docs/s3.md).

A low stage: it imports only the top level, ``formats.ranges`` and ``workers``, and nothing here
knows about checkpoints beyond "a folder of objects". The readers read a remote object as a
:class:`~shardkit.formats.ranges.RangeFile` (:class:`RemoteObject`); the writers stream shards
by multipart upload (:meth:`ObjectStore.writer`) and publish the index last (:meth:`ObjectStore.put`).

    with open_store("s3://models/sd15/unet") as store:
        objects = list_folder(store)            # one line naming the prefix if it holds nothing
        shard = RemoteObject(store, objects[0])  # a RangeFile: shard.read_into(offset, out)
"""

from __future__ import annotations

from ..errors import SourceNotFoundError
from .base import ObjectInfo, ObjectStore, ObjectWriter, PendingUpload, RangeRequest, RemoteObject, read_ranges
from .retry import RetryPolicy, call_with_retries
from .urls import (
    STORE_SCHEMES,
    SUPPORTED_SCHEMES,
    StoreUrl,
    check_local,
    check_scheme,
    is_store_url,
    parse_store_url,
    url_scheme,
)

__all__ = ["STORE_SCHEMES", "SUPPORTED_SCHEMES", "ObjectInfo", "ObjectStore", "ObjectWriter", "PendingUpload",
           "RangeRequest", "RemoteObject", "RetryPolicy", "StoreUrl", "call_with_retries", "check_local", "check_scheme",
           "is_store_url", "list_folder", "open_store", "parse_store_url", "read_ranges", "url_scheme"]


def open_store(url: str | StoreUrl, *, threads: int = 16, check_bucket: bool = True) -> ObjectStore:
    """The store holding ``url`` (its bucket checked to exist and to accept the credentials); close it.

    ``check_bucket=False`` saves that round trip where the first request lists the prefix (a missing
    or refused bucket fails there, in the same one line).
    """
    parsed = parse_store_url(url) if isinstance(url, str) else url
    from .s3 import open_s3  # boto3 is imported only when a store is opened

    return open_s3(parsed, threads=threads, check_bucket=check_bucket)


def list_folder(store: ObjectStore, folder: str = "") -> list[ObjectInfo]:
    """The objects under ``folder`` of the store's prefix; none at all is an error naming the prefix."""
    found = store.list_objects(folder)
    if not found:
        where = store.url.child(folder) if folder else store.url
        raise SourceNotFoundError(f"{where}: no objects under this prefix (check the bucket and prefix)")
    return found
