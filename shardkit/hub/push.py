"""``push``: publish a verified checkpoint folder to the Hugging Face Hub, never half-visible.

The steps: list the local files (``include``/``exclude``), refuse files over the Hub's 50 GB
limit, verify the checkpoint, create the repository (and branch) if missing, compare with the
remote tree (sha256 of LFS files, git blob id of small ones) so identical files are not sent,
then upload and commit with huggingface_hub.

Why it never exposes a broken state: a push is one commit whenever it has at most
``push_plan.MAX_FILES_PER_COMMIT`` (100) operations, and a commit is atomic on the Hub. A larger push first
commits only files that are new paths (no visible index can name them), a batch at a time;
the last commit carries every index file, every changed file and the deletions of stale
shards. An interrupted push, run again, skips what was committed (identical remote files) and
what was uploaded but not committed (the LFS batch API and Xet deduplication answer that the
server already has it).

Stale files: when the pushed folder holds a complete checkpoint (its index or single file),
remote files of the same checkpoint family (same folder, prefix and variant) that the folder no
longer has are deleted in the last commit, so a new index never sits beside an old single file
that transformers would load instead.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO

from ..checking.refusal import refuse_broken, verify_folder
from ..errors import HubError, InvalidInputError, Option
from ..stores.hf_errors import HubCall, hub_errors, is_network_failure
from ..units import ByteCounter
from .commits import (
    FollowedLink,
    LocalFile,
    RemoteFile,
    check_links,
    check_sizes,
    clean_prefix,
    collect_files,
    open_upload,
    plan_commits,
    split_changed,
    stale_files,
    store_files,
)
from .known import known_digests
from .options import PushOptions

SMALL_OBJECT_BYTES = 10 << 20  # a store object up to this size is read whole and sent as bytes (Xet can take it)

__all__ = ["PushOptions", "PushResult", "check_repo_id", "push", "push_call", "push_objects"]

if TYPE_CHECKING:
    from ..checking.verify import VerifyReport
    from ..stores.base import ObjectStore


@dataclass
class PushResult:
    """What a push did (or, with ``dry_run``, would do)."""

    repo_id: str
    repo_type: str
    revision: str
    repo_url: str
    commit_url: str | None = None
    pr_url: str | None = None
    commits: list[str] = field(default_factory=list)
    uploaded: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    uploaded_bytes: int = 0
    dry_run: bool = False
    created_repo: bool = False
    created_branch: bool = False
    offline: str | None = None  # a dry run that could not reach the Hub: why (every file is listed as an upload)
    links: list[FollowedLink] = field(default_factory=list)  # every symlink followed (outside: --follow-symlinks)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def push(path: str | os.PathLike[str], repo_id: str, options: PushOptions | None = None) -> PushResult:
    """Upload a checkpoint folder (or file) to ``repo_id``; identical remote files are not sent again.

    The folder is verified first (``verify=False`` skips it); a quantized weight whose scales or
    quantization config are missing, misshapen or non-finite is refused unless ``allow_lossy``.
    A file that is a symlink leading outside the folder (other than into a Hugging Face cache's
    ``blobs/``) is refused before anything is sent, unless ``follow_symlinks``; links to folders
    are never followed. ``result.links`` lists every symlink followed. The options: :class:`PushOptions`.

    result = push("out/", "my-org/model", PushOptions(private=True))
    result.commit_url
    'https://huggingface.co/my-org/model/commit/4f1c...'
    """
    options = options or PushOptions()
    check_repo_id(repo_id)
    include, exclude = options.globs()
    files = collect_files(path, path_in_repo=options.path_in_repo, include=include, exclude=exclude)
    links = check_links(path, files, follow=options.follow_symlinks)
    check_sizes(files)
    report = verify_folder(path, allow_lossy=options.allow_lossy) if options.verify else None
    return _push_files(files, repo_id, options, links=links, known=known_digests(path, files, report=report))


def push_objects(store: ObjectStore, repo_id: str, options: PushOptions | None = None, *,
                 report: VerifyReport | None) -> PushResult:
    """Upload the objects in a store's folder (``s3://BUCKET/PREFIX``, ``hf://...``) to ``repo_id``, with no local copy.

    Each object is read by ranged reads as it is hashed and sent (twice in all for an LFS file: the
    Hub wants its sha256 before its bytes); configs and indexes are read once, whole. ``report``
    is the checkpoint's verification (its structure, from the header-only mirror; None skips it),
    refused as :func:`push` refuses a broken folder. The options are as for :func:`push`
    (``follow_symlinks`` does not apply); the commit comes after every upload, so a failure (a read,
    an upload) leaves no commit.
    """
    from .store_files import collect_store_files

    options = options or PushOptions()
    check_repo_id(repo_id)
    include, exclude = options.globs()
    files = store_files(store, collect_store_files(store, include=include, exclude=exclude),
                        path_in_repo=options.path_in_repo)
    check_sizes(files)
    if report is not None:
        refuse_broken(report, str(store.url), allow_lossy=options.allow_lossy)
    return _push_files(files, repo_id, options, links=[], known={})


def _push_files(files: list[LocalFile], repo_id: str, options: PushOptions, *, links: list[FollowedLink],
                known: dict[str, str]) -> PushResult:
    try:
        with hub_errors(push_call(repo_id, options.revision)):
            pusher = _Pusher(repo_id, options)
            pusher.result.links = links
            return pusher.run(files, prefix=clean_prefix(options.path_in_repo), known=known)
    except HubError as e:
        if not (options.dry_run and is_network_failure(e)):
            raise
        # Offline, a dry run still shows the local half of the plan: what would be sent.
        from huggingface_hub import constants

        return PushResult(repo_id, options.repo_type, options.revision or "main", "", dry_run=True,
                          offline=f"{constants.ENDPOINT} not reachable", links=links,
                          uploaded=[f.path_in_repo for f in files], uploaded_bytes=sum(f.size_bytes for f in files))


def push_call(repo_id: str, revision: str | None = None) -> HubCall:
    """A push to ``repo_id`` at ``revision``, as the error translator names it."""
    return HubCall("push", repo_id, revision or "main")


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


# ----------------------------------------------------------------------------- remote side

class _Pusher:
    """One push: the API client, the target, and the running result."""

    def __init__(self, repo_id: str, options: PushOptions) -> None:
        from huggingface_hub import HfApi
        from huggingface_hub.utils import get_token

        self.token = options.token or get_token()
        if self.token is None and not options.dry_run:
            raise HubError("no Hugging Face token: pass ", Option("token"), ", set HF_TOKEN, or run `hf auth login`")
        self.api = HfApi(token=self.token)
        self.options = options
        self.repo_id, self.repo_type, self.private = repo_id, options.repo_type, options.private
        self.revision, self.create_pr, self.dry_run = options.revision, options.create_pr, options.dry_run
        self.result = PushResult(repo_id, self.repo_type, self.revision or "main", "", dry_run=self.dry_run)
        self._name_repo(repo_id)

    def run(self, files: list[LocalFile], *, prefix: str, known: dict[str, str] | None = None) -> PushResult:
        head = self._prepare_target()
        remote = self._remote_files(head, prefix) if head else {}
        digests: dict[str, str] = dict(known or {})  # not hashed again, neither here nor by the upload
        upload, same = split_changed(files, remote, digests)
        deletions = stale_files(files, remote)
        res = self.result
        res.uploaded = [f.path_in_repo for f in upload]
        res.unchanged = [f.path_in_repo for f in same]
        res.deleted = deletions
        res.uploaded_bytes = sum(f.size_bytes for f in upload)
        if self.dry_run:
            return res
        if not upload and not deletions:
            res.commit_url = f"{res.repo_url}/commit/{head}"
            return res
        message = self.options.message or f"Upload {len(upload)} file(s) with shardkit"
        sent = ByteCounter(res.uploaded_bytes, self.options.progress)
        sent(0)
        parent = head
        groups = plan_commits(upload, deletions, remote)
        for number, (group, deleted) in enumerate(groups, 1):
            title = message if len(groups) == 1 else f"{message} ({number}/{len(groups)})"
            parent = self._commit(group, deleted, digests, title=title, parent=parent, sent=sent)
        return res

    def _prepare_target(self) -> str | None:
        """Create the repo and branch if missing (not in a dry run); the head commit, or None if none."""
        from huggingface_hub.errors import (
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        if not self.dry_run:
            url = self.api.create_repo(self.repo_id, repo_type=self.repo_type, private=self.private, exist_ok=True)
            self._name_repo(url.repo_id)
        elif "/" not in self.repo_id:  # a bare name lives in the token owner's namespace
            self._name_repo(f"{self.api.whoami()['name']}/{self.repo_id}")
        try:
            return self._head()
        except RepositoryNotFoundError:
            if not self.dry_run:
                raise
            self.result.created_repo = True
            return None
        except RevisionNotFoundError:
            if self.create_pr:
                raise
            self.result.created_branch = True
            if self.dry_run:
                return None
            self.api.create_branch(self.repo_id, branch=self.result.revision, repo_type=self.repo_type)
            return self._head()

    def _name_repo(self, repo_id: str) -> None:
        prefix = "" if self.repo_type == "model" else f"{self.repo_type}s/"
        self.repo_id = self.result.repo_id = repo_id
        self.result.repo_url = f"{self.api.endpoint}/{prefix}{repo_id}"

    def _head(self) -> str:
        info = self.api.repo_info(self.repo_id, repo_type=self.repo_type, revision=self.result.revision)
        return str(info.sha)

    def _remote_files(self, head: str, prefix: str) -> dict[str, RemoteFile]:
        from huggingface_hub.errors import RemoteEntryNotFoundError
        from huggingface_hub.hf_api import RepoFile

        try:
            entries = list(self.api.list_repo_tree(self.repo_id, path_in_repo=prefix.rstrip("/") or None,
                                                   recursive=True, revision=head, repo_type=self.repo_type))
        except RemoteEntryNotFoundError:  # the prefix folder does not exist yet
            return {}
        return {e.path: RemoteFile(e.size, e.blob_id, e.lfs.sha256 if e.lfs else None)
                for e in entries if isinstance(e, RepoFile)}

    def _commit(self, group: list[LocalFile], deleted: list[str], digests: dict[str, str], *, title: str,
                parent: str | None, sent: ByteCounter) -> str:
        """Upload a group's contents one file at a time, then commit it; returns the new head."""
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        revision = self.revision
        additions = []
        with contextlib.ExitStack() as opened:  # every upload reads the descriptor checked when it was opened
            for f in group:
                op = CommitOperationAdd(path_in_repo=f.path_in_repo, path_or_fileobj=_upload_source(f, opened))
                if f.path_in_repo in digests:  # already hashed while comparing
                    op.upload_info.sha256 = bytes.fromhex(digests[f.path_in_repo])
                self.api.preupload_lfs_files(self.repo_id, additions=[op], repo_type=self.repo_type,
                                             revision=revision, create_pr=self.create_pr, free_memory=False)
                additions.append(op)
                sent(f.size_bytes)
            operations: list[Any] = [*additions, *(CommitOperationDelete(path_in_repo=p) for p in deleted)]
            info = self.api.create_commit(self.repo_id, operations, commit_message=title, repo_type=self.repo_type,
                                          revision=revision, create_pr=self.create_pr, parent_commit=parent)
        res = self.result
        res.commit_url = info.commit_url
        res.commits.append(info.oid)
        if info.pr_url is not None:  # later commits go to the pull request's ref
            res.pr_url, self.revision, self.create_pr = info.pr_url, info.pr_revision, False
            res.revision = str(info.pr_revision)
        return str(info.oid)


def _upload_source(f: LocalFile, opened: contextlib.ExitStack) -> str | bytes | BinaryIO:
    """What huggingface_hub reads for ``f``: a local file's checked descriptor, a store object's bytes
    (small) or its ranged-GET stream (large; huggingface_hub sends a stream by the LFS protocol)."""
    fileobj = opened.enter_context(open_upload(f))
    if f.store is None:  # /proc/self/fd/N is the checked file itself: a path swapped since cannot change what is sent
        return f"/proc/self/fd/{fileobj.fileno()}"
    if f.size_bytes <= SMALL_OBJECT_BYTES:
        data = fileobj.read()
        if len(data) != f.size_bytes:
            raise HubError(f"{f.local_path}: read {len(data)} bytes of {f.size_bytes}; the object changed during the push")
        return data
    return fileobj
