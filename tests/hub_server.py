"""A small offline Hugging Face Hub for tests: the real ``huggingface_hub`` client, real HTTP, loopback.

It speaks the subset of the Hub protocol the client (huggingface_hub 2.4, hf_xet 1.8) uses to
push and download a repository:

- ``POST /api/repos/create`` (409 with ``url`` when it exists), model info at a revision, branches;
- ``POST .../preupload/{rev}``; the git-LFS batch API with single ``PUT`` or multipart upload
  (``ETag`` per part, completion ``POST``); the NDJSON commit (``file``, ``lfsFile``,
  ``deletedFile``, ``deletedFolder``), ``parentCommit`` checks and ``?create_pr=1`` (``refs/pr/N``);
- tree listing (recursive, paginated with a ``Link`` header) and ``/resolve`` (``HEAD`` and ``GET``
  with ``Range``);
- Xet: ``xet-write-token`` / ``xet-read-token`` answer with a ``local://`` CAS folder that hf_xet
  reads and writes itself. The server learns which Xet file a commit's sha256 names by reading the
  shard files hf_xet leaves in that folder (see :func:`read_xet_shard`).

State lives in memory (one :class:`HubState`); every commit is kept, so a test can inspect the whole
history. :meth:`HubState.inject` makes chosen requests fail (a transient 5xx, a 401, ...).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

LFS_PATTERNS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf", ".zip")
REGULAR_MAX_BYTES = 10 * 1024 * 1024
GITATTRIBUTES = b"".join(f"*{ext} filter=lfs diff=lfs merge=lfs -text\n".encode() for ext in LFS_PATTERNS)
INVALID_TOKEN = "Invalid credentials in Authorization header"


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


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


@dataclass
class Fault:
    """Answer ``status`` to requests matching ``method`` and ``path`` (a regex), ``times`` times."""

    method: str
    path: str
    status: int
    times: int | None = 1
    headers: dict[str, str] = field(default_factory=dict)
    message: str = "injected failure"


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
        self.lfs: dict[str, bytes] = {}
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

    # ------------------------------------------------------------------ test hooks

    def inject(self, method: str, path: str, status: int = 500, *, times: int | None = 1,
               headers: dict[str, str] | None = None) -> Fault:
        fault = Fault(method, path, status, times, dict(headers or {}))
        with self.lock:
            self.faults.append(fault)
        return fault

    def take_fault(self, method: str, path: str) -> Fault | None:
        with self.lock:
            for fault in self.faults:
                if fault.method == method and re.search(fault.path, path) and fault.times != 0:
                    if fault.times is not None:
                        fault.times -= 1
                    return fault
        return None

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


# ---------------------------------------------------------------------- HTTP

_API = re.compile(r"^/api/(models|datasets|spaces)/([^/]+)/([^/]+)(?:/([^/]+)(?:/(.*))?)?$")
_LFS_BATCH = re.compile(r"^/(?:(datasets|spaces)/)?([^/]+)/([^/]+)\.git/info/lfs/objects/batch$")
_LFS_STORAGE = re.compile(r"^/lfs-storage/([0-9a-f]{64})/(\d+)(?:/part/(\d+))?$")
_RESOLVE = re.compile(r"^/(?:(datasets|spaces)/)?([^/]+)/([^/]+)/resolve/([^/]+)/(.+)$")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: HubState  # set by serve()

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in separate writes: without this, Nagle + delayed ACK stall each reply.
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:  # keep pytest output clean
        pass

    def do_GET(self) -> None:
        self._handle("GET")

    def do_HEAD(self) -> None:
        self._handle("HEAD")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    # ------------------------------------------------------------------ plumbing

    def _handle(self, method: str) -> None:
        url = urlsplit(self.path)
        self.query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        self.body = self._read_body()
        status = 500
        try:
            fault = self.state.take_fault(method, url.path)
            if fault is not None:
                status = fault.status
                extra = dict(fault.headers)
                if fault.status == 401:
                    extra.setdefault("X-Error-Message", INVALID_TOKEN)
                self._send_json(fault.status, {"error": fault.message}, extra)
                return
            status = self._route(method, url.path)
        except HubError as e:
            status = e.status
            headers = {"X-Error-Message": str(e)}
            if e.code:
                headers["X-Error-Code"] = e.code
            self._send_json(e.status, e.body or {"error": str(e)}, headers)
        except Exception as e:  # a server bug: answer it rather than drop the connection
            status = 500
            self._send_json(500, {"error": f"{type(e).__name__}: {e}"})
        finally:
            with self.state.lock:
                self.state.requests.append((method, url.path, status))

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                chunk = self.rfile.read(size)
                self.rfile.readline()
                if size == 0:
                    return b"".join(chunks)
                chunks.append(chunk)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _json_body(self) -> Any:
        return json.loads(self.body or b"{}")

    def _send(self, status: int, data: bytes, headers: dict[str, str] | None = None,
              content_length: int | None = None) -> int:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data) if content_length is None else content_length))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        return status

    def _send_json(self, status: int, doc: Any, headers: dict[str, str] | None = None) -> int:
        return self._send(status, json.dumps(doc).encode(), {"Content-Type": "application/json", **(headers or {})})

    def _user(self) -> str | None:
        return self.state.user_for(self.headers.get("Authorization"))

    # ------------------------------------------------------------------ routes

    def _route(self, method: str, path: str) -> int:
        state = self.state
        if method == "POST" and path == "/api/repos/create":
            return self._send_json(200, state.create_repo(self._json_body(), self._user()))
        if method == "GET" and path == "/api/whoami-v2":
            user = self._user()
            if user is None:
                raise HubError(401, INVALID_TOKEN)
            return self._send_json(200, {"type": "user", "name": user, "orgs": []})
        if (match := _LFS_BATCH.match(path)) and method == "POST":
            repo = state.find((match[1] or "models")[:-1], f"{match[2]}/{match[3]}", self._user())
            state.check_write(repo.repo_id, self._user())
            return self._send_json(200, state.lfs_batch(self._json_body()),
                                   {"Content-Type": "application/vnd.git-lfs+json"})
        if match := _LFS_STORAGE.match(path):
            return self._lfs_storage(method, match[1], int(match[2]), match[3])
        if (match := _RESOLVE.match(path)) and method in ("GET", "HEAD"):
            repo = state.find((match[1] or "models")[:-1], f"{match[2]}/{match[3]}", self._user())
            return self._resolve(repo, unquote(match[4]), unquote(match[5]))
        if match := _API.match(path):
            repo_type, repo_id = match[1][:-1], f"{match[2]}/{match[3]}"
            action, rest = match[4], [unquote(p) for p in (match[5] or "").split("/") if p]
            return self._api(method, repo_type, repo_id, action, rest)
        raise HubError(404, f"no route for {method} {path}")

    def _api(self, method: str, repo_type: str, repo_id: str, action: str | None, rest: list[str]) -> int:
        state, user = self.state, self._user()
        repo = state.find(repo_type, repo_id, user)
        if action is None or action == "revision":
            commit = state.resolve(repo, rest[0] if rest else "main")
            siblings = [{"rfilename": p} for p in sorted(commit.files)]
            return self._send_json(200, {"id": repo_id, "sha": commit.oid, "private": repo.private,
                                         "siblings": siblings})
        if action == "tree" and method == "GET":
            return self._tree(repo, rest[0], "/".join(rest[1:]))
        if action == "preupload" and method == "POST":
            state.check_write(repo_id, user)
            return self._send_json(200, state.preupload(repo, rest[0], self._json_body()))
        if action == "commit" and method == "POST":
            lines = [json.loads(line) for line in self.body.splitlines() if line.strip()]
            doc = state.commit(repo, rest[0], lines, user, self.query.get("create_pr") == "1")
            return self._send_json(200, doc)
        if action == "branch" and method == "POST":
            state.check_write(repo_id, user)
            state.create_branch(repo, rest[0], self._json_body())
            return self._send_json(200, {})
        if action in ("xet-write-token", "xet-read-token") and method == "GET":
            if action == "xet-write-token":
                state.check_write(repo_id, user)
            return self._xet_token()
        raise HubError(404, f"no route for {method} {action}")

    def _tree(self, repo: Repo, revision: str, folder: str) -> int:
        commit = self.state.resolve(repo, revision)
        prefix = folder.rstrip("/") + "/" if folder else ""
        recursive = self.query.get("recursive", "false").lower() in ("true", "1")
        entries: dict[str, dict] = {}
        for path, entry in sorted(commit.files.items()):
            if not path.startswith(prefix):
                continue
            parts = path[len(prefix):].split("/")
            for depth in range(1, len(parts)):  # the folders on the way
                if recursive or depth == 1:
                    name = prefix + "/".join(parts[:depth])
                    entries.setdefault(name, {"type": "directory", "oid": "0" * 40, "path": name})
            if recursive or len(parts) == 1:
                entries[path] = entry.tree_json()
        if folder and not entries:
            raise HubError(404, f"{folder} does not exist at {revision}", "EntryNotFound")
        page = sorted(entries.values(), key=lambda e: e["path"])
        return self._paginate(page)

    def _paginate(self, items: list[dict], page_size: int = 50) -> int:
        start = int(self.query.get("cursor", "0"))
        headers = {}
        if start + page_size < len(items):
            query = "&".join(f"{k}={v}" for k, v in {**self.query, "cursor": start + page_size}.items())
            headers["Link"] = f'<{self.state.base_url}{urlsplit(self.path).path}?{query}>; rel="next"'
        return self._send_json(200, items[start:start + page_size], headers)

    def _resolve(self, repo: Repo, revision: str, path: str) -> int:
        commit = self.state.resolve(repo, revision)
        entry = commit.files.get(path)
        if entry is None:
            raise HubError(404, f"{path} not found at {revision}", "EntryNotFound")
        headers = {"X-Repo-Commit": commit.oid, "ETag": f'"{entry.sha256 or entry.oid}"', "Accept-Ranges": "bytes"}
        if entry.sha256:
            headers["X-Linked-Size"] = str(entry.size)
            headers["X-Linked-ETag"] = f'"{entry.sha256}"'
        if entry.xet_hash:
            headers["X-Xet-Hash"] = entry.xet_hash
            headers["X-Xet-Refresh-Route"] = (f"{self.state.base_url}/api/{repo.repo_type}s/{repo.repo_id}"
                                              f"/xet-read-token/{commit.oid}")
            if self.command == "HEAD":
                return self._send(200, b"", headers, content_length=entry.size)
            raise HubError(501, f"{path} is stored in Xet only; download it with hf_xet")
        data = entry.content if entry.content is not None else self.state.lfs[entry.sha256 or ""]
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if match:
            begin, end = int(match[1]), int(match[2] or len(data) - 1)
            if begin >= len(data):
                return self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"})
            end = min(end, len(data) - 1)
            headers["Content-Range"] = f"bytes {begin}-{end}/{len(data)}"
            return self._send(206, data[begin:end + 1], headers)
        return self._send(200, data, headers)

    def _lfs_storage(self, method: str, oid: str, size: int, part: str | None) -> int:
        if method == "PUT":
            self.state.count_received(oid, len(self.body))
            if part is not None:
                return self._send(200, b"", {"ETag": self.state.store_part(oid, int(part), self.body)})
            self.state.store_lfs(oid, size, self.body)
            return self._send(200, b"")
        if method == "POST":  # multipart completion
            self.state.complete_multipart(oid, size, self._json_body())
            return self._send_json(200, {"success": True})
        raise HubError(405, f"{method} not allowed on LFS storage")

    def _xet_token(self) -> int:
        exp = int(time.time()) + 3600
        cas_url = f"local://{self.state.xet_dir}"
        headers = {"X-Xet-Cas-Url": cas_url, "X-Xet-Access-Token": "xet-local-token", "X-Xet-Token-Expiration": str(exp)}
        return self._send_json(200, {"casUrl": cas_url, "accessToken": "xet-local-token", "exp": exp}, headers)


class HubServer:
    """A running server on ``127.0.0.1``: ``.url``, ``.state``; use as a context manager."""

    def __init__(self, root: Path, **state_options: Any) -> None:
        root.mkdir(parents=True, exist_ok=True)
        (root / "xet").mkdir(exist_ok=True)
        self.state = HubState(root / "xet", **state_options)
        handler = type("BoundHandler", (Handler,), {"state": self.state})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.state.base_url = self.url
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="hub-server", daemon=True)

    def __enter__(self) -> "HubServer":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
