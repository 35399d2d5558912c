"""Concurrency: racing writers get one winner and one clean error; readers never see a mix.

Writers: a fresh output is published by renaming a staging folder (only one rename can win); an
existing folder is written under an exclusive flock (the second writer fails at once). Readers
take no lock: ``open_source`` notes the folder's state, opens every file (keeping descriptors),
and retries if a writer changed the folder meanwhile (``shardkit.atomic.snapshot.read_consistently``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import helpers_reliability as h


def _popen(args: list, **faults: object) -> subprocess.Popen:
    return subprocess.Popen([h.SHARDKIT_BIN, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=h.clean_env(**faults))


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_two_splits_into_the_same_new_folder_one_wins(tmp_path: Path) -> None:
    src = h.write_checkpoint(tmp_path / "src", h.make_tensors(**h.TENSORS_A), shard_bytes=400_000)
    out = tmp_path / "out"
    go = tmp_path / "go"
    args = ["split", src, out, "--max-shard-size", "300KB", "-q"]
    # Both write everything into their own staging folder, then both try to publish at once.
    procs = [_popen(args, SHARDKIT_FAULT_WAIT_AT="commit:before-staging-rename", SHARDKIT_FAULT_WAIT_FILE=go)
             for _ in range(2)]
    h.wait_for(lambda: len(list(tmp_path.glob("go.ready.*"))) == 2)
    go.touch()
    results = [(p.wait(timeout=60), p.communicate()[1]) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    loser = next(err for code, err in results if code == 2)
    assert "another process" in _one_line(loser)
    assert not h.verify_problems(out)
    assert h.tree_hashes(src) == h.tree_hashes(tmp_path / "src")
    assert not h.leftovers(out, src)


def test_second_writer_of_an_existing_folder_fails_at_once(tmp_path: Path) -> None:
    ckpt = h.write_checkpoint(tmp_path / "ckpt", h.make_tensors(**h.TENSORS_A), shard_bytes=400_000)
    go = tmp_path / "go"
    first = _popen(["split", ckpt, ckpt, "--max-shard-size", "300KB", "--overwrite", "-q"],
                   SHARDKIT_FAULT_WAIT_AT="commit:before-commit-point", SHARDKIT_FAULT_WAIT_FILE=go)
    try:
        h.wait_for(lambda: any(tmp_path.glob("go.ready.*")))
        second = h.run_shardkit(["split", ckpt, ckpt, "--max-shard-size", "200KB", "--overwrite", "-q"])
        assert second.returncode == 2
        assert "being written by another shardkit process" in _one_line(second.stderr)
    finally:
        go.touch()
    assert first.wait(timeout=60) == 0, first.communicate()[1]
    assert not h.verify_problems(ckpt)
    assert not h.leftovers(ckpt)


WRITER = """
import sys, shardkit
a, b, out, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
for i in range(n):
    # A and B alternate; the shard size changes every two writes, so half of the rewrites keep every
    # file name and header and change only the values: the hardest case for a reader.
    src, size = (a if i % 2 == 0 else b), ("250KB" if i % 4 < 2 else "400KB")
    shardkit.split(src, out, max_shard_size=size, overwrite=True)
"""


def _versions(*tensor_sets: dict) -> dict[str, list[bytes]]:
    return {name: [ts[name].tobytes() for ts in tensor_sets] for name in tensor_sets[0]}


def test_reader_never_sees_a_mix_of_old_and_new(tmp_path: Path) -> None:
    """Reading while another process rewrites the folder (same names and shapes, other values,
    other shard boundaries) yields, every time, entirely one version."""
    from shardkit.sources import open_source

    tensors_a, tensors_b = h.make_tensors(**h.TENSORS_A), h.make_tensors(**h.TENSORS_B)
    a = h.write_checkpoint(tmp_path / "a", tensors_a)
    b = h.write_checkpoint(tmp_path / "b", tensors_b)
    out = tmp_path / "out"
    subprocess.run([sys.executable, "-c", WRITER, a, b, out, "1"], check=True)
    versions = _versions(tensors_a, tensors_b)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, a, b, out, "24"], stderr=subprocess.PIPE, text=True)
    seen = {0: 0, 1: 0}
    try:
        while writer.poll() is None:
            with open_source(str(out)) as source:
                which = set()
                for entry in source.entries():
                    data = bytes(source.read(entry, 0, entry.nbytes))
                    which.add(versions[entry.name].index(data) if data in versions[entry.name] else -1)
                assert sorted(e.name for e in source.entries()) == sorted(versions)
            assert len(which) == 1 and -1 not in which, f"mixed read: versions {which}"
            seen[which.pop()] += 1
    finally:
        _, err = writer.communicate(timeout=120)
    assert writer.returncode == 0, err
    assert seen[0] + seen[1] >= 5, seen
    assert seen[0] and seen[1], f"the reader should have seen both versions: {seen}"
    assert not h.leftovers(out)


def test_reader_waits_out_a_commit_in_progress(tmp_path: Path) -> None:
    """A reader arriving while the journal is live (writer paused mid-commit) waits, then reads the new version."""
    from shardkit.sources import open_source

    tensors_a, tensors_b = h.make_tensors(**h.TENSORS_A), h.make_tensors(**h.TENSORS_B)
    a = h.write_checkpoint(tmp_path / "a", tensors_a, shard_bytes=300_000)
    out = h.write_checkpoint(tmp_path / "out", tensors_b, shard_bytes=400_000)
    go = tmp_path / "go"
    writer = _popen(["split", a, out, "--max-shard-size", "250KB", "--overwrite", "-q"],
                    SHARDKIT_FAULT_WAIT_AT="commit:renamed", SHARDKIT_FAULT_WAIT_FILE=go)
    h.wait_for(lambda: any(tmp_path.glob("go.ready.*")))
    assert (out / ".shardkit-journal.json").exists()
    import threading

    threading.Timer(0.5, go.touch).start()
    with open_source(str(out)) as source:  # the old index is already gone: only waiting gives a result
        data = {e.name: bytes(source.read(e, 0, e.nbytes)) for e in source.entries()}
    assert data == {name: arr.tobytes() for name, arr in tensors_a.items()}
    assert writer.wait(timeout=60) == 0


def test_unrelated_files_changing_beside_a_checkpoint_do_not_stall_readers(tmp_path: Path) -> None:
    """Only checkpoint files count for consistency: a growing download next to it is ignored."""
    import threading

    from shardkit.sources import open_source

    folder = h.write_checkpoint(tmp_path / "ckpt", h.make_tensors(8, total_bytes=4000), shard_bytes=2000)
    single = h.write_checkpoint(tmp_path / "ckpt" / "sub", h.make_tensors(4, total_bytes=400))
    stop = threading.Event()

    def grow() -> None:
        with open(folder / "download.part", "ab") as f:
            while not stop.is_set():
                f.write(b"x")
                f.flush()

    thread = threading.Thread(target=grow)
    thread.start()
    try:
        for path in (folder, folder / "model.safetensors.index.json", single / "model.safetensors"):
            for _ in range(5):
                with open_source(str(path)) as source:
                    assert source.entries()
    finally:
        stop.set()
        thread.join()
