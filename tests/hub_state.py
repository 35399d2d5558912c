"""The offline Hub's storage: repositories, commits, refs, LFS objects, Xet files, tokens, faults.

Everything :mod:`hub_server` serves over HTTP lives here, in memory, so a test can read the whole
commit history, the LFS objects and the request log, and inject failures.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LFS_PATTERNS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf", ".zip")
REGULAR_MAX_BYTES = 10 * 1024 * 1024
GITATTRIBUTES = b"".join(f"*{ext} filter=lfs diff=lfs merge=lfs -text\n".encode() for ext in LFS_PATTERNS)
INVALID_TOKEN = "Invalid credentials in Authorization header"


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


_ZERO_CHUNK_BYTES = 16 << 20


class LazyBlob:
    """An LFS object whose bytes are generated on demand: a real ``head`` (e.g. a safetensors
    header), then zeros up to ``size``. Lets a test serve a multi-GB file without holding it.

    Its ``oid`` is synthetic (the sha256 of the head and the size, not of the bytes) unless
    ``true_oid``: then it is the sha256 of the bytes served, hashed once here (~1 s per GB), for a
    client that checks what it downloads.
    """

    def __init__(self, head: bytes, size: int, *, true_oid: bool = False) -> None:
        if size < len(head):
            raise ValueError("a LazyBlob is at least as long as its head")
        self.head, self.size = head, size
        self.oid = self._sha256() if true_oid else hashlib.sha256(head + b"lazy:%d" % size).hexdigest()

    def _sha256(self) -> str:
        digest, zeros = hashlib.sha256(self.head), bytes(_ZERO_CHUNK_BYTES)
        left = self.size - len(self.head)
        while left:
            digest.update(zeros[:min(left, len(zeros))])
            left -= min(left, len(zeros))
        return digest.hexdigest()

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: slice) -> bytes:
        begin, end, _ = key.indices(self.size)
        if end <= begin:
            return b""
        head = self.head[begin:end]
        return head + bytes(end - max(begin, len(self.head)) if end > len(self.head) else 0)


@dataclass(frozen=True)
class Entry:
    """One file in a commit: regular (``content``) or LFS (``sha256``, maybe stored in Xet)."""

    path: str
    size: int
    content: bytes | None = None
    sha256: str | None = None
    xet_hash: str | None = None

    @property
    def oid(self) -> str:
        """The git blob id: of the content, or of the LFS pointer file."""
        if self.content is not None:
            return git_blob_oid(self.content)
        return git_blob_oid(lfs_pointer(self.sha256 or "", self.size))

    def tree_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"type": "file", "oid": self.oid, "size": self.size, "path": self.path}
        if self.sha256 is not None:
            doc["lfs"] = {"oid": self.sha256, "size": self.size,
                          "pointerSize": len(lfs_pointer(self.sha256, self.size))}
        if self.xet_hash is not None:
            doc["xetHash"] = self.xet_hash
        return doc


@dataclass
class Commit:
    oid: str
    parent: str | None
    message: str
    files: dict[str, Entry]
    ref: str


@dataclass
class Repo:
    repo_id: str
    repo_type: str
    private: bool
    refs: dict[str, str] = field(default_factory=dict)  # "main", "refs/pr/1" → commit oid
    commits: dict[str, Commit] = field(default_factory=dict)
    history: list[str] = field(default_factory=list)  # commit oids in creation order
    next_pr: int = 1
    gated: bool = False  # files readable only by ``granted`` users (and the owner's namespace)
    granted: set[str] = field(default_factory=set)


@dataclass
class Fault:
    """Answer ``status`` to requests matching ``method`` and ``path`` (a regex), ``times`` times.

    ``status`` 0 answers normally but drops the connection halfway through the body; 1 answers
    normally with the body's middle byte flipped (corruption in transit); 2 sends half the body,
    then stalls (``hub_server.STALL_SECONDS``) before dropping the connection.
    """

    method: str
    path: str
    status: int
    times: int | None = 1
    headers: dict[str, str] = field(default_factory=dict)
    message: str = "injected failure"
    range: str = ""  # a regex the request's Range header must match ("" matches any request)


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, body: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.body = status, code, body


class HubState:
    """Repositories, LFS objects, tokens, injected faults and a request log."""

    def __init__(self, xet_dir: Path, *, tokens: dict[str, str] | None = None,
                 multipart_threshold: int = 2**62, multipart_chunk: int = 5 * 2**20) -> None:
        self.lock = threading.RLock()
        self.repos: dict[tuple[str, str], Repo] = {}
        self.lfs: dict[str, bytes | LazyBlob] = {}
        self.xet_files: dict[str, tuple[str, int]] = {}  # sha256 → (xet file hash, size)
        self.xet_dir = Path(xet_dir)
        self.tokens = tokens if tokens is not None else {"hf_test_token": "alice"}
        self.namespaces = {"alice": {"alice", "alice-org"}}  # user → namespaces it may write to
        self.multipart_threshold, self.multipart_chunk = multipart_threshold, multipart_chunk
        self.faults: list[Fault] = []
        self.requests: list[tuple[str, str, int]] = []  # (method, path, status)
        self.lfs_bytes_received: dict[str, int] = {}  # sha256 → bytes PUT for it, all attempts
        self._parts: dict[str, dict[int, bytes]] = {}
        self.base_url = ""
        self.sent: list[tuple[str, str, str, int]] = []  # (method, path, Range header, body bytes sent)
        self.ignore_range = False  # answer 200 with the whole file to every Range request (a broken proxy)

    # ------------------------------------------------------------------ test hooks

    def inject(self, method: str, path: str, status: int = 500, *, times: int | None = 1,
               headers: dict[str, str] | None = None, range: str = "") -> Fault:
        fault = Fault(method, path, status, times, dict(headers or {}), range=range)
        with self.lock:
            self.faults.append(fault)
        return fault

    def take_fault(self, method: str, path: str, range_header: str = "") -> Fault | None:
        with self.lock:
            for fault in self.faults:
                if fault.method == method and re.search(fault.path, path) and fault.times != 0 \
                        and re.search(fault.range, range_header):
                    if fault.times is not None:
                        fault.times -= 1
                    return fault
        return None

    def bytes_sent(self, path_pattern: str = "") -> int:
        """Body bytes the server sent, over requests whose path matches ``path_pattern`` (a regex)."""
        with self.lock:
            return sum(n for _, path, _, n in self.sent if re.search(path_pattern, path))

    def add_repo(self, repo_id: str, files: dict[str, bytes | LazyBlob], *, private: bool = False,
                 gated: bool = False, repo_type: str = "model", message: str = "add files") -> Commit:
        """Create a repository holding ``files`` in one commit, without the upload protocol.

        ``.safetensors`` (and other LFS patterns) and :class:`LazyBlob` values become LFS files.
        """
        with self.lock:
            repo = self.repos.setdefault((repo_type, repo_id), Repo(repo_id, repo_type, private, gated=gated))
            entries = {".gitattributes": Entry(".gitattributes", len(GITATTRIBUTES), content=GITATTRIBUTES)}
            for path, data in files.items():
                if isinstance(data, LazyBlob):
                    self.lfs[data.oid] = data
                    entries[path] = Entry(path, data.size, sha256=data.oid)
                elif path.endswith(LFS_PATTERNS):
                    oid = hashlib.sha256(data).hexdigest()
                    self.lfs[oid] = data
                    entries[path] = Entry(path, len(data), sha256=oid)
                else:
                    entries[path] = Entry(path, len(data), content=data)
            parent = repo.refs.get("main")
            return self._add_commit(repo, "main", parent, message, entries)

    def check_files_access(self, repo: Repo, user: str | None) -> None:
        """A gated repo's files need a granted user (or one of the owner's namespaces)."""
        owner = repo.repo_id.split("/")[0]
        if repo.gated and not (user in repo.granted or owner in self.namespaces.get(user or "", ())):
            raise HubError(403 if user else 401, f"Access to model {repo.repo_id} is restricted. You must have "
                           "access to it and be authenticated to access it. Please log in.", "GatedRepo")

    def repo(self, repo_id: str, repo_type: str = "model") -> Repo:
        return self.repos[(repo_type, repo_id)]

    def files_at(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> dict[str, Entry]:
        repo = self.repo(repo_id, repo_type)
        return repo.commits[repo.refs.get(revision, revision)].files

    # ------------------------------------------------------------------ auth

    def user_for(self, authorization: str | None) -> str | None:
        """The user a ``Bearer`` token names; raises 401 for an unknown token."""
        if not authorization:
            return None
        token = authorization.removeprefix("Bearer ").strip()
        if token not in self.tokens:
            raise HubError(401, INVALID_TOKEN)
        return self.tokens[token]

    def check_read(self, repo: Repo, user: str | None) -> None:
        if repo.private and (user is None or repo.repo_id.split("/")[0] not in self.namespaces.get(user, ())):
            raise HubError(404, "Repository not found", "RepoNotFound")

    def check_write(self, repo_id: str, user: str | None) -> None:
        if user is None:
            raise HubError(401, "You must be authenticated to write")
        if repo_id.split("/")[0] not in self.namespaces.get(user, ()):
            raise HubError(403, f"You don't have the rights to write to {repo_id}")

    # ------------------------------------------------------------------ repositories

    def create_repo(self, body: dict, user: str | None) -> dict:
        namespace = body.get("organization") or user or ""
        repo_id, repo_type = f"{namespace}/{body['name']}", body.get("type") or "model"
        self.check_write(repo_id, user)
        url = self.repo_url(repo_id, repo_type)
        with self.lock:
            if (repo_type, repo_id) in self.repos:
                raise HubError(409, "You already created this repo", body={"error": "repo exists", "url": url})
            private = bool(body.get("private")) or body.get("visibility") == "private"
            repo = self.repos[(repo_type, repo_id)] = Repo(repo_id, repo_type, private)
            gitattributes = Entry(".gitattributes", len(GITATTRIBUTES), content=GITATTRIBUTES)
            self._add_commit(repo, "main", None, "initial commit", {".gitattributes": gitattributes})
        return {"url": url, "name": repo_id}

    def repo_url(self, repo_id: str, repo_type: str) -> str:
        prefix = "" if repo_type == "model" else f"{repo_type}s/"
        return f"{self.base_url}/{prefix}{repo_id}"

    def find(self, repo_type: str, repo_id: str, user: str | None) -> Repo:
        repo = self.repos.get((repo_type, repo_id))
        if repo is None:
            raise HubError(404, "Repository not found", "RepoNotFound")
        self.check_read(repo, user)
        return repo

    def resolve(self, repo: Repo, revision: str) -> Commit:
        oid = repo.refs.get(revision) or (revision if revision in repo.commits else None)
        if oid is None:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return repo.commits[oid]

    def _add_commit(self, repo: Repo, ref: str, parent: str | None, message: str,
                    files: dict[str, Entry]) -> Commit:
        seed = json.dumps([parent, message, len(repo.history), time.time_ns(),
                           sorted((p, e.oid) for p, e in files.items())])
        commit = Commit(hashlib.sha1(seed.encode()).hexdigest(), parent, message, files, ref)
        repo.commits[commit.oid] = commit
        repo.history.append(commit.oid)
        repo.refs[ref] = commit.oid
        return commit

    def create_branch(self, repo: Repo, branch: str, body: dict) -> None:
        with self.lock:
            if branch in repo.refs:
                raise HubError(409, f"Branch {branch} already exists")
            repo.refs[branch] = self.resolve(repo, body.get("startingPoint") or "main").oid

    # ------------------------------------------------------------------ upload

    def upload_mode(self, item: dict) -> str:
        sample = base64.b64decode(item.get("sample", ""))
        binary = b"\0" in sample
        if item["path"].endswith(LFS_PATTERNS) or item["size"] > REGULAR_MAX_BYTES or binary:
            return "lfs"
        return "regular"

    def preupload(self, repo: Repo, revision: str, body: dict) -> dict:
        files = self.resolve(repo, revision).files
        out = []
        for item in body["files"]:
            mode, remote = self.upload_mode(item), files.get(item["path"])
            oid = None if remote is None else (remote.sha256 if remote.sha256 else remote.oid)
            out.append({"path": item["path"], "uploadMode": mode, "shouldIgnore": False, "oid": oid})
        return {"files": out, "commitOid": self.resolve(repo, revision).oid}

    def lfs_batch(self, body: dict) -> dict:
        objects = []
        for obj in body["objects"]:
            oid, size = obj["oid"], obj["size"]
            doc: dict[str, Any] = {"oid": oid, "size": size}
            if oid not in self.lfs and oid not in self.xet_files:
                href = f"{self.base_url}/lfs-storage/{oid}/{size}"
                header: dict[str, str] = {}
                if size > self.multipart_threshold:
                    chunk = self.multipart_chunk
                    header = {"chunk_size": str(chunk)}
                    header.update({str(n + 1): f"{href}/part/{n + 1}" for n in range(-(-size // chunk))})
                doc.update(authenticated=True, actions={"upload": {"href": href, "header": header}})
            objects.append(doc)
        return {"transfer": "basic", "objects": objects, "hash_algo": "sha256"}

    def store_lfs(self, oid: str, size: int, data: bytes) -> None:
        if hashlib.sha256(data).hexdigest() != oid or len(data) != size:
            raise HubError(400, f"uploaded content does not match oid {oid} / size {size}")
        with self.lock:
            self.lfs[oid] = data

    def count_received(self, oid: str, nbytes: int) -> None:
        with self.lock:
            self.lfs_bytes_received[oid] = self.lfs_bytes_received.get(oid, 0) + nbytes

    def store_part(self, oid: str, number: int, data: bytes) -> str:
        with self.lock:
            self._parts.setdefault(oid, {})[number] = data
        return hashlib.md5(data).hexdigest()

    def complete_multipart(self, oid: str, size: int, body: dict) -> None:
        with self.lock:
            parts = self._parts.pop(oid, {})
        chunks = []
        for part in body["parts"]:
            data = parts.get(part["partNumber"])
            if data is None or hashlib.md5(data).hexdigest() != part["etag"]:
                raise HubError(400, f"part {part['partNumber']} of {oid} is missing or its etag differs")
            chunks.append(data)
        self.store_lfs(oid, size, b"".join(chunks))

    def commit(self, repo: Repo, revision: str, lines: list[dict], user: str | None, create_pr: bool) -> dict:
        self.check_write(repo.repo_id, user)
        header = next((line["value"] for line in lines if line["key"] == "header"), None)
        if header is None:
            raise HubError(400, "commit payload has no header line")
        with self.lock:
            base = self.resolve(repo, revision)
            if not create_pr and revision not in repo.refs:
                raise HubError(400, f"cannot commit to {revision}: not a branch or pull request ref")
            parent = header.get("parentCommit")
            if parent and not create_pr and parent != base.oid:
                raise HubError(412, f"A commit has happened since {parent}; the branch is at {base.oid}")
            if create_pr and parent:
                base = self.resolve(repo, parent)
            files = dict(base.files)
            for line in lines:
                self._apply(files, line["key"], line["value"])
            ref, pr_url = revision, None
            if create_pr:
                ref = f"refs/pr/{repo.next_pr}"
                pr_url = f"{self.repo_url(repo.repo_id, repo.repo_type)}/discussions/{repo.next_pr}"
                repo.next_pr += 1
            message = header.get("summary", "")
            commit = self._add_commit(repo, ref, base.oid, message, files)
        return {"commitOid": commit.oid, "commitUrl": f"{self.repo_url(repo.repo_id, repo.repo_type)}/commit/"
                f"{commit.oid}", "pullRequestUrl": pr_url, "success": True}

    def _apply(self, files: dict[str, Entry], key: str, value: dict) -> None:
        path = value.get("path", "")
        if key == "file":
            content = base64.b64decode(value["content"])
            files[path] = Entry(path, len(content), content=content)
        elif key == "lfsFile":
            oid = value["oid"]
            if oid in self.lfs:
                files[path] = Entry(path, len(self.lfs[oid]), sha256=oid)
            elif oid in self.xet_files or self.scan_xet(oid):
                xet_hash, size = self.xet_files[oid]
                files[path] = Entry(path, size, sha256=oid, xet_hash=xet_hash)
            else:
                raise HubError(422, f"LFS object {oid} for {path} was never uploaded")
        elif key == "deletedFile":
            if files.pop(path, None) is None:
                raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
        elif key == "deletedFolder":
            prefix = path.rstrip("/") + "/"
            for name in [n for n in files if n.startswith(prefix)]:
                del files[name]
        elif key != "header":
            raise HubError(400, f"unknown commit operation {key!r}")

    def scan_xet(self, sha256: str) -> bool:
        """Read hf_xet's uploaded shards to learn which Xet files carry which sha256."""
        for shard in sorted(self.xet_dir.glob("**/shards/*.mdb")):
            for file_hash, sha, size in read_xet_shard(shard.read_bytes()):
                self.xet_files.setdefault(sha, (file_hash, size))
        return sha256 in self.xet_files


# ---------------------------------------------------------------------- Xet shards

_SHARD_HEADER_BYTES = 48
_RECORD_BYTES = 48
_FLAG_VERIFICATION = 1 << 31
_FLAG_METADATA_EXT = 1 << 30


def xet_hex(raw: bytes) -> str:
    """Xet prints a 32-byte hash as four little-endian u64s, each as 16 hex digits."""
    return "".join(f"{word:016x}" for word in struct.unpack("<4Q", raw))


def read_xet_shard(data: bytes) -> list[tuple[str, str, int]]:
    """``(xet file hash, sha256, size)`` of each file in an MDB shard's file-info section.

    Layout (xet-core ``mdb_shard``): a 48-byte header, then per file a 48-byte record
    ``hash[32] flags:u32 n:u32 pad[8]``, ``n`` 48-byte segment entries ``xorb[32] flags:u32
    bytes:u32 chunk_start:u32 chunk_end:u32``, ``n`` verification entries when flagged, one
    metadata-ext entry ``sha256[32] pad[16]`` when flagged; a record of 0xFF bytes ends the section.
    """
    files, pos = [], _SHARD_HEADER_BYTES
    while pos + _RECORD_BYTES <= len(data):
        raw_hash = data[pos:pos + 32]
        if raw_hash == b"\xff" * 32:
            break
        flags, count = struct.unpack_from("<II", data, pos + 32)
        pos += _RECORD_BYTES
        size = sum(struct.unpack_from("<I", data, pos + i * _RECORD_BYTES + 36)[0] for i in range(count))
        pos += count * _RECORD_BYTES
        if flags & _FLAG_VERIFICATION:
            pos += count * _RECORD_BYTES
        if flags & _FLAG_METADATA_EXT:
            files.append((xet_hex(raw_hash), xet_hex(data[pos:pos + 32]), size))
            pos += _RECORD_BYTES
    return files
