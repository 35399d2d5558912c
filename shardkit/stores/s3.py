"""``s3://BUCKET/PREFIX`` through boto3: the AWS configuration users already have, one retry loop, errors in one line.

Credentials, region and endpoint come from botocore's own chain: ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` and ``~/.aws/config`` /
``credentials``, ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL`` /
``AWS_ENDPOINT_URL_S3`` (or ``endpoint_url`` in the profile) for any S3-compatible store. An
endpoint other than AWS's is addressed path-style (``http://host:port/BUCKET/KEY``), the way local
and self-hosted stores expect. Why boto3 and not obstore or s3fs: docs/s3.md (measured).

botocore's own retries are off (one attempt per call): :func:`~shardkit.stores.retry.call_with_retries`
retries a failed request or a body cut mid-read, with back-off and a bound. Messages name the
bucket, the key and the endpoint, never a credential.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from ..errors import StoreError
from .base import PART_BYTES, ObjectInfo, PendingUpload
from .retry import RetryPolicy, call_with_retries
from .s3_client import make_client
from .s3_errors import is_transient, store_errors
from .s3_writer import S3Client, S3Writer
from .urls import StoreUrl, parse_store_url

__all__ = ["S3Store", "open_s3"]

T = TypeVar("T")
MAX_LISTED_OBJECTS = 100_000  # a listing past this is no checkpoint folder: refused, not held in memory
READ_SLICE_BYTES = 1 << 20


def open_s3(url: str | StoreUrl, *, threads: int = 16, check_bucket: bool = True) -> S3Store:
    """An :class:`S3Store` on ``s3://BUCKET/PREFIX``, its bucket checked to exist and be readable.

    ``check_bucket=False`` leaves out that HEAD request, for a caller whose first request (a listing)
    fails the same way, in one line naming the bucket, when the bucket is missing or refused.
    """
    store = S3Store(parse_store_url(url) if isinstance(url, str) else url, threads=threads)
    if not check_bucket:
        return store
    try:
        store.check_bucket()
    except BaseException:
        store.close()
        raise
    return store


class S3Store:
    """A folder of objects in an S3 bucket (see :class:`~shardkit.stores.base.ObjectStore`)."""

    def __init__(self, url: StoreUrl, *, threads: int = 16, policy: RetryPolicy | None = None,
                 part_bytes: int = PART_BYTES) -> None:
        self.url = url
        self.policy = policy or RetryPolicy()
        self.part_bytes = part_bytes
        self.stop = threading.Event()
        self._client = make_client(max(threads, 1) + 4)  # one client per store, closed with it
        self.endpoint: str = self._client.meta.endpoint_url

    # ------------------------------------------------------------------ requests

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` retried on transient failures; a failure raised as one :class:`ShardkitError` line."""
        with store_errors(what, endpoint=self.endpoint, bucket=self.url.bucket):
            return call_with_retries(fn, policy=self.policy, transient=is_transient, stop=self.stop)

    def check_bucket(self) -> None:
        """The bucket exists and these credentials may use it (one HEAD request)."""
        self.call(f"s3://{self.url.bucket}", lambda: self._client.head_bucket(Bucket=self.url.bucket))

    # ------------------------------------------------------------------ reading

    def list_objects(self, folder: str = "") -> list[ObjectInfo]:
        prefix = self.url.key(folder) + "/" if folder else (self.url.prefix + "/" if self.url.prefix else "")
        return self.call(str(self.url.child(folder) if folder else self.url), lambda: self._list(prefix))

    def _list(self, prefix: str) -> list[ObjectInfo]:
        found: list[ObjectInfo] = []
        for page in self._pages(prefix):
            for obj in page.get("Contents", []):
                key, size = obj.get("Key"), obj.get("Size")
                if not isinstance(key, str) or not isinstance(size, int) or size < 0:
                    raise StoreError(f"{self.url}: the store listed an object without a valid key or size")
                if not key.startswith(prefix) or key.endswith("/"):
                    continue  # a folder marker, or a key outside the prefix: never ours to read
                found.append(ObjectInfo(self.url.relative(key), size, str(obj.get("ETag", "")).strip('"')))
                if len(found) > MAX_LISTED_OBJECTS:
                    raise StoreError(f"{self.url}: more than {MAX_LISTED_OBJECTS} objects under the prefix; "
                                     "name a folder that holds one checkpoint")
        return sorted(found, key=lambda o: o.name)

    def _pages(self, prefix: str) -> Iterator[S3Client]:
        paginator = self._client.get_paginator("list_objects_v2")
        yield from paginator.paginate(Bucket=self.url.bucket, Prefix=prefix)

    def stat(self, name: str) -> ObjectInfo:
        key = self.url.key(name)

        def head() -> ObjectInfo:
            reply = self._client.head_object(Bucket=self.url.bucket, Key=key)
            size = reply.get("ContentLength")
            if not isinstance(size, int) or size < 0:
                raise StoreError(f"{self.url.child(name)}: the store gave no valid size")
            return ObjectInfo(name, size, str(reply.get("ETag", "")).strip('"'))

        return self.call(str(self.url.child(name)), head)

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        key = self.url.key(name)
        where = f"{self.url.child(name)} bytes {offset}-{offset + len(out) - 1}"
        self.call(where, lambda: self._get_into(key, offset, out, where))

    def _get_into(self, key: str, offset: int, out: memoryview, where: str) -> None:
        reply = self._client.get_object(Bucket=self.url.bucket, Key=key, Range=f"bytes={offset}-{offset + len(out) - 1}")
        body = reply["Body"]
        try:
            if reply.get("ContentLength") != len(out):
                raise StoreError(f"{where}: the store answered {reply.get('ContentLength')} bytes "
                                 f"(the object is shorter, or the store ignored the range)")
            got = 0
            while got < len(out):
                n = body.readinto(out[got:got + READ_SLICE_BYTES])  # urllib3 reads each slice into a temporary
                if not n:
                    raise ConnectionError(f"the body ended after {got} of {len(out)} bytes")  # transient: retried
                got += n
        finally:
            body.close()

    # ------------------------------------------------------------------ writing

    def put(self, name: str, data: bytes) -> ObjectInfo:
        key = self.url.key(name)

        def put() -> ObjectInfo:
            reply = self._client.put_object(Bucket=self.url.bucket, Key=key, Body=data)
            return ObjectInfo(name, len(data), str(reply.get("ETag", "")).strip('"'))

        return self.call(str(self.url.child(name)), put)

    def writer(self, name: str) -> S3Writer:
        return S3Writer(self, name, part_bytes=self.part_bytes)

    def delete(self, names: Sequence[str]) -> None:
        keys = [self.url.key(n) for n in names]
        for begin in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": k} for k in keys[begin:begin + 1000]]
            reply = self.call(str(self.url), lambda b=batch: self._client.delete_objects(  # type: ignore[misc]
                Bucket=self.url.bucket, Delete={"Objects": b, "Quiet": True}))
            if reply.get("Errors"):
                first = reply["Errors"][0]
                raise StoreError(f"{self.url}: could not delete {first.get('Key')}: {first.get('Code')}")

    def pending_uploads(self) -> list[PendingUpload]:
        prefix = self.url.prefix + "/" if self.url.prefix else ""

        def listing() -> list[PendingUpload]:
            pages = self._client.get_paginator("list_multipart_uploads").paginate(Bucket=self.url.bucket,
                                                                                 Prefix=prefix)
            return [PendingUpload(self.url.relative(u["Key"]), u["UploadId"])
                    for page in pages for u in page.get("Uploads", []) if str(u.get("Key", "")).startswith(prefix)]

        return self.call(str(self.url), listing)

    def abort(self, upload: PendingUpload) -> None:
        key = self.url.key(upload.name)
        self.call(str(self.url.child(upload.name)), lambda: self._client.abort_multipart_upload(
            Bucket=self.url.bucket, Key=key, UploadId=upload.upload_id))

    @property
    def client(self) -> S3Client:
        """The boto3 client (for the writer in this package)."""
        return self._client

    def close(self) -> None:
        self.stop.set()
        self._client.close()

    def __enter__(self) -> S3Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
