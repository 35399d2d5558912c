"""The offline Hub test server, exercised on its own with the real huggingface_hub client and hf_xet."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from helpers_hub import TOKEN, download, hub_env, run_python
from hub_server import read_xet_shard

pytestmark = pytest.mark.hub

_UPLOAD = """
import sys
from huggingface_hub import HfApi
api = HfApi()
api.create_repo(sys.argv[1], exist_ok=True)
info = api.upload_folder(repo_id=sys.argv[1], folder_path=sys.argv[2], commit_message="upload")
print(info.oid)
"""


def _folder(root: Path, *, many: int = 0) -> dict[str, bytes]:
    rng = __import__("random").Random(7)
    files = {
        "big.safetensors": rng.randbytes(400_000),      # over the multipart threshold: 4 parts
        "small.safetensors": rng.randbytes(1_000),      # one PUT
        "config.json": b'{"hidden": 8}\n',             # regular file, inlined in the commit
        "blob.dat": b"\0binary" + rng.randbytes(50),    # binary sample → LFS
    }
    files.update({f"sub/f{i:03d}.txt": f"file {i}\n".encode() for i in range(many)})
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return files


def _read_tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*")
            if p.is_file() and ".cache" not in p.parts and p.name != ".gitattributes"}


def test_lfs_round_trip_single_and_multipart_paginated_tree(hub, tmp_path):
    files = _folder(tmp_path / "src", many=60)
    env = hub_env(hub, tmp_path / "home")
    commit = run_python(_UPLOAD, env, "alice/lfs", tmp_path / "src").stdout.strip()

    state = hub.state
    assert state.repo("alice/lfs").refs["main"] == commit
    remote = state.files_at("alice/lfs")
    assert remote["config.json"].content == files["config.json"]
    assert remote["big.safetensors"].sha256 == hashlib.sha256(files["big.safetensors"]).hexdigest()
    assert remote["blob.dat"].sha256 is not None  # binary content goes to LFS
    paths = [path for _, path, status in state.requests if status == 200]
    assert sum("/part/" in p for p in paths) == 4  # 400 kB in 128 KiB parts
    assert any(p.endswith(f"/{remote['small.safetensors'].sha256}/1000") for p in paths)

    got = _read_tree(download(env, "alice/lfs", tmp_path / "dl"))
    assert got == files
    tree_pages = [p for m, p, _ in state.requests if m == "GET" and "/tree/" in p]
    assert len(tree_pages) >= 2  # 60+ entries come back in pages linked by the Link header


def test_xet_round_trip_uses_local_cas_and_shard_hashes(hub, tmp_path):
    files = _folder(tmp_path / "src")
    env = hub_env(hub, tmp_path / "home", xet=True)
    run_python(_UPLOAD, env, "alice/xet", tmp_path / "src")

    remote = hub.state.files_at("alice/xet")
    big = remote["big.safetensors"]
    assert big.xet_hash and len(big.xet_hash) == 64 and big.size == 400_000
    assert big.sha256 == hashlib.sha256(files["big.safetensors"]).hexdigest()
    assert not any(m == "PUT" for m, _, _ in hub.state.requests)  # content went to the CAS folder
    assert list((hub.state.xet_dir).rglob("*.mdb"))

    got = _read_tree(download(env, "alice/xet", tmp_path / "dl"))
    assert got == files
    assert any("xet-read-token" in p for _, p, _ in hub.state.requests)


def test_read_xet_shard_agrees_with_hf_xet(tmp_path):
    data = os.urandom(200_000)
    (tmp_path / "f.bin").write_bytes(data)
    code = """
import sys, time, hf_xet
s = hf_xet.XetSession()
with s.new_upload_commit(endpoint="local://" + sys.argv[1], token="t", token_expiry_unix_secs=int(time.time()) + 600) as c:
    h = c.start_upload_file(sys.argv[2], sha256=hf_xet.COMPUTE_SHA256)
print(h.result().xet_info.hash)
"""
    env = {**os.environ, "HF_XET_CACHE": str(tmp_path / "cache")}
    xet_hash = run_python(code, env, tmp_path / "cas", tmp_path / "f.bin").stdout.strip()
    shards = list((tmp_path / "cas").rglob("shards/*.mdb"))
    found = [entry for shard in shards for entry in read_xet_shard(shard.read_bytes())]
    assert (xet_hash, hashlib.sha256(data).hexdigest(), len(data)) in found


def test_transient_503_is_retried_and_bad_tokens_are_refused(hub, tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "w.safetensors").write_bytes(os.urandom(5000))
    hub.state.inject("PUT", "^/lfs-storage/", 503, headers={"Retry-After": "0"})
    env = hub_env(hub, tmp_path / "home")
    run_python(_UPLOAD, env, "alice/retry", tmp_path / "src")
    puts = [status for method, _, status in hub.state.requests if method == "PUT"]
    assert puts == [503, 200]
    assert "w.safetensors" in hub.state.files_at("alice/retry")

    bad = hub_env(hub, tmp_path / "home2", token="hf_wrong")
    with pytest.raises(AssertionError, match="401"):
        run_python(_UPLOAD, bad, "alice/other", tmp_path / "src")
    hub.state.inject("POST", "/preupload/", 401)
    with pytest.raises(AssertionError, match="401"):
        run_python(_UPLOAD, env, "alice/retry", tmp_path / "src")


def _call(hub, method: str, path: str, body: bytes | dict | None = None, *, token: str | None = TOKEN,
          headers: dict | None = None) -> tuple[int, dict, bytes]:
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(hub.url + path, data=data, method=method, headers=headers or {})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _commit(hub, repo: str, revision: str, lines: list[dict], query: str = "") -> tuple[int, dict]:
    body = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    status, _, raw = _call(hub, "POST", f"/api/models/{repo}/commit/{revision}{query}", body)
    return status, json.loads(raw or b"{}")


def test_repo_commit_rules_pull_requests_and_ranges(hub):
    assert _call(hub, "POST", "/api/repos/create", {"name": "r", "organization": "alice"})[0] == 200
    status, _, raw = _call(hub, "POST", "/api/repos/create", {"name": "r", "organization": "alice"})
    assert status == 409 and json.loads(raw)["url"] == f"{hub.url}/alice/r"
    assert _call(hub, "POST", "/api/repos/create", {"name": "r", "organization": "bob"})[0] == 403
    assert _call(hub, "POST", "/api/repos/create", {"name": "r"}, token="nope")[0] == 401

    head = hub.state.repo("alice/r").refs["main"]
    text = base64.b64encode(b"0123456789").decode()
    add = {"key": "file", "value": {"path": "a.txt", "content": text, "encoding": "base64"}}
    status, doc = _commit(hub, "alice/r", "main", [{"key": "header", "value": {"summary": "s", "parentCommit": head}}, add])
    assert status == 200 and doc["commitOid"] == hub.state.repo("alice/r").refs["main"]
    stale = {"key": "header", "value": {"summary": "late", "parentCommit": head}}
    assert _commit(hub, "alice/r", "main", [stale, add])[0] == 412
    missing = {"key": "lfsFile", "value": {"path": "w.bin", "algo": "sha256", "oid": "a" * 64, "size": 3}}
    assert _commit(hub, "alice/r", "main", [{"key": "header", "value": {"summary": "x"}}, missing])[0] == 422
    gone = {"key": "deletedFile", "value": {"path": "nope.txt"}}
    status, _ = _commit(hub, "alice/r", "main", [{"key": "header", "value": {"summary": "x"}}, gone])
    assert status == 404

    status, doc = _commit(hub, "alice/r", "main", [{"key": "header", "value": {"summary": "pr"}}, add], "?create_pr=1")
    assert status == 200 and doc["pullRequestUrl"].endswith("/alice/r/discussions/1")
    assert hub.state.repo("alice/r").refs["refs/pr/1"] == doc["commitOid"]
    assert hub.state.repo("alice/r").refs["main"] != doc["commitOid"]

    status, headers, body = _call(hub, "GET", "/alice/r/resolve/main/a.txt", headers={"Range": "bytes=2-5"})
    assert (status, body, headers["Content-Range"]) == (206, b"2345", "bytes 2-5/10")
    status, headers, body = _call(hub, "HEAD", "/alice/r/resolve/main/a.txt")
    assert status == 200 and headers["X-Repo-Commit"] == hub.state.repo("alice/r").refs["main"]
    assert _call(hub, "GET", "/alice/r/resolve/nobranch/a.txt")[1]["X-Error-Code"] == "RevisionNotFound"
    assert _call(hub, "GET", "/api/models/alice/none/revision/main")[1]["X-Error-Code"] == "RepoNotFound"
