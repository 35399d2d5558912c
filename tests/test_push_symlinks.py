"""``push`` never uploads what a symlink points to outside the folder by accident (issue 27).

The rule is the one ``shardkit.open`` applies (:mod:`shardkit.formats.links`): a file that is a
symlink is followed only inside the folder or into a Hugging Face cache's ``blobs/``. Anything
else is refused before any request, unless ``--follow-symlinks``; links to folders are never
followed. Every push runs the real CLI in a subprocess against the offline Hub
(tests/hub_server.py), whose commits and request log are inspected directly.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from helpers_hub import folder_files, hub_env, run_shardkit

import shardkit

pytestmark = pytest.mark.hub

REPO = "alice/tiny"
SECRET = b"hf_SECRET_TOKEN_never_to_be_published\n"


def make_source(path: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({f"layer.{i}.weight": torch.randn(32, 32, generator=gen) for i in range(4)}, str(path))
    return path


def make_checkpoint(tmp_path: Path) -> Path:
    """A split folder (2 shards, index, manifest) and, beside it, a secret outside the folder."""
    folder = tmp_path / "out"
    shardkit.split(make_source(tmp_path / "src" / "model.safetensors"), folder, max_shard_size="10KB")
    (tmp_path / "secret.txt").write_bytes(SECRET)
    return folder


def one_error_line(proc, code: int = 2) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def commits_received(hub) -> list[tuple[str, str, int]]:
    """Requests that send content or make a commit."""
    return [r for r in hub.state.requests if r[0] in ("PUT", "POST") and ("/commit/" in r[1] or "/lfs" in r[1])]


def test_a_link_leading_outside_is_refused_before_any_request(hub, tmp_path):
    folder = make_checkpoint(tmp_path)
    (folder / "README.md").symlink_to(tmp_path / "secret.txt")
    env = hub_env(hub, tmp_path / "home")
    for extra in ([], ["--dry-run"], ["--json"], ["--no-verify"]):
        line = one_error_line(run_shardkit(env, "push", folder, REPO, *extra))
        assert f"{folder / 'README.md'} is a symlink to {tmp_path / 'secret.txt'}" in line, line
        assert "--follow-symlinks" in line
    assert hub.state.requests == [] and hub.state.repos == {}  # nothing uploaded, no commit, not even a repo


def test_links_inside_the_folder_and_into_a_hf_cache_blob_still_upload(hub, tmp_path):
    folder = make_checkpoint(tmp_path)
    (folder / "docs").mkdir()
    (folder / "docs" / "card.md").write_text("# tiny\n")
    (folder / "CARD.md").symlink_to("docs/card.md")  # relative, inside (not README.md: the client validates its YAML)
    # what `hf download --local-dir` and user scripts leave: a link into a Hugging Face cache's blobs/
    data = b'{"hidden_size": 32}'
    blob = tmp_path / "hf-home" / "hub" / "models--org--tiny" / "blobs" / hashlib.sha256(data).hexdigest()
    blob.parent.mkdir(parents=True)
    blob.write_bytes(data)
    (folder / "config.json").symlink_to(blob)
    proc = run_shardkit(hub_env(hub, tmp_path / "home"), "push", folder, REPO, "--json")
    assert proc.returncode == 0, proc.stderr
    links = {link["path_in_repo"]: link for link in json.loads(proc.stdout)["links"]}
    assert links == {"CARD.md": {"path_in_repo": "CARD.md", "target": str(folder / "docs" / "card.md"),
                                 "outside": False},
                     "config.json": {"path_in_repo": "config.json", "target": str(blob), "outside": False}}
    remote = hub.state.files_at(REPO)
    assert remote["CARD.md"].content == b"# tiny\n" and remote["config.json"].content == data
    assert remote["docs/card.md"].content == b"# tiny\n"


def test_follow_symlinks_uploads_the_target_knowingly_and_dry_run_lists_every_link(hub, tmp_path):
    folder = make_checkpoint(tmp_path)
    (folder / "token.txt").symlink_to(tmp_path / "secret.txt")
    (folder / "card.md").write_text("# tiny\n")
    (folder / "CARD.md").symlink_to("card.md")
    env = hub_env(hub, tmp_path / "home")

    proc = run_shardkit(env, "push", folder, REPO, "--follow-symlinks", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert f"  link       token.txt -> {tmp_path / 'secret.txt'} (outside the folder)" in proc.stdout.splitlines()
    assert any(line.startswith("  link       CARD.md -> ") for line in proc.stdout.splitlines())
    dry = json.loads(run_shardkit(env, "push", folder, REPO, "--follow-symlinks", "--dry-run", "--json").stdout)
    assert [(link["path_in_repo"], link["outside"]) for link in dry["links"]] == [("CARD.md", False), ("token.txt", True)]
    assert hub.state.repos == {}

    proc = run_shardkit(env, "push", folder, REPO, "--follow-symlinks")
    assert proc.returncode == 0, proc.stderr
    assert "followed 1 symlink(s) leading outside the folder (--follow-symlinks)" in proc.stdout
    assert hub.state.files_at(REPO)["token.txt"].content == SECRET


def test_directory_links_are_never_followed(hub, tmp_path):
    folder = make_checkpoint(tmp_path)
    outside = tmp_path / "elsewhere"
    (outside / "deep").mkdir(parents=True)
    (outside / "id_rsa").write_bytes(SECRET)
    (outside / "deep" / "weights.safetensors").write_bytes(b"not for the Hub")
    (folder / "ssh").symlink_to(outside, target_is_directory=True)
    (folder / "same").symlink_to(".", target_is_directory=True)  # a loop, too
    env = hub_env(hub, tmp_path / "home")
    for extra in ([], ["--follow-symlinks"]):
        proc = run_shardkit(env, "push", folder, REPO, "--json", *extra)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["links"] == []
    remote = set(hub.state.files_at(REPO))
    assert remote == {".gitattributes", *(p.name for p in folder.iterdir() if p.is_file() and not p.is_symlink())}
    assert not any(path.startswith(("ssh/", "same/")) for path in remote)


@pytest.mark.parametrize("kind", ["dangling", "device"])
def test_a_link_to_nothing_or_to_a_device_is_one_line(hub, tmp_path, kind):
    folder = make_checkpoint(tmp_path)
    (folder / "notes.txt").symlink_to(tmp_path / "missing" if kind == "dangling" else "/dev/zero")
    env = hub_env(hub, tmp_path / "home")
    for extra in ([], ["--follow-symlinks"]):
        line = one_error_line(run_shardkit(env, "push", folder, REPO, *extra))
        assert "notes.txt is a symlink to" in line and "not a regular file" in line
    assert hub.state.requests == []


def test_split_push_to_refuses_a_link_left_in_the_output(hub, tmp_path):
    """The single-process split (a local source) and the hf:// streamed one (--no-cache) push the same way."""
    source = make_source(tmp_path / "src" / "model.safetensors")
    (tmp_path / "secret.txt").write_bytes(SECRET)
    hub.state.add_repo("alice/src", folder_files(source.parent))
    env = hub_env(hub, tmp_path / "home")
    for name, src, extra in (("local", source, []), ("streamed", "hf://alice/src", ["--no-cache"])):
        out = tmp_path / name
        out.mkdir()
        (out / "README.md").symlink_to(tmp_path / "secret.txt")
        proc = run_shardkit(env, "split", src, out, "--max-shard-size", "10KB", "--overwrite", "--push-to", REPO,
                            *extra)
        line = one_error_line(proc)
        assert f"{out / 'README.md'} is a symlink to {tmp_path / 'secret.txt'}" in line
        assert os.listdir(out) == ["README.md"]  # refused before the split: nothing written
    assert commits_received(hub) == [] and ("model", REPO) not in hub.state.repos

    os.unlink(tmp_path / "streamed" / "README.md")  # the same split, nothing planted: it goes up
    (tmp_path / "streamed" / "CARD.md").write_text("# tiny\n")
    proc = run_shardkit(env, "split", "hf://alice/src", tmp_path / "streamed", "--max-shard-size", "10KB",
                        "--overwrite", "--no-cache", "--push-to", REPO, "-q")
    assert proc.returncode == 0, proc.stderr
    assert hub.state.files_at(REPO)["CARD.md"].content == b"# tiny\n"
