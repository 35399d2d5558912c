"""A small offline Hugging Face Hub for tests: the real ``huggingface_hub`` client, real HTTP, loopback.

It speaks the subset of the Hub protocol the client (huggingface_hub 2.4, hf_xet 1.8) uses to
push and download a repository:

- ``POST /api/repos/create`` (409 with ``url`` when it exists), model info at a revision, branches;
- ``POST .../preupload/{rev}``; the git-LFS batch API with single ``PUT`` or multipart upload
  (``ETag`` per part, completion ``POST``); the NDJSON commit (``file``, ``lfsFile``,
  ``deletedFile``, ``deletedFolder``), ``parentCommit`` checks and ``?create_pr=1`` (``refs/pr/N``);
- tree listing (recursive, paginated with a ``Link`` header), ``paths-info``, and ``/resolve``
  (``HEAD`` and ``GET`` with ``Range``: 206 + ``Content-Range``; every body's bytes are counted in
  ``state.sent``); gated repositories (403/401 ``GatedRepo`` on files); :class:`hub_state.LazyBlob`
  files whose zeros are generated as they are sent;
- Xet: ``xet-write-token`` / ``xet-read-token`` answer with a ``local://`` CAS folder that hf_xet
  reads and writes itself. The server learns which Xet file a commit's sha256 names by reading the
  shard files hf_xet leaves in that folder (see :func:`read_xet_shard`).

State lives in memory (one :class:`hub_state.HubState`); every commit is kept, so a test can
inspect the whole history. :meth:`HubState.inject` makes chosen requests fail (a transient 5xx, a
401, ...). This module is the HTTP side only: routing, bodies, headers.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from hub_state import INVALID_TOKEN, HubError, HubState, LazyBlob, Repo, read_xet_shard

__all__ = ["HubServer", "HubState", "LazyBlob", "read_xet_shard"]

_API = re.compile(r"^/api/(models|datasets|spaces)/([^/]+)/([^/]+)(?:/([^/]+)(?:/(.*))?)?$")
_LFS_BATCH = re.compile(r"^/(?:(datasets|spaces)/)?([^/]+)/([^/]+)\.git/info/lfs/objects/batch$")
_LFS_STORAGE = re.compile(r"^/lfs-storage/([0-9a-f]{64})/(\d+)(?:/part/(\d+))?$")
STALL_SECONDS = 3  # a stalled body: longer than the client timeout the tests set
_CHUNK_BYTES = 1 << 20
_RESOLVE = re.compile(r"^/(?:(datasets|spaces)/)?([^/]+)/([^/]+)/resolve/([^/]+)/(.+)$")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: HubState  # bound by HubServer

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
            fault = self.state.take_fault(method, url.path, self.headers.get("Range", ""))
            self.cut_body = fault is not None and fault.status == 0
            self.flip_byte = fault is not None and fault.status == 1
            self.stall = fault is not None and fault.status == 2
            if fault is not None and not (self.cut_body or self.flip_byte or self.stall):
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
        except Exception as e:  # a server bug: answer it, then raise it (http.server prints its traceback)
            status = 500
            self._send_json(500, {"error": f"{type(e).__name__}: {e}"})
            raise
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
        sent = 0
        if self.command != "HEAD" and (getattr(self, "cut_body", False) or getattr(self, "stall", False)):
            self.wfile.write(data[:len(data) // 2])  # a connection lost, or stalled, mid-body
            self.wfile.flush()
            if getattr(self, "stall", False):
                time.sleep(STALL_SECONDS)
            sent, self.close_connection = len(data) // 2, True
        elif self.command != "HEAD" and getattr(self, "flip_byte", False) and data:  # corrupted in transit
            corrupted = bytearray(data[:])
            corrupted[len(corrupted) // 2] ^= 0xFF
            self.wfile.write(bytes(corrupted))
            sent = len(corrupted)
        elif self.command != "HEAD":
            if isinstance(data, bytes):
                self.wfile.write(data)
                sent = len(data)
            else:  # a LazyBlob: generated and written a chunk at a time
                for begin in range(0, len(data), _CHUNK_BYTES):
                    chunk = data[begin:begin + _CHUNK_BYTES]
                    self.wfile.write(chunk)
                    sent += len(chunk)
        with self.state.lock:
            self.state.sent.append((self.command, urlsplit(self.path).path, self.headers.get("Range", ""), sent))
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
            state.check_files_access(repo, self._user())
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
            state.check_files_access(repo, user)
            return self._tree(repo, rest[0], "/".join(rest[1:]))
        if action == "paths-info" and method == "POST":
            state.check_files_access(repo, user)
            return self._paths_info(repo, rest[0])
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

    def _paths_info(self, repo: Repo, revision: str) -> int:
        """``get_paths_info``: the tree entries of the named files and folders (unknown paths are left out)."""
        commit = self.state.resolve(repo, revision)
        form = parse_qs(self.body.decode())
        paths = form.get("paths", [])
        if not paths and self.body.strip().startswith(b"{"):
            paths = self._json_body().get("paths", [])
        out = []
        for path in paths:
            if path in commit.files:
                out.append(commit.files[path].tree_json())
            elif any(name.startswith(path.rstrip("/") + "/") for name in commit.files):
                out.append({"type": "directory", "oid": "0" * 40, "path": path})
        return self._send_json(200, out)

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
        if match and not self.state.ignore_range:
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

    def __enter__(self) -> HubServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
