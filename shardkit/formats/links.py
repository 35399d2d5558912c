"""Which symlinks shardkit follows: the one rule every reader and ``push`` apply to a folder's files.

A file in a checkpoint folder that is a symlink is followed only to a regular file inside the
folder, or into the ``blobs/`` of a Hugging Face cache: the cache repo whose ``snapshots/`` holds
the folder (the cache's own layout), or any cache repo folder (``models--org--name/blobs/``),
which ``hf download --local-dir`` and many user scripts link to. Anything else, e.g. a link a
downloaded repo planted towards ``~/.ssh``, a token or another project's weights, leads outside.
"""

from __future__ import annotations

import os
import re

__all__ = ["LINK_RULE", "leads_outside", "link_target"]

LINK_RULE = "shardkit follows such links only inside the folder or into a Hugging Face cache's blobs/"
_CACHE_REPO_RE = re.compile(r"^(models|datasets|spaces)--.+")


def link_target(path: str) -> str | None:
    """Where the symlink ``path`` finally leads (every link resolved), or None if it is not a symlink.

    link_target("ckpt/config.json")
    '/home/me/.cache/huggingface/hub/models--org--m/blobs/3c1e...'
    """
    return os.path.realpath(path) if os.path.islink(path) else None


def leads_outside(target: str, folder: str) -> bool:
    """Whether a link in ``folder`` resolving to ``target`` (a real path) leaves what shardkit trusts.

    >>> leads_outside("/data/ckpt/real.safetensors", "/data/ckpt")
    False
    >>> leads_outside("/home/me/.ssh/id_rsa", "/data/ckpt")
    True
    """
    return not (any(_inside(target, root) for root in _link_roots(folder)) or _in_cache_blobs(target))


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def _link_roots(folder: str) -> list[str]:
    """The folder itself, and ``<repo>/blobs`` for a folder inside an HF-cache snapshot."""
    real = os.path.realpath(folder)
    roots = [real]
    parts = os.path.abspath(folder).split(os.sep)
    if "snapshots" in parts:
        repo = os.sep.join(parts[: len(parts) - 1 - parts[::-1].index("snapshots")]) or os.sep
        roots.append(os.path.realpath(os.path.join(repo, "blobs")))
    return roots


def _in_cache_blobs(target: str) -> bool:
    """``<cache>/models--org--name/blobs/<blob>``: a file the Hugging Face cache holds."""
    blobs = os.path.dirname(target)
    return os.path.basename(blobs) == "blobs" and bool(_CACHE_REPO_RE.match(os.path.basename(os.path.dirname(blobs))))
