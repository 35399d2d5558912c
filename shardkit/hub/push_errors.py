"""One-line messages for failed Hub calls of a push: authentication, permissions, conflicts, the network."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ..errors import HubError, first_line

__all__ = ["describe_hub_error", "hub_errors", "is_network_failure"]


def is_network_failure(error: BaseException) -> bool:
    from huggingface_hub.utils import httpx

    return any(isinstance(e, (httpx.TransportError, ConnectionError, TimeoutError)) for e in _chain(error))


@contextlib.contextmanager
def hub_errors(repo_id: str, revision: str) -> Iterator[None]:
    """Turn huggingface_hub / network exceptions into one-line :class:`HubError` messages."""
    try:
        yield
    except HubError:
        raise
    except Exception as e:
        message = describe_hub_error(e, repo_id, revision)
        if message is None:
            raise
        raise HubError(message) from e


def describe_hub_error(error: BaseException, repo_id: str, revision: str) -> str | None:
    """A one-line explanation of a failed Hub call, or None if ``error`` is not one."""
    # utils.httpx: the HTTP client module huggingface_hub itself uses (httpx2 in 2.x); importing it
    # from there means shardkit never imports a package it does not declare.
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        HfHubHTTPError,
        HFValidationError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import httpx

    endpoint = constants.ENDPOINT
    for e in _chain(error):
        if isinstance(e, HFValidationError):
            return f"invalid repository id or revision for {repo_id!r}: {first_line(e, limit=10_000)}"
        if isinstance(e, RevisionNotFoundError):
            return (f"revision {revision!r} not found in {repo_id}; a pull request needs an existing branch "
                    f"(push it first without create_pr=True)")
        if isinstance(e, HfHubHTTPError) and e.response is not None:
            status = e.response.status_code
            detail = e.server_message or e.response.headers.get("X-Error-Message") or ""
            if status == 401:
                return (f"authentication failed (401) at {endpoint}: the token was rejected; pass a valid token=..., "
                        f"set HF_TOKEN, or run `hf auth login`")
            if status == 403:
                return f"no permission to write to {repo_id} (403): {detail or 'use a token with write access'}"
            if isinstance(e, RepositoryNotFoundError):
                return f"repository {repo_id} not found at {endpoint}, or not visible with this token"
            if status == 412:
                return f"{repo_id}@{revision} changed while pushing; run the push again"
            first = first_line(detail or str(e), limit=10_000)
            if status >= 500 or status in (408, 429):
                return (f"the Hub failed ({status}) for {repo_id}: {first}; run the push again to resume "
                        f"(what already arrived is not sent again)")
            return f"the Hub answered {status} for {repo_id}: {first}"
        if isinstance(e, (httpx.TransportError, ConnectionError, TimeoutError)):
            return (f"network failure talking to {endpoint}: {e or type(e).__name__}; check the connection "
                    f"(or HF_ENDPOINT) and run the push again to resume")
    text = str(error).strip().splitlines()
    if type(error).__module__.startswith(("huggingface_hub", "hf_xet")) or "hf_xet" in repr(type(error)):
        return f"upload to {repo_id} failed: {text[0] if text else type(error).__name__}"
    return None


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__
