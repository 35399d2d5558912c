"""A hostile S3 endpoint on 127.0.0.1 (issue 41): a stdlib HTTP server answering just enough S3.

It speaks path-style ``ListObjectsV2``, ``ListMultipartUploads``, ``HeadBucket``, ``HeadObject`` and
ranged ``GetObject`` (with ``If-Match``), and lies the way each test needs: a test subclasses
:class:`HostileS3` and overrides :meth:`HostileS3.list_page`, :meth:`HostileS3.uploads_page` or
:meth:`HostileS3.version`. Credentials are accepted unchecked. Every request is recorded.

:func:`serving` starts it in a thread and stops it on every path with a bound (a stalled reply
waits on ``stop``, which is set first). :func:`hostile_env` gives the ``AWS_*`` variables naming it,
with ``~/.aws`` hidden; :func:`run_bounded` runs the CLI against it in a subprocess with a time
limit (a hang is a failure, never a stuck suite) and optionally a cap on the size of any file.
"""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit
from xml.sax.saxutils import escape

__all__ = ["BUCKET", "HostileS3", "Listed", "Page", "Version", "hostile_env", "run_bounded", "serving"]

BUCKET = "hostile"
STALL_LIMIT_S = 60.0  # a stalled reply never outlives this, whatever the test does
STOP_JOIN_S = 10.0


@dataclass(frozen=True)
class Listed:
    """One ``Contents`` entry of a listing page: what the store claims."""

    key: str
    size: int
    etag: str = "e0"


@dataclass(frozen=True)
class Page:
    """One listing page; ``next_token`` is sent only when ``truncated``."""

    entries: list[Listed] = field(default_factory=list)
    truncated: bool = False
    next_token: str = ""


@dataclass(frozen=True)
class Version:
    """What a GET of an object serves: ``data`` (zeros past its end up to ``size``), its ETag; ``stall``: send
    the headers, then nothing."""

    data: bytes
    etag: str
    size: int | None = None
    stall: bool = False

    @property
    def total(self) -> int:
        return len(self.data) if self.size is None else self.size


class HostileS3:
    """An honest store of ``objects`` (key -> bytes) by default; subclasses lie."""

    honours_if_match = True  # False: a GET sends its version whatever If-Match asks

    def __init__(self, objects: dict[str, bytes] | None = None) -> None:
        self.objects = dict(objects or {})
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()

    # ------------------------------------------------------------------ what a test overrides

    def list_page(self, prefix: str, token: str) -> Page:
        """The ListObjectsV2 page after ``token`` ("" for the first): every object under ``prefix``, one page."""
        return Page([Listed(k, len(v), self.etag(k)) for k, v in sorted(self.objects.items()) if k.startswith(prefix)])

    def uploads_page(self, prefix: str, key_marker: str) -> tuple[list[tuple[str, str]], bool, str]:
        """ListMultipartUploads: ``(key, upload id)`` pairs, truncated, the next key marker. None open."""
        return [], False, ""

    def version(self, key: str, gets: int) -> Version | None:
        """What the ``gets``-th GET (1-based) of ``key`` serves; None: no such key."""
        data = self.objects.get(key)
        return None if data is None else Version(data, self.etag(key))

    def etag(self, key: str) -> str:
        return f"e{len(self.objects.get(key, b''))}"

    # ------------------------------------------------------------------ bookkeeping

    def count(self, method: str, key: str) -> int:
        with self.lock:
            return sum(1 for m, path, _ in self.requests if m == method and path == f"/{BUCKET}/{key}")

    def record(self, method: str, path: str, headers: dict[str, str]) -> int:
        with self.lock:
            self.requests.append((method, path, headers))
            return sum(1 for m, p, _ in self.requests if m == method and p == path)


def _listing_xml(prefix: str, page: Page, encode: bool) -> bytes:
    def key(k: str) -> str:
        return quote(k, safe="/") if encode else escape(k)

    contents = "".join(
        f"<Contents><Key>{key(e.key)}</Key><LastModified>2024-01-01T00:00:00.000Z</LastModified>"
        f"<ETag>&quot;{escape(e.etag)}&quot;</ETag><Size>{e.size}</Size><StorageClass>STANDARD</StorageClass></Contents>"
        for e in page.entries)
    more = f"<NextContinuationToken>{escape(page.next_token)}</NextContinuationToken>" if page.truncated else ""
    return (f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<Name>{BUCKET}</Name><Prefix>{key(prefix)}</Prefix><KeyCount>{len(page.entries)}</KeyCount>"
            f"<MaxKeys>1000</MaxKeys>{'<EncodingType>url</EncodingType>' if encode else ''}"
            f"<IsTruncated>{'true' if page.truncated else 'false'}</IsTruncated>{more}{contents}"
            "</ListBucketResult>").encode()


def _uploads_xml(uploads: list[tuple[str, str]], truncated: bool, next_marker: str) -> bytes:
    items = "".join(f"<Upload><Key>{escape(k)}</Key><UploadId>{escape(u)}</UploadId></Upload>" for k, u in uploads)
    more = (f"<NextKeyMarker>{escape(next_marker)}</NextKeyMarker><NextUploadIdMarker>{escape(next_marker)}"
            "</NextUploadIdMarker>") if truncated else ""
    return (f'<?xml version="1.0" encoding="UTF-8"?><ListMultipartUploadsResult '
            f'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Bucket>{BUCKET}</Bucket><MaxUploads>1000</MaxUploads>'
            f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>{more}{items}"
            "</ListMultipartUploadsResult>").encode()


def _error_xml(code: str) -> bytes:
    return f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{code}</Message></Error>'.encode()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # else each keep-alive reply waits 40 ms for a delayed ACK

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the stdlib's name
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None, *,
              head: bool = False) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if "Content-Length" not in (headers or {}):
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def do_HEAD(self) -> None:  # noqa: N802 - the stdlib's name
        store = self.server.store
        path = urlsplit(self.path).path
        store.record("HEAD", path, dict(self.headers.items()))
        key = unquote(path).removeprefix(f"/{BUCKET}").lstrip("/")
        if not key:
            self._send(200, head=True)
            return
        found = store.version(key, 1)
        if found is None:
            self._send(404, head=True)
            return
        self._send(200, headers={"Content-Length": str(found.total), "ETag": f'"{found.etag}"'}, head=True)

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        store = self.server.store
        parts = urlsplit(self.path)
        query = parse_qs(parts.query, keep_blank_values=True)
        gets = store.record("GET", parts.path, dict(self.headers.items()))
        key = unquote(parts.path).removeprefix(f"/{BUCKET}").lstrip("/")
        if not key and "uploads" in query:
            uploads, truncated, marker = store.uploads_page(query.get("prefix", [""])[0],
                                                            query.get("key-marker", [""])[0])
            self._send(200, _uploads_xml(uploads, truncated, marker), {"Content-Type": "application/xml"})
        elif not key:
            prefix = query.get("prefix", [""])[0]
            page = store.list_page(prefix, query.get("continuation-token", [""])[0])
            encode = query.get("encoding-type", [""])[0] == "url"
            self._send(200, _listing_xml(prefix, page, encode), {"Content-Type": "application/xml"})
        else:
            self._object(key, gets)

    def _object(self, key: str, gets: int) -> None:
        found = self.server.store.version(key, gets)
        if found is None:
            self._send(404, _error_xml("NoSuchKey"), {"Content-Type": "application/xml"})
            return
        wanted = self.headers.get("If-Match")
        if self.server.store.honours_if_match and wanted is not None and wanted.strip('"') != found.etag:
            self._send(412, _error_xml("PreconditionFailed"), {"Content-Type": "application/xml"})
            return
        begin, end = 0, found.total - 1
        asked = self.headers.get("Range", "")
        if asked.startswith("bytes="):
            first, _, last = asked.removeprefix("bytes=").partition("-")
            begin, end = int(first), min(int(last), found.total - 1)
        headers = {"Content-Length": str(end - begin + 1), "ETag": f'"{found.etag}"',
                   "Content-Range": f"bytes {begin}-{end}/{found.total}"}
        if found.stall:
            self._send(206, b"", headers, head=True)  # the headers, then nothing
            self.wfile.flush()
            self.server.store.stop.wait(STALL_LIMIT_S)
            self.close_connection = True
            return
        body = found.data[begin:end + 1]
        self._send(206, body + bytes(end - begin + 1 - len(body)), headers)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, store: HostileS3) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.store = store


@contextlib.contextmanager
def serving(store: HostileS3) -> Iterator[str]:
    """``store`` served on 127.0.0.1 while the block runs; yields its endpoint URL. Stopped on every path:
    stalled replies released first, then the server shut down and its thread joined with a bound."""
    server = _Server(store)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, name="hostile-s3",
                              daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        store.stop.set()
        server.shutdown()
        server.server_close()
        thread.join(STOP_JOIN_S)


def hostile_env(endpoint: str, home: Path) -> dict[str, str]:
    """The process environment with the ``AWS_*`` variables naming ``endpoint`` and every other AWS setting gone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    home.mkdir(parents=True, exist_ok=True)
    env.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "hostile", "AWS_SECRET_ACCESS_KEY": "hostile",
                "AWS_REGION": "us-east-1", "AWS_CONFIG_FILE": str(home / "no-config"),
                "AWS_SHARED_CREDENTIALS_FILE": str(home / "no-credentials"), "HOME": str(home)})
    return env


@dataclass
class Ran:
    """A bounded CLI run: its exit code and output."""

    returncode: int
    stdout: str
    stderr: str


def run_bounded(args: list[str], env: dict[str, str], *, timeout_s: float = 40.0,
                max_file_bytes: int | None = None) -> Ran:
    """``shardkit ARGS`` in a subprocess killed after ``timeout_s`` (then the test fails: a hang, named);
    ``max_file_bytes``: the child may not make any file larger (RLIMIT_FSIZE: SIGXFSZ kills it)."""
    from conftest import SHARDKIT_BIN

    def limit() -> None:
        if max_file_bytes is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    try:
        proc = subprocess.run([SHARDKIT_BIN, *args], env=env, capture_output=True, text=True, timeout=timeout_s,
                              preexec_fn=limit)  # noqa: PLW1509 - a resource limit only
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"shardkit {' '.join(args)} still ran after {timeout_s} s (a hang): "
                             f"{(e.stderr or b'')[-500:]!r}") from None
    return Ran(proc.returncode, proc.stdout, proc.stderr)
