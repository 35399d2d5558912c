"""Checks a push can pass before any work starts: a valid repository id, a token the Hub accepts,
no symlink in the folder that the push would refuse.

``split --push-to`` used to find a missing token only after writing every shard, and
``push "not a repo"`` went to the network to learn what a regular expression knows.
"""

from __future__ import annotations

from ..errors import HubError, Option
from ..stores.hf_errors import hub_errors
from .commits import check_folder_links
from .push import check_repo_id, push_call

__all__ = ["check_folder_links", "check_push_target", "check_repo_id"]


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

    check_push_target("my-org/model")
    'hf_...'
    """
    check_repo_id(repo_id)
    from huggingface_hub import HfApi
    from huggingface_hub.utils import get_token

    resolved = token or get_token()
    if resolved is None:
        raise HubError("no Hugging Face token: pass ", Option("token"), ", set HF_TOKEN, or run `hf auth login` "
                       "(checked before splitting, so nothing was written)")
    with hub_errors(push_call(repo_id)):
        HfApi(token=resolved).whoami()
    return resolved
