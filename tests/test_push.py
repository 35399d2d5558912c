"""``shardkit push`` and ``split --push-to`` against the offline Hub (tests/hub_server.py).

Every push runs the real CLI (or the Python API) in a subprocess, so huggingface_hub reads our
endpoint, token and Xet switch from the environment; the server runs in this process and is
inspected directly: its commits, refs, LFS objects and request log.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path

import pytest
from helpers_hub import download, hub_env, index_problems, run_python, run_shardkit

import shardkit

pytestmark = pytest.mark.hub

REPO = "alice/tiny"


def make_source(path: Path, *, seed: int = 0, changed_last: bool = False) -> Path:
    """8 float32 tensors of 16 KiB; ``changed_last`` alters only the last one."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {f"layer.{i}.weight": torch.randn(64, 64, generator=gen) for i in range(8)}
    if changed_last:
        tensors["layer.7.weight"] = tensors["layer.7.weight"] + 1
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path


def make_checkpoint(tmp_path: Path, name: str = "out", **source_options) -> tuple[Path, Path]:
    """``(source file, folder)``: the source split into 4 shards of 2 tensors plus an index."""
    source = make_source(tmp_path / f"{name}-src" / "model.safetensors", **source_options)
    shardkit.split(source, tmp_path / name, max_shard_size="40KB")
    return source, tmp_path / name


def one_error_line(proc, code: int = 2) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def shard_oid(folder: Path, number: int) -> str:
    return hashlib.sha256((folder / f"model-{number:05d}-of-00004.safetensors").read_bytes()).hexdigest()


def writes(hub) -> list[tuple[str, str, int]]:
    """Requests that send content or change a ref: LFS uploads, commits, branches."""
    return [r for r in hub.state.requests if r[0] in ("PUT", "POST")
            and any(part in r[1] for part in ("/lfs-storage/", "/commit/", "/branch/"))]


@pytest.mark.parametrize("xet", [False, True], ids=["lfs", "xet"])
def test_round_trip_split_push_download_verify(hub, tmp_path, xet):
    source, folder = make_checkpoint(tmp_path)
    env = hub_env(hub, tmp_path / "home", xet=xet)
    proc = run_shardkit(env, "push", folder, REPO, "--private", "-m", "reshard to 40KB")
    assert proc.returncode == 0, proc.stderr
    url = proc.stdout.strip().splitlines()[-1]
    repo = hub.state.repo(REPO)
    head = repo.commits[repo.refs["main"]]
    assert url == f"{hub.url}/{REPO}/commit/{head.oid}" and head.message == "reshard to 40KB"
    assert repo.private and len(repo.history) == 2  # the repo's first commit, then ours
    shards = [head.files[f"model-0000{i}-of-00004.safetensors"] for i in range(1, 5)]
    if xet:
        assert all(s.xet_hash for s in shards) and not any(m == "PUT" for m, _, _ in hub.state.requests)
    else:
        assert all(s.sha256 in hub.state.lfs for s in shards)

    downloaded = download(env, REPO, tmp_path / "dl")
    report = shardkit.verify(downloaded, against=source)  # every tensor, bit for bit
    assert report.ok, [str(f) for f in report.findings]
    for f in folder.iterdir():
        assert (downloaded / f.name).read_bytes() == f.read_bytes()


def test_unchanged_push_makes_no_commit_and_a_changed_shard_is_all_that_is_sent(hub, tmp_path):
    _, folder = make_checkpoint(tmp_path)
    env = hub_env(hub, tmp_path / "home")
    assert run_shardkit(env, "push", folder, REPO).returncode == 0
    history = list(hub.state.repo(REPO).history)

    before = len(hub.state.requests)
    proc = run_shardkit(env, "push", folder, REPO)
    assert proc.returncode == 0 and "nothing to upload" in proc.stdout
    assert hub.state.repo(REPO).history == history
    assert [r for r in writes(hub) if hub.state.requests.index(r) >= before] == []

    _, changed = make_checkpoint(tmp_path, "changed", changed_last=True)
    assert shard_oid(changed, 1) == shard_oid(folder, 1) and shard_oid(changed, 4) != shard_oid(folder, 4)
    proc = run_shardkit(env, "push", changed, REPO, "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    # the manifest records the changed shard's digests, so it changes with it
    assert result["uploaded"] == ["model-00004-of-00004.safetensors", "shardkit.manifest.json"]
    assert len(result["unchanged"]) == 4
    repo = hub.state.repo(REPO)
    assert len(repo.history) == len(history) + 1
    new, old = repo.commits[repo.history[-1]].files, repo.commits[history[-1]].files
    assert {p for p in new if new[p] != old.get(p)} == {"model-00004-of-00004.safetensors", "shardkit.manifest.json"}
    received = hub.state.lfs_bytes_received
    assert received[shard_oid(changed, 4)] == (changed / "model-00004-of-00004.safetensors").stat().st_size
    assert all(received[shard_oid(folder, i)] == received[shard_oid(changed, 4)] for i in range(1, 5))


def test_transient_5xx_is_retried_and_the_push_succeeds(hub, tmp_path):
    _, folder = make_checkpoint(tmp_path)
    hub.state.inject("PUT", "^/lfs-storage/", 503, headers={"Retry-After": "0"})
    hub.state.inject("POST", "/preupload/", 502, headers={"Retry-After": "0"})
    proc = run_shardkit(hub_env(hub, tmp_path / "home"), "push", folder, REPO, "-q")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr  # retries are silent
    statuses = [status for method, path, status in hub.state.requests if method == "PUT"]
    assert statuses.count(503) == 1 and statuses.count(200) == 4
    assert index_problems(hub.state, REPO) == []
    assert set(hub.state.files_at(REPO)) == {".gitattributes", *(f.name for f in folder.iterdir())}


def test_token_permission_revision_and_network_errors_are_one_clear_line(hub, tmp_path):
    _, folder = make_checkpoint(tmp_path)
    line = one_error_line(run_shardkit(hub_env(hub, tmp_path / "h1", token="hf_wrong"), "push", folder, REPO))
    assert "401" in line and "token" in line
    line = one_error_line(run_shardkit(hub_env(hub, tmp_path / "h2", token=None), "push", folder, REPO))
    assert "no Hugging Face token" in line
    env = hub_env(hub, tmp_path / "h3")
    line = one_error_line(run_shardkit(env, "push", folder, "bob/theirs"))
    assert "403" in line and "bob/theirs" in line
    line = one_error_line(run_shardkit(env, "push", folder, REPO, "--revision", "nope", "--create-pr"))
    assert "revision 'nope' not found" in line
    assert not hub.state.repos or all(len(r.history) == 1 for r in hub.state.repos.values())

    with socket.socket() as sock:  # a port where nothing listens
        sock.bind(("127.0.0.1", 0))
        env["HF_ENDPOINT"] = f"http://127.0.0.1:{sock.getsockname()[1]}"
    line = one_error_line(run_shardkit(env, "push", folder, REPO))
    assert "network failure" in line and "run the push again" in line


_PUSH_IN_BATCHES = """
import sys
import shardkit, shardkit.hub.commits
shardkit.hub.commits.MAX_FILES_PER_COMMIT = 2   # force several commits on a tiny checkpoint
result = shardkit.push(sys.argv[1], sys.argv[2])
print(len(result.commits))
"""


def test_interrupted_push_never_exposes_a_broken_index_and_resumes(hub, tmp_path):
    _, folder = make_checkpoint(tmp_path)
    env = hub_env(hub, tmp_path / "home")
    fourth = shard_oid(folder, 4)
    hub.state.inject("PUT", f"^/lfs-storage/{fourth}/", 503, times=None, headers={"Retry-After": "0"})
    with pytest.raises(AssertionError, match=r"failed \(503\).*run the push again"):
        run_python(_PUSH_IN_BATCHES, env, folder, REPO)
    repo = hub.state.repo(REPO)
    assert len(repo.history) == 2  # the repo's first commit, then the batch of shards 1-2; 3 arrived uncommitted
    assert set(hub.state.files_at(REPO)) == {".gitattributes", "model-00001-of-00004.safetensors",
                                             "model-00002-of-00004.safetensors"}
    assert shard_oid(folder, 3) in hub.state.lfs
    assert index_problems(hub.state, REPO) == []

    hub.state.faults.clear()
    assert run_python(_PUSH_IN_BATCHES, env, folder, REPO).stdout.strip() == "2"
    assert index_problems(hub.state, REPO) == []
    assert set(hub.state.files_at(REPO)) == {".gitattributes", *(f.name for f in folder.iterdir())}
    for number in range(1, 5):  # every shard arrived exactly once, across both runs
        size = (folder / f"model-0000{number}-of-00004.safetensors").stat().st_size
        assert hub.state.lfs_bytes_received[shard_oid(folder, number)] == size


def test_xet_push_interrupted_at_commit_resumes_without_resending(hub, tmp_path):
    _, folder = make_checkpoint(tmp_path)
    env = hub_env(hub, tmp_path / "home", xet=True)
    hub.state.inject("POST", "/commit/", 500)  # the commit POST is not retried by the client
    line = one_error_line(run_shardkit(env, "push", folder, REPO, "-q"))
    assert "failed (500)" in line and "run the push again" in line
    assert len(hub.state.repo(REPO).history) == 1

    def xorbs() -> dict[str, tuple[int, int]]:  # the Xet storage's content blocks: name → (bytes, mtime)
        found = hub.state.xet_dir.glob("**/xorbs/xorbs/*")
        return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in found if not p.name.endswith(".tagset")}

    sent = xorbs()
    assert sum(size for size, _ in sent.values()) >= 0.9 * sum(f.stat().st_size for f in folder.glob("*-of-*"))
    assert run_shardkit(env, "push", folder, REPO, "-q").returncode == 0
    assert xorbs() == sent  # nothing was written again: hf_xet deduplicated against what arrived
    assert index_problems(hub.state, REPO) == [] and len(hub.state.repo(REPO).history) == 2


def test_revision_and_create_pr_land_where_they_should(hub, tmp_path):
    _, folder = make_checkpoint(tmp_path)
    env = hub_env(hub, tmp_path / "home")
    assert run_shardkit(env, "push", folder, REPO, "--revision", "fp16", "-q").returncode == 0
    repo = hub.state.repo(REPO)
    assert "model.safetensors.index.json" in hub.state.files_at(REPO, "fp16")
    assert set(hub.state.files_at(REPO, "main")) == {".gitattributes"}

    proc = run_shardkit(env, "push", folder, REPO, "--create-pr", "--path-in-repo", "unet")
    assert proc.returncode == 0, proc.stderr
    assert f"pull request: {hub.url}/{REPO}/discussions/1" in proc.stdout
    assert "unet/model.safetensors.index.json" in hub.state.files_at(REPO, "refs/pr/1")
    assert set(hub.state.files_at(REPO, "main")) == {".gitattributes"}

    _, changed = make_checkpoint(tmp_path, "changed", changed_last=True)
    fp16_head = repo.refs["fp16"]
    assert run_shardkit(env, "push", changed, REPO, "--revision", "fp16", "--create-pr").returncode == 0
    pr = repo.commits[repo.refs["refs/pr/2"]]
    assert pr.parent == fp16_head and repo.refs["fp16"] == fp16_head
    assert pr.files["model-00004-of-00004.safetensors"].sha256 == shard_oid(changed, 4)


def test_dry_run_lists_the_plan_and_changes_nothing(hub, tmp_path):
    _, folder = make_checkpoint(tmp_path)
    env = hub_env(hub, tmp_path / "home")
    proc = run_shardkit(env, "push", folder, REPO, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "would upload 6 file(s)" in proc.stdout and "would create the repository" in proc.stdout
    assert hub.state.repos == {}

    assert run_shardkit(env, "push", folder, REPO, "-q").returncode == 0
    _, changed = make_checkpoint(tmp_path, "changed", changed_last=True)
    (changed / "README.md").write_text("# tiny\n")
    history, start = list(hub.state.repo(REPO).history), len(hub.state.requests)
    proc = run_shardkit(env, "push", changed, REPO, "--dry-run", "--json")
    result = json.loads(proc.stdout)
    assert result["dry_run"] and sorted(result["uploaded"]) == ["README.md", "model-00004-of-00004.safetensors",
                                                                 "shardkit.manifest.json"]
    assert len(result["unchanged"]) == 4
    proc = run_shardkit(env, "push", changed, REPO, "--dry-run", "--json", "--exclude", "*.md")
    assert json.loads(proc.stdout)["uploaded"] == ["model-00004-of-00004.safetensors", "shardkit.manifest.json"]
    proc = run_shardkit(env, "push", changed, REPO, "--dry-run", "--json", "--include", "*.md", "--include", "*.json")
    assert json.loads(proc.stdout)["uploaded"] == ["README.md", "shardkit.manifest.json"]
    assert hub.state.repo(REPO).history == history
    assert {method for method, _, _ in hub.state.requests[start:]} <= {"GET", "HEAD"}


def test_sharded_push_replaces_a_remote_single_file_in_one_commit(hub, tmp_path):
    source, folder = make_checkpoint(tmp_path)
    env = hub_env(hub, tmp_path / "home")
    assert run_shardkit(env, "push", source, REPO, "-q").returncode == 0
    assert "model.safetensors" in hub.state.files_at(REPO)
    proc = run_shardkit(env, "push", folder, REPO, "--json")
    result = json.loads(proc.stdout)
    assert result["deleted"] == ["model.safetensors"] and len(result["commits"]) == 1
    assert set(hub.state.files_at(REPO)) == {".gitattributes", *(f.name for f in folder.iterdir())}


def test_broken_folder_and_oversized_files_are_refused_before_any_request(hub, tmp_path):
    _, folder = make_checkpoint(tmp_path)
    env = hub_env(hub, tmp_path / "home")
    shard = folder / "model-00002-of-00004.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    line = one_error_line(run_shardkit(env, "push", folder, REPO), code=1)
    assert "refusing to push" in line and "model-00002-of-00004" in line

    huge = tmp_path / "huge"
    huge.mkdir()
    with open(huge / "weights.bin", "wb") as f:
        f.truncate(50 * 10**9 + 1)  # sparse: nothing is written or read
    line = one_error_line(run_shardkit(env, "push", huge, REPO, "--no-verify"))
    assert "50 GB per-file limit" in line
    assert hub.state.requests == []

    os.truncate(huge / "weights.bin", 20 * 10**9 + 1)
    proc = run_shardkit(env, "push", huge, REPO, "--no-verify", "--dry-run")
    assert proc.returncode == 0 and "warning:" in proc.stderr and "recommended 20 GB" in proc.stderr


def test_split_push_to(hub, tmp_path):
    source = make_source(tmp_path / "src" / "model.safetensors")
    env = hub_env(hub, tmp_path / "home")
    proc = run_shardkit(env, "split", source, tmp_path / "out", "--max-shard-size", "40KB", "--push-to", REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith(f"{hub.url}/{REPO}/commit/")
    assert "model-00004-of-00004.safetensors" in hub.state.files_at(REPO)
    assert index_problems(hub.state, REPO) == []


# ------------------------------------------------------------------ checks before any work (issue 14, item 12)

def test_push_refuses_an_invalid_repo_id_without_a_request(hub, tmp_path):
    _, folder = make_checkpoint(tmp_path)
    env = hub_env(hub, tmp_path / "home")
    before = len(hub.state.requests)
    line = one_error_line(run_shardkit(env, "push", folder, "not a repo"))
    assert "'not a repo' is not a valid Hub repository id" in line
    assert len(hub.state.requests) == before


@pytest.mark.parametrize("token", [None, "hf_rejected"], ids=["no-token", "rejected-token"])
def test_split_push_to_checks_the_token_before_splitting(hub, tmp_path, token):
    source = make_source(tmp_path / "src" / "model.safetensors")
    env = hub_env(hub, tmp_path / "home", token=token)
    proc = run_shardkit(env, "split", source, tmp_path / "out", "--max-shard-size", "40KB", "--push-to", REPO)
    line = one_error_line(proc)
    assert ("no Hugging Face token" in line) if token is None else ("401" in line or "rejected" in line)
    assert not (tmp_path / "out").exists(), "the split must not run when the push cannot"


def test_split_push_to_an_invalid_repo_id_writes_nothing(hub, tmp_path):
    source = make_source(tmp_path / "src" / "model.safetensors")
    proc = run_shardkit(hub_env(hub, tmp_path / "home"), "split", source, tmp_path / "out", "--push-to", "a/b/c")
    assert "not a valid Hub repository id" in one_error_line(proc)
    assert not (tmp_path / "out").exists()


def test_push_dry_run_offline_shows_the_local_plan(tmp_path):
    """No Hub reachable: a dry run lists what it would send instead of failing (issue 14, item 18)."""
    _, folder = make_checkpoint(tmp_path)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE"))}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{port}", HF_HOME=str(tmp_path / "home"), HF_TOKEN="hf_x",
               HF_HUB_ETAG_TIMEOUT="2", HF_HUB_DOWNLOAD_TIMEOUT="2")
    proc = run_shardkit(env, "push", folder, REPO, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    files = len(os.listdir(folder))
    assert "dry run without the Hub" in proc.stdout and f"would upload at most {files} file(s)" in proc.stdout
    as_json = json.loads(run_shardkit(env, "push", folder, REPO, "--dry-run", "--json").stdout)
    assert "not reachable" in as_json["offline"] and len(as_json["uploaded"]) == files
    real = run_shardkit(env, "push", folder, REPO)
    assert real.returncode == 2 and "network failure" in real.stderr


_COUNT_HASHING = """
import sys
import os
import huggingface_hub.lfs, shardkit, shardkit.hub.commits
calls = []
real_file, real_obj = shardkit.hub.commits.sha256_file, huggingface_hub.lfs.sha_fileobj
shardkit.hub.commits.sha256_file = lambda f: calls.append(f.local_path) or real_file(f)
huggingface_hub.lfs.sha_fileobj = lambda f, *a, **k: calls.append(os.path.realpath(f.name)) or real_obj(f, *a, **k)
shardkit.push(sys.argv[1], sys.argv[2], verify=sys.argv[3] == "verify")
print(sorted(p.rsplit("/", 1)[-1] for p in calls))
"""


def test_push_takes_digests_from_verify_or_the_manifest_instead_of_hashing_again(hub, tmp_path):
    _, folder = make_checkpoint(tmp_path)
    env = hub_env(hub, tmp_path / "home")
    # verify reads every byte once; neither the comparison nor the upload hashes again
    assert run_python(_COUNT_HASHING, env, folder, REPO, "verify").stdout.strip() == "[]"
    _, changed = make_checkpoint(tmp_path, "changed", changed_last=True)
    # --no-verify: the manifest vouches for the small files (sha256) not modified after it; shards are
    # recorded by crc32s only (hashing them at write time would double a split's time), so push hashes them
    hashed = run_python(_COUNT_HASHING, env, changed, REPO, "no-verify").stdout.strip()
    assert "model.safetensors.index.json" not in hashed and "shardkit.manifest.json" not in hashed
    assert "model-00004-of-00004.safetensors" in hashed
    assert hub.state.files_at(REPO)["model-00004-of-00004.safetensors"].sha256 == shard_oid(changed, 4)
