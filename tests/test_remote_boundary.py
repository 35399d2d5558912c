"""A hostile ``hf://`` endpoint (issue 30): its listing is validated like an index before anything is created.

The offline Hub (tests/hub_server.py) on 127.0.0.1 plays a misconfigured ``HF_ENDPOINT`` or a
mirror that lists ``../../x.safetensors``, ``sub/../../y``, absolute paths, control characters,
impossible sizes or a file that is also a folder. Before, ``info``/``verify``/``fit``/``plan``
created files outside the temporary mirror and overwrote an existing outside ``*.safetensors``
with the server's bytes, and ``split --no-cache`` left a 0-byte file outside on a 404. Now every
such listing is one line (exit 2) and nothing is created outside, or left behind, anywhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers_hub import hub_env, lazy_safetensors, run_shardkit

pytestmark = pytest.mark.hub

REPO = "alice/evil"


def _good() -> dict:
    tensors = {"w": ("F32", (4, 4))}
    return {"model.safetensors": lazy_safetensors(tensors), "config.json": b'{"model_type": "llama"}'}


def _env(hub, tmp_path: Path) -> tuple[dict[str, str], Path]:
    """Client environment with its own TMPDIR, so anything the mirror creates (or leaves) is visible."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = hub_env(hub, tmp_path / "home")
    env["TMPDIR"] = str(tmp)
    return env, tmp


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"<dir>") for p in sorted(root.rglob("*"))}


def one_error_line(proc, code: int = 2) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


HOSTILE = {
    "dotdot": "../../x.safetensors",
    "dotdot-deeper": "../../../x.safetensors",
    "sub-dotdot": "sub/../../x.safetensors",
    "absolute": "/x.safetensors",
    "backslash": "..\\..\\x.safetensors",
    "newline": "a\nb.safetensors",
    "empty-part": "sub//x.safetensors",
}


@pytest.mark.parametrize("case", list(HOSTILE))
@pytest.mark.parametrize("command", ["info", "verify", "fit", "split-no-cache"])
def test_a_listing_that_leaves_the_mirror_is_refused_before_anything_is_created(case: str, command: str, hub,
                                                                                 tmp_path: Path) -> None:
    files = _good()
    files[HOSTILE[case]] = lazy_safetensors({"evil": ("F32", (2,))})
    hub.state.add_repo(REPO, files)
    env, tmp = _env(hub, tmp_path)
    victim = tmp / "x.safetensors"  # where ../../x.safetensors lands from the mirror's root
    victim.write_bytes(b"precious")
    (tmp_path / "x.safetensors").write_bytes(b"precious")
    before = _tree(tmp_path)
    args = {"info": ["info", f"hf://{REPO}"], "verify": ["verify", f"hf://{REPO}"],
            "fit": ["fit", f"hf://{REPO}", "--gpu", "1GB"],
            "split-no-cache": ["split", f"hf://{REPO}", tmp_path / "out", "--no-cache", "-q"]}[command]
    line = one_error_line(run_shardkit(env, *args, timeout=120))
    assert "listing" in line, line
    assert victim.read_bytes() == b"precious"
    after = _tree(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("home")} == \
        {k: v for k, v in before.items() if not k.startswith("home")}
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["size-negative", "size-huge", "file-and-folder", "outside-subfolder"])
def test_impossible_listings_are_refused(case: str, hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hub_server

    files = _good()
    if case == "file-and-folder":
        files["sub"] = b"x"
        files["sub/config.json"] = b"{}"
    hub.state.add_repo(REPO, files)
    real = hub_server.Handler._tree

    def hostile_tree(self, repo, revision, folder):  # the endpoint lies about what it holds
        if case in ("size-negative", "size-huge", "outside-subfolder"):
            original = self._paginate

            def lying(items, page_size=50):
                for item in items:
                    if item.get("path") == "model.safetensors":
                        if case == "size-negative":
                            item["size"] = -5
                        elif case == "size-huge":
                            item["size"] = 2**62
                        else:
                            item["path"] = "../model.safetensors"
                return original(items, page_size)

            self._paginate = lying
        return real(self, repo, revision, folder)

    monkeypatch.setattr(hub_server.Handler, "_tree", hostile_tree)
    env, tmp = _env(hub, tmp_path)
    line = one_error_line(run_shardkit(env, "info", f"hf://{REPO}", timeout=120))
    assert "listing" in line
    assert list(tmp.iterdir()) == []


@pytest.mark.parametrize("name", ["README.md", "../../note.txt"])
def test_a_failed_side_file_fetch_leaves_nothing(name: str, hub, tmp_path: Path) -> None:
    """Before: split --no-cache opened the side file before its first byte and left it (0 bytes) on a 404,
    outside the mirror for a listed ``../../note.txt``."""
    files = _good()
    files[name] = b"# model card\n"
    hub.state.add_repo(REPO, files)
    hub.state.inject("GET", r"/resolve/.*(README\.md|note\.txt)", 404, times=None)
    env, tmp = _env(hub, tmp_path)
    proc = run_shardkit(env, "split", f"hf://{REPO}", tmp_path / "out", "--no-cache", "-q", timeout=120)
    one_error_line(proc)
    assert not (tmp_path / "out").exists()
    assert list(tmp.iterdir()) == [], "the temporary mirror (and any partial file) must be gone"


def test_a_clean_listing_still_works(hub, tmp_path: Path) -> None:
    hub.state.add_repo(REPO, _good())
    env, tmp = _env(hub, tmp_path)
    proc = run_shardkit(env, "info", f"hf://{REPO}", "--json", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tensor_count"] == 1
    assert list(tmp.iterdir()) == []
