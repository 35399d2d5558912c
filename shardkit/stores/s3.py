"""``s3://BUCKET/PREFIX`` through boto3: the AWS configuration users already have, one retry loop, errors in one line.

Credentials, region and endpoint come from botocore's own chain: ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` and ``~/.aws/config`` /
``credentials``, ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL`` /
``AWS_ENDPOINT_URL_S3`` (or ``endpoint_url`` in the profile) for any S3-compatible store. An
endpoint other than AWS's is addressed path-style (``http://host:port/BUCKET/KEY``), the way local
and self-hosted stores expect. Why boto3 and not obstore or s3fs: docs/s3.md (measured).

botocore's own retries are off (one attempt per call): :func:`~shardkit.stores.retry.call_with_retries`
retries a failed request or a body cut mid-read, with back-off and a bound; a stall is not retried.
Messages name the bucket, the key and the endpoint, never a credential.

A hostile or changing store (docs/reliability.md, "Object stores"): listings are bounded in pages
and entries (:mod:`.s3_listing`), and every ranged GET of an object carries ``If-Match`` with the
ETag its listing or HEAD gave, so the header and the data of one object come from one version.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from ..errors import StoreError
from .base import MAX_OBJECT_BYTES, PART_BYTES, ObjectInfo, PendingUpload
from .retry import RetryPolicy, call_with_retries
from .s3_client import make_client
from .s3_errors import CHANGED, is_transient, store_errors
from .s3_listing import bounded_pages, listed_object
from .s3_writer import S3Client, S3Writer
from .urls import StoreUrl, has_control_characters, parse_store_url

__all__ = ["S3Store", "open_s3"]

T = TypeVar("T")
MAX_LISTED_OBJECTS = 100_000  # a listing past this is no checkpoint folder: refused, not held in memory
MAX_PENDING_UPLOADS = 10_000  # open multipart uploads listed under a prefix (recover), every one counted
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
        self._etags: dict[str, str] = {}  # name -> the entity tag its reads are pinned to (If-Match)
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
        where = str(self.url.child(folder) if folder else self.url)
        found: list[ObjectInfo] = []

        def fetch(cursor: dict[str, str]) -> S3Client:
            return self.call(where, lambda: self._client.list_objects_v2(Bucket=self.url.bucket, Prefix=prefix, **cursor))

        def cursor(reply: S3Client) -> dict[str, str]:
            return {"ContinuationToken": str(reply.get("NextContinuationToken") or "")}

        for page in bounded_pages(where, fetch, cursor, "Contents", max_entries=MAX_LISTED_OBJECTS):
            found += [o for o in (listed_object(self.url, prefix, entry) for entry in page) if o is not None]
        self._pin(found)
        return sorted(found, key=lambda o: o.name)

    def _pin(self, objects: list[ObjectInfo]) -> None:
        """Remember each object's entity tag: every later ranged GET of it asks for that version (``If-Match``)."""
        for o in objects:
            if o.etag:
                self._etags[o.name] = o.etag
            else:
                self._etags.pop(o.name, None)

    def pinned_etag(self, name: str) -> str:
        """The entity tag every read of ``name`` is pinned to ("" where none was listed or stated)."""
        return self._etags.get(name, "")

    def stat(self, name: str) -> ObjectInfo:
        key = self.url.key(name)

        def head() -> ObjectInfo:
            reply = self._client.head_object(Bucket=self.url.bucket, Key=key)
            size = reply.get("ContentLength")
            if not isinstance(size, int) or size < 0 or size > MAX_OBJECT_BYTES:
                raise StoreError(f"{self.url.child(name)}: the store gave no valid size (Content-Length {size!r}; "
                                 f"an object holds 0 to {MAX_OBJECT_BYTES} bytes)")
            return ObjectInfo(name, size, str(reply.get("ETag", "")).strip('"'))

        info = self.call(str(self.url.child(name)), head)
        self._pin([info])
        return info

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        key = self.url.key(name)
        where = f"{self.url.child(name)} bytes {offset}-{offset + len(out) - 1}"
        etag = self._etags.get(name, "")
        self.call(where, lambda: self._get_into(key, etag, offset, out, where))

    def _get_into(self, key: str, etag: str, offset: int, out: memoryview, where: str) -> None:
        pinned = {"IfMatch": f'"{etag}"'} if etag else {}
        reply = self._client.get_object(Bucket=self.url.bucket, Key=key, Range=f"bytes={offset}-{offset + len(out) - 1}",
                                        **pinned)
        body = reply["Body"]
        try:
            answered = str(reply.get("ETag", "")).strip('"')
            if etag and answered and answered != etag:  # a store that ignores If-Match: the tag still tells
                raise StoreError(f"{where}: {CHANGED} (it was listed with ETag {etag!r}, the store now sends "
                                 f"{answered!r})")
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

    def download_command(self, name: str) -> str:
        return f"aws s3 cp {self.url.child(name)} ."

    def put(self, name: str, data: bytes) -> ObjectInfo:
        key = self.url.key(name)

        def put() -> ObjectInfo:
            reply = self._client.put_object(Bucket=self.url.bucket, Key=key, Body=data)
            return ObjectInfo(name, len(data), str(reply.get("ETag", "")).strip('"'))

        info = self.call(str(self.url.child(name)), put)
        self._pin([info])  # this process's own version from here on
        return info

    def writer(self, name: str) -> S3Writer:
        return S3Writer(self, name, part_bytes=self.part_bytes)

    def delete(self, names: Sequence[str]) -> None:
        keys = [self.url.key(n) for n in names]
        for name in names:
            self._etags.pop(name, None)
        for begin in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": k} for k in keys[begin:begin + 1000]]
            reply = self.call(str(self.url), functools.partial(
                self._client.delete_objects, Bucket=self.url.bucket, Delete={"Objects": batch, "Quiet": True}))
            if reply.get("Errors"):
                first = reply["Errors"][0]
                raise StoreError(f"{self.url}: could not delete {first.get('Key')}: {first.get('Code')}")

    def pending_uploads(self) -> list[PendingUpload]:
        prefix = self.url.prefix + "/" if self.url.prefix else ""
        where = f"{self.url} (multipart uploads)"

        def fetch(cursor: dict[str, str]) -> S3Client:
            return self.call(where, lambda: self._client.list_multipart_uploads(Bucket=self.url.bucket, Prefix=prefix,
                                                                                **cursor))

        def cursor(reply: S3Client) -> dict[str, str]:
            markers = {"KeyMarker": reply.get("NextKeyMarker"), "UploadIdMarker": reply.get("NextUploadIdMarker")}
            return {k: str(v) for k, v in markers.items() if v}  # an empty marker is left out, not sent

        found: list[PendingUpload] = []
        for page in bounded_pages(where, fetch, cursor, "Uploads", max_entries=MAX_PENDING_UPLOADS):
            found += [upload for upload in (self._pending(prefix, u) for u in page) if upload is not None]
        return found

    def _pending(self, prefix: str, entry: S3Client) -> PendingUpload | None:
        """One listed upload under the prefix (its key and id checked), or None for one outside it."""
        key, upload_id = (entry.get("Key"), entry.get("UploadId")) if isinstance(entry, dict) else (None, None)
        if not isinstance(key, str) or not isinstance(upload_id, str) or not upload_id:
            raise StoreError(f"{self.url}: the store listed a multipart upload without a valid key or upload id")
        if not key.startswith(prefix) or has_control_characters(key):
            return None  # not ours: recover aborts only uploads a journal names
        return PendingUpload(self.url.relative(key), upload_id)

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
