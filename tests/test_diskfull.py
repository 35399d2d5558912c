"""Full disks and I/O errors: one clear error (exit 2), nothing partial published, temporaries removed.

Three ways to fail a write: ``RLIMIT_FSIZE`` in the child (EFBIG from the kernel), an injected
``OSError`` (ENOSPC, EIO, EDQUOT) at any fault point, and a real ENOSPC on a 1 MB tmpfs mounted in
a private user+mount namespace (skipped where unprivileged namespaces are not allowed).
"""

from __future__ import annotations

import resource
import shutil
import subprocess
from pathlib import Path

import helpers_reliability as h
import pytest


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def _run_with_file_size_limit(args: list, limit_bytes: int) -> subprocess.CompletedProcess:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    return subprocess.run([h.SHARDKIT_BIN, *map(str, args)], capture_output=True, text=True, timeout=120,
                          env=h.clean_env(), preexec_fn=limit)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return h.write_checkpoint(tmp_path_factory.mktemp("diskfull") / "ckpt", h.make_tensors(**h.TENSORS_A),
                              shard_bytes=400_000)


def test_file_size_limit_on_fresh_split(checkpoint: Path, tmp_path: Path) -> None:
    src = shutil.copytree(checkpoint, tmp_path / "src")
    before = h.tree_hashes(src)
    proc = _run_with_file_size_limit(["split", src, tmp_path / "out", "--max-shard-size", "1MB", "-q"], 300_000)
    line = _one_error_line(proc)
    assert "too large" in line and "nothing was published" in line
    assert not (tmp_path / "out").exists()
    assert not h.leftovers(tmp_path / "out", src)
    assert h.tree_hashes(src) == before


def test_file_size_limit_in_place_keeps_the_old_checkpoint(checkpoint: Path, tmp_path: Path) -> None:
    ckpt = shutil.copytree(checkpoint, tmp_path / "ckpt")
    before = h.tree_hashes(ckpt)
    proc = _run_with_file_size_limit(["split", ckpt, ckpt, "--max-shard-size", "1MB", "--overwrite", "-q"], 700_000)
    _one_error_line(proc)
    assert h.tree_hashes(ckpt) == before
    assert not h.leftovers(ckpt)
    assert not h.verify_problems(ckpt)


@pytest.mark.parametrize("command", ["merge", "convert"])
def test_file_size_limit_on_merge_and_convert(command: str, checkpoint: Path, tmp_path: Path) -> None:
    src = shutil.copytree(checkpoint, tmp_path / "src")
    out = tmp_path / ("merged.safetensors" if command == "merge" else "out")
    args = [command, src, out, "-q"] + (["--max-shard-size", "1MB"] if command == "convert" else [])
    _one_error_line(_run_with_file_size_limit(args, 300_000))
    assert not out.exists()
    assert not h.leftovers(out, src)


def _points(scenario: h.Scenario, root: Path) -> h.Reference:
    return h.reference_run(scenario, root / f"{scenario.name}-ref")


@pytest.mark.parametrize(("scenario_name", "errno_name"),
                         [("split-fresh", "ENOSPC"), ("split-in-place", "EIO"), ("split-overwrite", "EDQUOT"),
                          ("pipeline-fresh", "ENOSPC")])
def test_injected_write_errors_at_every_kind_of_point(errno_name: str, scenario_name: str, tmp_path: Path) -> None:
    """An OSError at a write, at the index, or at a commit step: one line, old or new, never partial."""
    from shardkit.atomic.commit import JOURNAL
    from shardkit.sources import open_source

    scenario = {s.name: s for s in h.standard_scenarios(tmp_path)}[scenario_name]
    ref = _points(scenario, tmp_path)
    seen: set[str] = set()
    for point, label, _ in ref.points:
        if label in seen:
            continue
        seen.add(label)
        src, out = h.prepare_fresh(scenario, tmp_path / "w")
        proc = h.run_shardkit(scenario.args(src, out), SHARDKIT_FAULT_ERRNO_AT=f"{point}:{errno_name}")
        line = _one_error_line(proc)
        if (out / JOURNAL).exists():  # the error came after the commit point: recover finishes it
            from shardkit.atomic.commit import recover

            assert "committed" in line
            assert recover(str(out))
            with open_source(str(out)):
                pass
            assert h.tree_hashes(out) == ref.new
        elif "published complete" in line:  # after the staging rename only the final folder sync failed
            assert h.tree_hashes(out) == ref.new
        else:
            assert "nothing was published" in line, line
            assert h.tree_hashes(out) == ref.old, label
        if not scenario.in_place:
            assert h.tree_hashes(src) == ref.source
        assert not h.leftovers(out, src), (label, h.leftovers(out, src))
    assert {"write", "write:small-file"} <= seen and seen & {"commit:renamed", "commit:before-staging-rename"}


def _namespace_available(tmp_path: Path) -> bool:
    mnt = tmp_path / "probe"
    mnt.mkdir()
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {mnt}"],
                           capture_output=True, timeout=30) if shutil.which("unshare") else None
    return probe is not None and probe.returncode == 0


def _in_small_tmpfs(mnt: Path, size: str, script: str) -> subprocess.CompletedProcess:
    return subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size={size} tmpfs {mnt} && {script}"],
                          capture_output=True, text=True, timeout=120, env=h.clean_env())


def test_real_full_disk_on_a_small_tmpfs(checkpoint: Path, tmp_path: Path) -> None:
    if not _namespace_available(tmp_path):
        pytest.skip("no unprivileged user+mount namespaces here (needs `unshare -rm`)")
    mnt = tmp_path / "small"
    mnt.mkdir()
    src = shutil.copytree(checkpoint, tmp_path / "src")
    split = f"{h.SHARDKIT_BIN} split {src} {mnt}/out --max-shard-size 300KB -q"
    proc = _in_small_tmpfs(mnt, "1m", f"{split}; echo rc=$? >&2; ls -A {mnt} >&2")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[1:] == ["rc=2"], proc.stderr  # one error line, then nothing at all left on the tmpfs
    assert "no space left on the device" in lines[0] and "nothing was published" in lines[0]
    assert h.tree_hashes(src) == h.tree_hashes(checkpoint)


def test_real_full_disk_in_place_keeps_the_old_checkpoint(checkpoint: Path, tmp_path: Path) -> None:
    if not _namespace_available(tmp_path):
        pytest.skip("no unprivileged user+mount namespaces here (needs `unshare -rm`)")
    mnt = tmp_path / "small"
    mnt.mkdir()
    script = (f"cp -r {checkpoint} {mnt}/ckpt && cd {mnt}/ckpt && sha256sum * > ../before && "
              f"{h.SHARDKIT_BIN} split {mnt}/ckpt {mnt}/ckpt --max-shard-size 300KB --overwrite -q; echo rc=$? >&2; "
              f"sha256sum -c --quiet ../before >&2 && echo intact >&2; ls -A {mnt}/ckpt | grep shardkit >&2; true")
    proc = _in_small_tmpfs(mnt, "2500k", script)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[1:] == ["rc=2", "intact"], proc.stderr
    assert "no space left on the device" in lines[0]
