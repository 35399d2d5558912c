"""What a checkpoint path names: a local path, a store URL, or an unknown scheme refused in one line.

The one place ``scheme://`` strings are parsed. ``s3://BUCKET/PREFIX`` names a folder in a bucket
(a prefix is a folder: shards, index, configs and subfolders under it). ``hf://`` is the Hub's
(parsed by :mod:`shardkit.stores.hf_spec`); any other ``scheme://`` is refused rather than taken
for a relative local folder named ``scheme:``.

>>> parse_store_url("s3://models/sd15/unet/")
StoreUrl(scheme='s3', bucket='models', prefix='sd15/unet')
>>> str(parse_store_url("s3://models")), parse_store_url("s3://models/a").key("b.json")
('s3://models', 'a/b.json')
>>> url_scheme("./s3:/models"), url_scheme("S3://models/x")
(None, 's3')
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TypeGuard

from ..errors import InvalidInputError

__all__ = ["STORE_SCHEMES", "SUPPORTED_SCHEMES", "StoreUrl", "check_local", "check_scheme", "has_control_characters",
           "is_store_url", "parse_store_url", "url_scheme"]

STORE_SCHEMES = ("s3",)  # object stores this package also writes (hf:// is read-only: published by push)
SUPPORTED_SCHEMES = ("hf", *STORE_SCHEMES)  # every scheme a checkpoint path may have
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# S3's bucket naming rules: 3-63 characters, lower-case letters, digits, dots and hyphens,
# beginning and ending with a letter or digit.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
MAX_KEY_BYTES = 1024  # S3's limit on an object key
# Schemes users reach for that boto3 does not speak: where the bytes can be reached instead.
_HINTS = {
    "gs": "for Google Cloud Storage use s3://BUCKET/PREFIX with AWS_ENDPOINT_URL=https://storage.googleapis.com "
          "and an HMAC key (untested, docs/s3.md)",
    "gcs": "for Google Cloud Storage use s3://BUCKET/PREFIX with AWS_ENDPOINT_URL=https://storage.googleapis.com "
           "and an HMAC key (untested, docs/s3.md)",
    "az": "Azure Blob Storage has no S3 API: mount the container (blobfuse2) and give the local path, "
          "or copy it with azcopy",
    "abfs": "Azure Blob Storage has no S3 API: mount the container (blobfuse2) and give the local path, "
            "or copy it with azcopy",
}


def has_control_characters(name: str) -> bool:
    """True for a name holding a C0 or C1 control character, DEL or a lone surrogate: a newline or an
    escape sequence that would be copied into an output or a terminal (never a name shardkit uses).

    >>> has_control_characters("unet/config.json"), has_control_characters("con\\nfig"), has_control_characters("\\x1b[31m")
    (False, True, True)
    """
    return any(ord(c) < 32 or 127 <= ord(c) < 160 or 0xD800 <= ord(c) <= 0xDFFF for c in name)


@dataclass(frozen=True)
class StoreUrl:
    """A parsed ``s3://BUCKET/PREFIX``: ``prefix`` has no leading or trailing ``/`` ("" is the bucket's root)."""

    scheme: str
    bucket: str
    prefix: str

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")

    def key(self, relative: str) -> str:
        """The object key of ``relative`` (a ``/``-separated path checked to stay under the prefix)."""
        parts = relative.split("/")
        if not relative or any(p in ("", ".", "..") for p in parts) or "\\" in relative or "\0" in relative:
            raise InvalidInputError(f"{self}: {relative!r} is not a plain relative path under the prefix")
        if has_control_characters(relative):
            raise InvalidInputError(f"{self}: {relative!r} has control characters; not a name under the prefix")
        key = f"{self.prefix}/{relative}" if self.prefix else relative
        if len(key.encode()) > MAX_KEY_BYTES:
            raise InvalidInputError(f"{self}: the key of {relative!r} is longer than {MAX_KEY_BYTES} bytes")
        return key

    def relative(self, key: str) -> str:
        """``key`` relative to the prefix (the inverse of :meth:`key`)."""
        return key[len(self.prefix) + 1:] if self.prefix else key

    def child(self, relative: str) -> StoreUrl:
        """The URL of a file or subfolder under this prefix."""
        return StoreUrl(self.scheme, self.bucket, self.key(relative))


def url_scheme(path: object) -> str | None:
    """The scheme of a ``scheme://...`` string (lower-cased), or None for anything else (a local path)."""
    if not isinstance(path, str):
        return None
    m = _SCHEME.match(path)
    return m.group(1).lower() if m else None


def check_scheme(path: object, *, role: str = "checkpoint path") -> None:
    """Refuse a ``scheme://`` this package does not read or write; local paths and supported schemes pass.

    >>> check_scheme("ftp://host/x", role="output")
    Traceback (most recent call last):
    ...
    shardkit.errors.InvalidInputError: ftp://host/x: unknown scheme ftp:// for an output; use a local path, hf://ORG/REPO or s3://BUCKET/PREFIX
    >>> check_scheme("gs://bucket/x")
    Traceback (most recent call last):
    ...
    shardkit.errors.InvalidInputError: gs://bucket/x: unknown scheme gs:// for a checkpoint path; for Google Cloud Storage use s3://BUCKET/PREFIX with AWS_ENDPOINT_URL=https://storage.googleapis.com and an HMAC key (untested, docs/s3.md)
    """
    scheme = url_scheme(os.fspath(path) if isinstance(path, os.PathLike) else path)
    if scheme is not None and scheme not in SUPPORTED_SCHEMES:
        hint = _HINTS.get(scheme, "use a local path, hf://ORG/REPO or s3://BUCKET/PREFIX")
        raise InvalidInputError(f"{path}: unknown scheme {scheme}:// for {_article(role)}; {hint}")


def check_local(path: object, *, role: str) -> None:
    """Refuse any ``scheme://`` where only a local path works (an unknown scheme, or one not wired in here).

    What keeps ``s3://models/up`` from being written as the local folder ``./s3:/models/up``.

    >>> check_local("s3://models/up", role="output")
    Traceback (most recent call last):
    ...
    shardkit.errors.InvalidInputError: s3://models/up: an s3:// output is not supported by this operation yet; use a local path
    """
    check_scheme(path, role=role)
    scheme = url_scheme(os.fspath(path) if isinstance(path, os.PathLike) else path)
    if scheme is not None:
        raise InvalidInputError(f"{path}: an {scheme}:// {role} is not supported by this operation yet; "
                                "use a local path")


def is_store_url(path: object) -> TypeGuard[str]:
    """True for a string naming a store this package writes into (``s3://...``): an output that is not a folder.

    Which locations are read as stores is :data:`shardkit.api.sources.LOCATIONS`' question (``is_remote``).
    """
    return url_scheme(path) in STORE_SCHEMES


def parse_store_url(text: str) -> StoreUrl:
    """Parse ``s3://BUCKET[/PREFIX]``; a bad bucket name or a prefix with ``.``/``..``/empty parts is refused."""
    scheme = url_scheme(text)
    if scheme not in STORE_SCHEMES:
        check_scheme(text)
        raise InvalidInputError(f"{text}: expected s3://BUCKET/PREFIX")
    body = text[len(scheme) + 3:]
    bucket, _, prefix = body.partition("/")
    prefix = prefix.strip("/")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise InvalidInputError(f"{text}: {bucket!r} is not a valid bucket name (3-63 characters: a-z, 0-9, '.', '-'); "
                                "expected s3://BUCKET/PREFIX")
    url = StoreUrl(scheme, bucket, "")
    if not prefix:
        return url
    try:
        return url.child(prefix)
    except InvalidInputError:
        raise InvalidInputError(f"{text}: the prefix must be a plain path (no '.', '..', '//' or '\\' parts); "
                                "expected s3://BUCKET/PREFIX") from None


def _article(role: str) -> str:
    return f"an {role}" if role[:1] in "aeiou" else f"a {role}"
