"""Digests a push already knows, so no file is hashed twice (or at all, when the manifest vouches for it).

A push needs the sha256 of each LFS file twice over: to compare with the remote tree, and to
upload it (huggingface_hub hashes lazily when it is not given one). ``verify`` reads every byte
anyway, and a shardkit manifest records every file's sha256; this module hands those over.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from .commits import LocalFile

if TYPE_CHECKING:
    from ..checking.verify import VerifyReport

__all__ = ["known_digests"]


def known_digests(path: str | os.PathLike[str], files: list[LocalFile], *, report: VerifyReport | None = None) -> dict[str, str]:
    """sha256 of the files to push that need no second read, by path in the repo.

    With a verify ``report``, its digests: verify just read every byte (and checked them
    against the manifest), so nothing is hashed twice. Without one (``--no-verify``), the
    manifest's sha256 is taken for a file whose size matches its record and whose mtime is not
    newer than the manifest's: shardkit writes every file before the manifest, and an edit, a
    plain ``cp`` or a rewrite makes the file newer. What this cannot see: a file replaced by one
    of the same size with its timestamp set back (``touch -d``, ``cp -p`` of an older file), or
    bit rot, which changes no timestamp; the Hub then stores the file under a digest it does
    not have (LFS uploads are checked by the server) — which is why verification is the default.

    Args:
        path: the pushed folder or file.
        files: the files to push.
        report: the :class:`~shardkit.checking.verify.VerifyReport` of ``path``, if it was verified.

    Returns:
        ``{path_in_repo: sha256 hex}`` for the files whose digest is known.

    known_digests("out/", collect_files("out/"))
    {'model-00001-of-00002.safetensors': '9f2c...', ...}
    """
    root = os.fspath(path) if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    by_local = {os.path.abspath(f.local_path): f for f in files}
    known: dict[str, str] = {}
    if report is not None:
        for checked in report.files:
            f = by_local.get(os.path.abspath(os.path.join(root, checked.name)))
            if f is not None and checked.bytes == f.size_bytes:
                known[f.path_in_repo] = checked.sha256
        return known
    for local, sha256 in _unchanged_since_manifest(root).items():
        f = by_local.get(local)
        if f is not None:
            known[f.path_in_repo] = sha256
    return known


def _unchanged_since_manifest(root: str) -> dict[str, str]:
    """``{absolute path: sha256}`` of files under ``root`` that the manifests there still describe."""
    from ..formats.manifest import MANIFEST_NAME, ManifestError, read_manifest

    found: dict[str, str] = {}
    folders = [root] + [os.path.join(root, d) for d in sorted(os.listdir(root)) if os.path.isdir(os.path.join(root, d))]
    for folder in folders:  # the top one first: a component's own manifest is newer for its files
        try:
            manifest = read_manifest(folder)
        except ManifestError:
            continue  # unreadable: hash the files instead
        if manifest is None:
            continue
        written_ns = os.stat(os.path.join(folder, MANIFEST_NAME)).st_mtime_ns
        for name, record in manifest.files.items():
            local = os.path.abspath(os.path.join(folder, name))
            try:
                st = os.stat(local)
            except OSError:
                continue
            if st.st_size == record.size_bytes and st.st_mtime_ns <= written_ns and record.sha256 is not None:
                found[local] = record.sha256  # shards carry crc32s only: push hashes them itself
            else:
                found.pop(local, None)
    return found
