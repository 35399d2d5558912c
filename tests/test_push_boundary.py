"""``push`` uploads only what the folder holds, read through checked descriptors (issue 30).

Before: a journal moved an outside secret in as README.md during verify and push uploaded it (rc 0);
README.md swapped for a link during verification was uploaded by path; names with newlines and
control characters were committed; ``--follow-symlinks`` uploaded ``/proc/self/environ`` (the token
included). Every push runs against the offline Hub (tests/hub_server.py) on 127.0.0.1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers_hub import hub_env, run_python, run_shardkit
from test_push_symlinks import REPO, SECRET, commits_received, make_checkpoint, one_error_line

pytestmark = pytest.mark.hub


def _uploaded(hub) -> bytes:
    """Everything the server received: commit bodies and LFS uploads."""
    repo = hub.state.repos.get(("model", REPO))
    if repo is None:
        return b""
    blobs = [e.content or b"" for c in repo.commits.values() for e in c.files.values()]
    return b"".join(blobs) + b"".join(bytes(v) for v in hub.state.lfs.values() if isinstance(v, bytes))


def test_a_journal_cannot_move_a_secret_in_for_the_upload(hub, tmp_path):
    folder = make_checkpoint(tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / ".shardkit-tmp-1-abcd-README.md").write_bytes(SECRET)
    (folder / "evil").symlink_to(outside)
    (folder / ".shardkit-journal.json").write_text(json.dumps({
        "remove_first": [], "delete": [],
        "renames": [["evil/.shardkit-tmp-1-abcd-README.md", "README.md"]]}))
    env = hub_env(hub, tmp_path / "home")
    line = one_error_line(run_shardkit(env, "push", folder, REPO))
    assert "journal" in line
    assert not (folder / "README.md").exists() and (outside / ".shardkit-tmp-1-abcd-README.md").exists()
    assert commits_received(hub) == [] and SECRET not in _uploaded(hub)


_SWAP_DURING_VERIFY = """
import os, sys
import shardkit, shardkit.hub.push as p
real = p.verify_folder
def verify_then_swap(path, **options):
    report = real(path, **options)
    os.unlink(os.path.join(path, "README.md"))
    os.symlink(sys.argv[3], os.path.join(path, "README.md"))
    return report
p.verify_folder = verify_then_swap
try:
    shardkit.push(sys.argv[1], sys.argv[2])
except shardkit.errors.ShardkitError as e:
    print("refused:", e)
"""


def test_a_file_swapped_for_a_link_after_verification_is_not_uploaded(hub, tmp_path):
    folder = make_checkpoint(tmp_path)
    (folder / "README.md").write_text("# tiny\n")
    proc = run_python(_SWAP_DURING_VERIFY, hub_env(hub, tmp_path / "home"), folder, REPO, tmp_path / "secret.txt")
    assert proc.stdout.startswith("refused:") and "README.md" in proc.stdout, proc.stdout
    assert SECRET not in _uploaded(hub)


@pytest.mark.parametrize("name", ["a\nb.txt", "tab\there.txt", "esc\x1b[2J.txt", "del\x7f.txt"])
def test_names_with_control_characters_are_refused(name: str, hub, tmp_path):
    folder = make_checkpoint(tmp_path)
    (folder / name).write_text("x")
    line = one_error_line(run_shardkit(hub_env(hub, tmp_path / "home"), "push", folder, REPO))
    assert "control characters" in line and "\x1b" not in line
    assert hub.state.requests == []


@pytest.mark.parametrize("target", ["/proc/self/environ", "/proc/self/cmdline", "/sys/kernel/mm/transparent_hugepage/enabled",
                                    "/dev/zero", "/dev/null"])
def test_follow_symlinks_refuses_special_files(target: str, hub, tmp_path):
    if not Path(target).exists():
        pytest.skip(f"{target} does not exist here")
    folder = make_checkpoint(tmp_path)
    (folder / "README.md").symlink_to(target)
    env = hub_env(hub, tmp_path / "home")
    for extra in (["--follow-symlinks"], ["--follow-symlinks", "--no-verify"]):
        line = one_error_line(run_shardkit(env, "push", folder, REPO, *extra))
        assert "README.md" in line and "/" + target.split("/")[1] + "/" in line
    assert hub.state.requests == [] and b"hf_test_token" not in _uploaded(hub)


def test_follow_symlinks_names_each_link_it_followed(hub, tmp_path):
    folder = make_checkpoint(tmp_path)
    (folder / "token.txt").symlink_to(tmp_path / "secret.txt")
    proc = run_shardkit(hub_env(hub, tmp_path / "home"), "push", folder, REPO, "--follow-symlinks")
    assert proc.returncode == 0, proc.stderr
    assert f"token.txt -> {tmp_path / 'secret.txt'}" in proc.stdout


def test_a_fifo_in_the_folder_is_refused_before_any_request(hub, tmp_path):
    import os

    folder = make_checkpoint(tmp_path)
    os.mkfifo(folder / "notes.txt")
    env = hub_env(hub, tmp_path / "home")
    for extra in ([], ["--no-verify"]):
        line = one_error_line(run_shardkit(env, "push", folder, REPO, *extra, timeout=60))
        assert "notes.txt" in line
    assert hub.state.requests == []
