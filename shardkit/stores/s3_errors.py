"""What an S3 failure means, in one line naming the bucket, key and endpoint (never a credential).

Wrong or missing credentials, a missing bucket or object, an unreachable endpoint: each becomes one
:class:`~shardkit.errors.ShardkitError` (exit 2) saying what, where and the fix. :func:`is_transient`
says which failures the retry loop tries again (5xx, throttling, reset or cut connections).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ..errors import ShardkitError, SourceNotFoundError, StoreError

__all__ = ["CHANGED", "CONNECT_TIMEOUT_S", "READ_TIMEOUT_S", "describe_client_error", "is_stall", "is_transient", "store_errors"]

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 15.0  # no byte for this long is a stall: one line, not retried (a retry would wait it again)
CREDENTIAL_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
                    "TokenRefreshRequired", "AuthorizationHeaderMalformed", "InvalidSecurity"}
DENIED_CODES = {"AccessDenied", "403", "AllAccessDisabled", "AccountProblem"}
MISSING_BUCKET_CODES = {"NoSuchBucket"}
MISSING_KEY_CODES = {"NoSuchKey", "404", "NotFound", "NoSuchUpload"}
CHANGED_CODES = {"PreconditionFailed", "412"}  # If-Match on the listed ETag failed: the object was replaced
CHANGED = ("the object changed while it was being read (its ETag is not the one listed: it was replaced or "
           "rewritten); nothing was written from the mixed versions: run the command again once the upload is done")
TRANSIENT_CODES = {"SlowDown", "RequestTimeout", "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable",
                   "Throttling", "ThrottlingException", "RequestLimitExceeded", "503", "500", "502", "504"}
FIX_CREDENTIALS = ("check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE and ~/.aws/credentials) "
                   "for this endpoint")


def _code(e: BaseException) -> str:
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        error = response.get("Error") or {}
        code = error.get("Code") if isinstance(error, dict) else None
        if code:
            return str(code)
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        if status:
            return str(status)
    return ""


def is_stall(e: BaseException) -> bool:
    """True for a request that timed out: no byte of a reply (or no connection) for the client's timeout.

    A stall is not retried: each try would wait the whole timeout again, multiplying it.
    """
    if isinstance(e, TimeoutError):  # socket.timeout included
        return True
    try:
        from botocore.exceptions import ConnectTimeoutError, ReadTimeoutError
        from urllib3.exceptions import TimeoutError as Urllib3TimeoutError
    except ImportError:  # pragma: no cover - boto3 is what raised e
        return False
    return isinstance(e, (ConnectTimeoutError, ReadTimeoutError, Urllib3TimeoutError))


def is_transient(e: BaseException) -> bool:
    """True for a failure worth retrying: a 5xx or throttling reply, a reset, refused or cut connection
    (a stall is not: see :func:`is_stall`)."""
    if isinstance(e, ShardkitError) or is_stall(e):
        return False
    code = _code(e)
    if code:
        return code in TRANSIENT_CODES or code.startswith("5")
    try:
        from botocore.exceptions import (
            ConnectionError as BotoConnectionError,
        )
        from botocore.exceptions import (
            IncompleteReadError,
            ReadTimeoutError,
            ResponseStreamingError,
        )
        from urllib3.exceptions import HTTPError as Urllib3Error
    except ImportError:  # pragma: no cover - boto3 is what raised e
        return isinstance(e, (ConnectionError, TimeoutError))
    return isinstance(e, (BotoConnectionError, IncompleteReadError, ReadTimeoutError, ResponseStreamingError,
                          Urllib3Error, ConnectionError, TimeoutError))


def describe_client_error(e: BaseException) -> str:
    """A short reason for a botocore failure: its error code, or its class and message (never a secret)."""
    code = _code(e)
    if code:
        message = (getattr(e, "response", {}).get("Error") or {}).get("Message") or ""
        return f"{code}" + (f" ({message})" if message and message != code else "")
    return f"{type(e).__name__}: {e}"


def _translate(e: BaseException, where: str, endpoint: str, bucket: str) -> ShardkitError:
    code = _code(e)
    name = type(e).__name__
    if code in CREDENTIAL_CODES:
        return StoreError(f"{where}: the store at {endpoint} refused the credentials ({code}); {FIX_CREDENTIALS}")
    if code in DENIED_CODES:
        return StoreError(f"{where}: access denied by the store at {endpoint} ({code}): wrong credentials, or "
                          f"they lack permission for this bucket; {FIX_CREDENTIALS}")
    if code in MISSING_BUCKET_CODES or (code in MISSING_KEY_CODES and where == f"s3://{bucket}"):
        return SourceNotFoundError(f"s3://{bucket}: no such bucket at {endpoint}; check the bucket name "
                                   "(and AWS_ENDPOINT_URL)")
    if code in MISSING_KEY_CODES:
        return SourceNotFoundError(f"{where}: no such object")
    if code in CHANGED_CODES:
        return StoreError(f"{where}: {CHANGED}")
    if name == "ConnectTimeoutError":
        return StoreError(f"{where}: cannot reach the store at {endpoint} (no connection within {CONNECT_TIMEOUT_S:g} s); "
                          "check AWS_ENDPOINT_URL and the network")
    if is_stall(e):
        return StoreError(f"{where}: the store at {endpoint} stalled (nothing arrived for {READ_TIMEOUT_S:g} s); "
                          "check the endpoint and the network, then run the command again")
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        return StoreError(f"{where}: no AWS credentials found ({e}); set AWS_ACCESS_KEY_ID and "
                          "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE")
    if name in ("EndpointConnectionError", "ConnectionClosedError"):
        return StoreError(f"{where}: cannot reach the store at {endpoint} ({name}); check AWS_ENDPOINT_URL "
                          "and the network")
    return StoreError(f"{where}: the request failed at {endpoint}: {describe_client_error(e)}")


@contextlib.contextmanager
def store_errors(where: str, *, endpoint: str, bucket: str) -> Iterator[None]:
    """Raise a store failure inside as one ShardkitError line (a ShardkitError passes unchanged)."""
    try:
        yield
    except ShardkitError:
        raise
    except Exception as e:
        if not _is_client_failure(e):
            raise
        raise _translate(e, where, endpoint, bucket) from e


def _is_client_failure(e: BaseException) -> bool:
    if isinstance(e, (OSError, ConnectionError, TimeoutError)):
        return True
    module = type(e).__module__
    return module.startswith(("botocore", "boto3", "urllib3", "s3transfer"))
