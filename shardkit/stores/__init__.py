"""Remote object stores under one interface: ``s3://BUCKET/PREFIX`` (boto3, docs/s3.md) and ``hf://ORG/REPO``
(the Hugging Face Hub, read-only: :mod:`shardkit.stores.hf`), each opened by its row of :data:`OPENERS`.

A low stage: it imports only the top level, ``formats.ranges`` and ``workers``, and nothing here
knows about checkpoints beyond "a folder of objects". The readers read a remote object as a
:class:`~shardkit.formats.ranges.RangeFile` (:class:`RemoteObject`); the writers stream shards
by multipart upload (:meth:`ObjectStore.writer`) and publish the index last (:meth:`ObjectStore.put`).

    with open_store("s3://models/sd15/unet") as store:
        objects = list_folder(store)            # one line naming the prefix if it holds nothing
        shard = RemoteObject(store, objects[0])  # a RangeFile: shard.read_into(offset, out)
"""

from __future__ import annotations

from typing import Protocol

from ..errors import InvalidInputError, SourceNotFoundError
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

__all__ = ["OPENERS", "STORE_SCHEMES", "SUPPORTED_SCHEMES", "ObjectInfo", "ObjectStore", "ObjectWriter", "PendingUpload",
           "RangeRequest", "RemoteObject", "RetryPolicy", "StoreUrl", "call_with_retries", "check_local", "check_scheme",
           "is_store_url", "list_folder", "open_store", "parse_store_url", "read_ranges", "url_scheme"]


def _open_s3(url: str | StoreUrl, *, token: str | None, threads: int, check_bucket: bool) -> ObjectStore:
    from .s3 import open_s3  # boto3 is imported only when a store is opened

    return open_s3(parse_store_url(url) if isinstance(url, str) else url, threads=threads, check_bucket=check_bucket)


def _open_hf(url: str | StoreUrl, *, token: str | None, threads: int, check_bucket: bool) -> ObjectStore:
    from .hf import HfStore  # huggingface_hub is imported only when a store is opened

    return HfStore(str(url), token=token)


class _Opener(Protocol):
    def __call__(self, url: str | StoreUrl, *, token: str | None, threads: int, check_bucket: bool) -> ObjectStore: ...


OPENERS: dict[str, _Opener] = {"s3": _open_s3, "hf": _open_hf}  # scheme -> its store: one row per kind of store


def open_store(url: str | StoreUrl, *, token: str | None = None, threads: int = 16,
               check_bucket: bool = True) -> ObjectStore:
    """The store holding ``url`` (an S3 bucket checked to exist and to accept the credentials; a Hub
    repository pinned to the commit its revision names now); close it.

    ``check_bucket=False`` saves that round trip where the first request lists the prefix (a missing
    or refused bucket fails there, in the same one line). ``token`` is a Hub token (S3 reads the AWS chain).
    """
    scheme = url.scheme if isinstance(url, StoreUrl) else url_scheme(url)
    opener = OPENERS.get(scheme or "")
    if opener is None:
        check_scheme(url)
        raise InvalidInputError(f"{url}: expected s3://BUCKET/PREFIX or hf://ORG/REPO")
    return opener(url, token=token, threads=threads, check_bucket=check_bucket)


def list_folder(store: ObjectStore, folder: str = "") -> list[ObjectInfo]:
    """The objects under ``folder`` of the store's prefix; none at all is an error naming the prefix."""
    found = store.list_objects(folder)
    if not found:
        where = store.url.child(folder) if folder else store.url
        raise SourceNotFoundError(f"{where}: no objects under this prefix (check the bucket and prefix)")
    return found
