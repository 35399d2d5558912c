"""Checks a push can pass before any work starts: a valid repository id, a token the Hub accepts.

``split --push-to`` used to find a missing token only after writing every shard, and
``push "not a repo"`` went to the network to learn what a regular expression knows.
"""

from __future__ import annotations

from ..errors import HubError, InvalidInputError


def check_repo_id(repo_id: str) -> None:
    """Refuse a repository id the Hub would refuse, without a network call.

    Args:
        repo_id: ``"org/name"`` or a bare ``"name"`` (the token owner's namespace).

    Raises:
        InvalidInputError: the id is not a valid repository id; the message says why.

    >>> check_repo_id("my-org/model")
    >>> check_repo_id("not a repo")
    Traceback (most recent call last):
    shardkit.errors.InvalidInputError: 'not a repo' is not a valid Hub repository id ...
    """
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        reason = " ".join(str(e).split())
        raise InvalidInputError(f"{repo_id!r} is not a valid Hub repository id ({reason}); use 'org/name' with "
                                "letters, digits, '-', '_' and '.'") from e


def check_push_target(repo_id: str, *, token: str | None = None) -> str:
    """Check the repository id and that the Hub accepts the token, before a long job.

    Args:
        repo_id: the repository a later push goes to.
        token: the token to use; default ``HF_TOKEN`` or the stored login.

    Returns:
        The token that was checked.

    Raises:
        InvalidInputError: the repository id is invalid.
        HubError: there is no token, the Hub rejected it, or the Hub could not be reached.

    >>> check_push_target("my-org/model")   # doctest: +SKIP
    'hf_...'
    """
    check_repo_id(repo_id)
    from huggingface_hub import HfApi
    from huggingface_hub.utils import get_token

    from .push import hub_errors

    resolved = token or get_token()
    if resolved is None:
        raise HubError("no Hugging Face token: pass --token, set HF_TOKEN, or run `hf auth login` "
                       "(checked before splitting, so nothing was written)")
    with hub_errors(repo_id, "main"):
        HfApi(token=resolved).whoami()
    return resolved
