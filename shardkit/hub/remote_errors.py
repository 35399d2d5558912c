"""One-line errors for reads from the Hub (``hf://`` sources): access, missing things, the network."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..errors import HubError, ShardkitError, first_line

if TYPE_CHECKING:
    from .remote_spec import RemoteSpec

RETRIES = 3  # range reads: huggingface_hub's http_backoff tries this many times more


@contextlib.contextmanager
def hub_read_errors(spec: RemoteSpec) -> Iterator[None]:
    """Turn huggingface_hub / network exceptions while reading ``spec`` into one-line :class:`HubError`s."""
    try:
        yield
    except ShardkitError:
        raise
    except Exception as e:
        message = describe_read_error(e, spec)
        if message is None:
            raise
        raise HubError(message) from e


def describe_read_error(error: BaseException, spec: RemoteSpec) -> str | None:
    """A one-line explanation of a failed read from the Hub, or None if ``error`` is not one."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import httpx

    endpoint, rev = constants.ENDPOINT, spec.revision or "main"
    if isinstance(error, GatedRepoError):
        return (f"{spec}: {spec.repo_id} is gated and this token has no access; accept its terms on the Hub "
                "and pass token=... (or set HF_TOKEN, or run `hf auth login`)")
    if isinstance(error, RepositoryNotFoundError):
        return (f"{spec}: repository {spec.repo_id} not found at {endpoint}, or private and not visible with this "
                "token; check the name, or pass token=... (or set HF_TOKEN)")
    if isinstance(error, RevisionNotFoundError):
        return f"{spec}: revision {rev!r} not found in {spec.repo_id}; use a branch, tag or commit that exists"
    if isinstance(error, EntryNotFoundError):
        return (f"{spec}: no file {spec.subfolder!r} in {spec.repo_id} at {rev}; check the path "
                "(see the repository's file list)")
    if isinstance(error, HFValidationError):
        return f"{spec}: invalid repository id or revision: {first_line(error, limit=10_000)}"
    if isinstance(error, HfHubHTTPError) and error.response is not None:
        status = error.response.status_code
        if status == 401:
            return f"{spec}: authentication failed (401) at {endpoint}; pass a valid token=... or set HF_TOKEN"
        first = first_line(error.server_message or str(error), limit=10_000)
        return f"{spec}: the Hub answered {status} after {RETRIES} retries: {first}; try again later"
    if isinstance(error, (httpx.TransportError, ConnectionError, TimeoutError)):
        return (f"{spec}: network failure talking to {endpoint} (after {RETRIES} retries): "
                f"{error or type(error).__name__}; check the connection (or HF_ENDPOINT) and try again")
    return None
