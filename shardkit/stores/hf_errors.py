"""One translator for failed Hub calls: huggingface_hub's and the network's exceptions, keyed by type, as one line.

The operation is an argument: a read (an ``hf://`` source: the message names the spec and says how to
reach it) and a push (the message names the repository and says how to resume) fail on the same
exceptions, and :func:`_rules` holds one entry per exception type for both, the more specific first
(huggingface_hub's errors inherit from several of them); the causes of an exception are tried in turn.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal, TypeAlias

from ..errors import HubError, Option, Part, ShardkitError, first_line

__all__ = ["RETRIES", "HubCall", "Operation", "describe_hub_error", "hub_errors", "is_network_failure"]

RETRIES = 3  # range reads: huggingface_hub's http_backoff tries this many times more
Operation = Literal["read", "push"]
Message: TypeAlias = tuple[Part, ...]  # a message's parts (ShardkitError)


@dataclass(frozen=True)
class HubCall:
    """What was asked of the Hub: ``operation`` on ``repo_id`` at ``revision``; ``shown`` names it in a
    read's message (the ``hf://`` spec), ``subfolder`` is the path a read asked for."""

    operation: Operation
    repo_id: str
    revision: str = "main"
    shown: str = ""
    subfolder: str = ""


@contextlib.contextmanager
def hub_errors(call: HubCall) -> Iterator[None]:
    """Turn huggingface_hub / network exceptions raised inside into one-line :class:`HubError`s."""
    try:
        yield
    except ShardkitError:
        raise
    except Exception as e:
        message = describe_hub_error(e, call)
        if message is None:
            raise
        raise HubError(*message) from e


def describe_hub_error(error: BaseException, call: HubCall) -> Message | None:
    """A one-line explanation of a failed Hub call, or None if ``error`` is not one."""
    rules = _rules()
    for e in _chain(error):
        for kind, rule in rules.items():
            message = rule(e, call) if isinstance(e, kind) else None
            if message is not None:
                return message
    text = str(error).strip().splitlines()
    if call.operation == "push" and (type(error).__module__.startswith(("huggingface_hub", "hf_xet"))
                                     or "hf_xet" in repr(type(error))):
        return (f"upload to {call.repo_id} failed: {text[0] if text else type(error).__name__}",)
    return None


def is_network_failure(error: BaseException) -> bool:
    from huggingface_hub.utils import httpx

    return any(isinstance(e, (httpx.TransportError, ConnectionError, TimeoutError)) for e in _chain(error))


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _invalid(e: BaseException, call: HubCall) -> Message:
    if call.operation == "read":
        return (f"{call.shown}: invalid repository id or revision: {first_line(e, limit=10_000)}",)
    return (f"invalid repository id or revision for {call.repo_id!r}: {first_line(e, limit=10_000)}",)


def _gated(e: BaseException, call: HubCall) -> Message | None:
    if call.operation == "push":
        return _http(e, call)
    return (f"{call.shown}: {call.repo_id} is gated and this token has no access; accept its terms on the Hub "
            "and pass ", Option("token"), " (or set HF_TOKEN, or run `hf auth login`)")


def _repo_not_found(e: BaseException, call: HubCall) -> Message | None:
    if call.operation == "push":
        return _http(e, call)
    return (f"{call.shown}: repository {call.repo_id} not found at {_endpoint()}, or private and not visible with "
            "this token; check the name, or pass ", Option("token"), " (or set HF_TOKEN)")


def _revision_not_found(e: BaseException, call: HubCall) -> Message:
    if call.operation == "push":
        return (f"revision {call.revision!r} not found in {call.repo_id}; a pull request needs an existing branch "
                "(push it first without ", Option("create_pr", True), ")")
    return (f"{call.shown}: revision {call.revision!r} not found in {call.repo_id}; use a branch, tag or commit that "
            "exists",)


def _entry_not_found(e: BaseException, call: HubCall) -> Message | None:
    if call.operation == "push":
        return _http(e, call)
    return (f"{call.shown}: no file {call.subfolder!r} in {call.repo_id} at {call.revision}; check the path "
            "(see the repository's file list)",)


def _http(e: BaseException, call: HubCall) -> Message | None:
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    response = getattr(e, "response", None)
    if not isinstance(e, HfHubHTTPError) or response is None:
        return None
    status, endpoint = response.status_code, _endpoint()
    if call.operation == "read":
        if status == 401:
            return (f"{call.shown}: authentication failed (401) at {endpoint}; pass a valid ", Option("token"),
                    " or set HF_TOKEN")
        first = first_line(e.server_message or str(e), limit=10_000)
        return (f"{call.shown}: the Hub answered {status} after {RETRIES} retries: {first}; try again later",)
    detail = e.server_message or response.headers.get("X-Error-Message") or ""
    if status == 401:
        return (f"authentication failed (401) at {endpoint}: the token was rejected; pass a valid ", Option("token"),
                ", set HF_TOKEN, or run `hf auth login`")
    if status == 403:
        return (f"no permission to write to {call.repo_id} (403): {detail or 'use a token with write access'}",)
    if isinstance(e, RepositoryNotFoundError):
        return (f"repository {call.repo_id} not found at {endpoint}, or not visible with this token",)
    if status == 412:
        return (f"{call.repo_id}@{call.revision} changed while pushing; run the push again",)
    first = first_line(detail or str(e), limit=10_000)
    if status >= 500 or status in (408, 429):
        return (f"the Hub failed ({status}) for {call.repo_id}: {first}; run the push again to resume "
                f"(what already arrived is not sent again)",)
    return (f"the Hub answered {status} for {call.repo_id}: {first}",)


def _network(e: BaseException, call: HubCall) -> Message:
    if call.operation == "read":
        return (f"{call.shown}: network failure talking to {_endpoint()} (after {RETRIES} retries): "
                f"{e or type(e).__name__}; check the connection (or HF_ENDPOINT) and try again",)
    return (f"network failure talking to {_endpoint()}: {e or type(e).__name__}; check the connection "
            f"(or HF_ENDPOINT) and run the push again to resume",)


def _rules() -> dict[type, Callable[[BaseException, HubCall], Message | None]]:
    """Exception type → its message, the first that matches answers (huggingface_hub is imported only
    when a call failed)."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import httpx

    return {HFValidationError: _invalid, GatedRepoError: _gated, RepositoryNotFoundError: _repo_not_found,
            RevisionNotFoundError: _revision_not_found, EntryNotFoundError: _entry_not_found, HfHubHTTPError: _http,
            httpx.TransportError: _network, ConnectionError: _network, TimeoutError: _network}


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__
