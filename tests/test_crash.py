"""Crash consistency: SIGKILL split, convert, merge and pipeline splits at many points; nothing is lost or half-visible.

See ``tests/helpers_reliability.py`` for what is checked after each kill, and
``tests/crash_harness.py`` for the long mode (every fault point of every scenario, 300+).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import helpers_reliability as h
import pytest

# Kill points per scenario in the default run (the long mode takes all of them).
BUDGETS = {
    "split-fresh": 6, "split-overwrite": 7, "split-in-place": 9, "split-single-in-place": 6,
    "merge-fresh": 3, "merge-overwrite": 3, "convert-fresh": 4, "pipeline-fresh": 5, "pipeline-in-place": 7,
}


@pytest.fixture(scope="module")
def scenario_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("crash")


def _scenarios(root: Path) -> dict[str, h.Scenario]:
    return {s.name: s for s in h.standard_scenarios(root)}


@pytest.mark.parametrize("name", list(BUDGETS))
def test_sigkill_at_fault_points_leaves_old_or_new(name: str, scenario_root: Path) -> None:
    scenario = _scenarios(scenario_root)[name]
    outcomes = h.run_scenario(scenario, scenario_root, budget=BUDGETS[name])
    failures = [o for o in outcomes if o.problems]
    assert len(outcomes) >= min(BUDGETS[name], 3)
    assert all(o.killed for o in outcomes)
    assert not failures, "\n".join(f"point {o.point} ({o.label}): {o.problems}" for o in failures)
    if scenario.in_place:  # in place, some kills must land after the commit point and be rolled forward
        assert any(o.state_after_kill == "pending" for o in outcomes)
        assert {o.state_after_recovery for o in outcomes} == {"old", "new"}


def test_kill_by_bytes_written_mid_shard(scenario_root: Path) -> None:
    """Kills that land inside shards (after the header, between copies) leave nothing visible."""
    scenario = _scenarios(scenario_root)["split-fresh"]
    ref = h.reference_run(scenario, scenario_root / "bytes-ref")
    total = ref.points[-1][2]
    for nbytes in (1, total // 3, total - 1):
        outcome = h.byte_kill(scenario, scenario_root / "bytes", ref, nbytes)
        assert outcome.killed and not outcome.problems, outcome
        assert outcome.state_after_kill == "absent"


def test_in_place_kill_after_commit_point_is_reported_by_a_reader_and_finished_by_recover(tmp_path: Path) -> None:
    """A reader (open_source) never rolls a crashed in-place commit forward: it names `shardkit recover`
    and changes nothing; recover finishes it and the reader then sees exactly the new checkpoint."""
    from shardkit.atomic.commit import JOURNAL, recover
    from shardkit.errors import CheckpointIndexError
    from shardkit.sources import open_source

    scenario = _scenarios(tmp_path)["split-in-place"]
    ref = h.reference_run(scenario, tmp_path / "ref")
    renamed = [p for p, label, _ in ref.points if label == "commit:renamed"]
    src, out = h.prepare_fresh(scenario, tmp_path / "w")
    proc = h.run_shardkit(scenario.args(src, out), SHARDKIT_FAULT_KILL_AT=renamed[len(renamed) // 2])
    assert proc.returncode == -9
    assert (out / JOURNAL).exists()
    assert not (out / "model.safetensors.index.json").exists()  # old index removed first, new one not yet in place
    before = h.tree_hashes(out)
    with pytest.raises(CheckpointIndexError, match="shardkit recover"):
        open_source(str(out))
    assert h.tree_hashes(out) == before and (out / JOURNAL).exists()
    assert recover(str(out))
    with open_source(str(out)) as source:
        names = sorted(e.name for e in source.entries())
    assert not (out / JOURNAL).exists()
    assert h.tree_hashes(out) == ref.new
    assert names == sorted(h.make_tensors(**h.TENSORS_A))


def test_pending_journal_on_a_read_only_folder_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardkit.atomic import snapshot
    from shardkit.errors import CheckpointIndexError

    scenario = _scenarios(tmp_path)["split-in-place"]
    ref = h.reference_run(scenario, tmp_path / "ref")
    after_commit = next(p for p, label, _ in ref.points if label == "commit:after-commit-point")
    src, out = h.prepare_fresh(scenario, tmp_path / "w")
    assert h.run_shardkit(scenario.args(src, out), SHARDKIT_FAULT_KILL_AT=after_commit).returncode == -9

    def read_only(folder: str) -> bool:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(snapshot, "recover", read_only)
    with pytest.raises(CheckpointIndexError, match="interrupted shardkit write"):
        snapshot.settle(str(out))
    monkeypatch.undo()
    proc = h.run_shardkit(["info", out])  # a reading command reports the journal and changes nothing
    assert proc.returncode == 2 and "shardkit recover" in proc.stderr, proc.stderr
    assert (out / ".shardkit-journal.json").exists()
    proc = h.run_shardkit(["recover", out])  # with write access recover finishes the commit
    assert proc.returncode == 0, proc.stderr
    assert h.tree_hashes(out) == ref.new
    assert h.run_shardkit(["info", out]).returncode == 0


def test_fault_points_cost_nothing_when_unset() -> None:
    code = "import shardkit._faults as f; print(f.ACTIVE)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=h.clean_env(), check=True)
    assert out.stdout.strip() == "False"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=h.clean_env(SHARDKIT_FAULT_KILL_AT=3), check=True)
    assert out.stdout.strip() == "True"


def test_recover_never_touches_a_folder_another_writer_holds(tmp_path: Path) -> None:
    """recover() while a live writer holds the folder lock changes nothing (its temporaries survive)."""
    from shardkit.atomic.commit import recover

    scenario = _scenarios(tmp_path)["split-in-place"]
    src, out = h.prepare_fresh(scenario, tmp_path / "w")
    go = tmp_path / "go"
    proc = subprocess.Popen([h.SHARDKIT_BIN, *map(str, scenario.args(src, out))], stderr=subprocess.PIPE, text=True,
                            env=h.clean_env(SHARDKIT_FAULT_WAIT_AT="commit:before-commit-point",
                                            SHARDKIT_FAULT_WAIT_FILE=go))
    try:
        h.wait_for(lambda: any(tmp_path.glob("go.ready.*")))
        before = sorted(os.listdir(out))
        assert any(n.startswith(".shardkit-tmp-") for n in before)
        assert recover(out) is False
        assert sorted(os.listdir(out)) == before
    finally:
        go.touch()
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert not h.leftovers(out)


def test_a_pending_folder_read_as_the_source_of_a_write_elsewhere_is_refused_not_rolled_forward(tmp_path: Path) -> None:
    """The one interrupted-write policy: only a write into the pending folder itself (or recover) finishes it;
    split/convert of it into another folder read it like every reader does, refuse it naming `shardkit recover`,
    and leave it byte for byte as the crash left it; an in-place split of it finishes it first."""
    import shardkit
    from shardkit.atomic.commit import JOURNAL
    from shardkit.errors import CheckpointIndexError

    scenario = _scenarios(tmp_path)["split-in-place"]
    ref = h.reference_run(scenario, tmp_path / "ref")
    renamed = next(p for p, label, _ in ref.points if label == "commit:renamed")
    src, out = h.prepare_fresh(scenario, tmp_path / "w")
    assert h.run_shardkit(scenario.args(src, out), SHARDKIT_FAULT_KILL_AT=renamed + 1).returncode == -9
    before = h.tree_hashes(out)
    for write in (lambda: shardkit.split(str(out), str(tmp_path / "elsewhere"), max_shard_size="1GB"),
                  lambda: shardkit.convert(str(out), str(tmp_path / "elsewhere"))):
        with pytest.raises(CheckpointIndexError, match="shardkit recover"):
            write()
        assert h.tree_hashes(out) == before and (out / JOURNAL).exists()
        assert not (tmp_path / "elsewhere").exists()
    proc = h.run_shardkit(["split", out, tmp_path / "elsewhere"])
    assert proc.returncode == 2 and "shardkit recover" in proc.stderr, proc.stderr
    shardkit.split(str(out), str(out), max_shard_size="1GB", overwrite=True)  # a write into it finishes it first
    assert not (out / JOURNAL).exists()
    with shardkit.open(str(out)) as lazy:
        assert sorted(lazy) == sorted(h.make_tensors(**h.TENSORS_A))


def test_every_reader_handles_a_pending_journal_clearly(tmp_path: Path) -> None:
    """Policy after a crash past the commit point: reading commands (`shardkit verify`/`info`,
    open_source, the lazy `shardkit.open`) never write, so they refuse with a one-line error that says
    how to finish the write; `shardkit recover` finishes it."""
    import shardkit
    from shardkit.atomic.commit import JOURNAL
    from shardkit.errors import ShardkitError

    scenario = _scenarios(tmp_path)["split-in-place"]
    ref = h.reference_run(scenario, tmp_path / "ref")
    renamed = next(p for p, label, _ in ref.points if label == "commit:renamed")
    src, out = h.prepare_fresh(scenario, tmp_path / "w")
    assert h.run_shardkit(scenario.args(src, out), SHARDKIT_FAULT_KILL_AT=renamed + 1).returncode == -9
    with pytest.raises(ShardkitError, match="interrupted shardkit write"):
        shardkit.open(str(out))
    assert (out / JOURNAL).exists()
    proc = h.run_shardkit(["verify", out])
    assert proc.returncode == 2 and "shardkit recover" in proc.stderr, proc.stderr
    assert (out / JOURNAL).exists()
    assert h.run_shardkit(["recover", out]).returncode == 0
    proc = h.run_shardkit(["verify", out])
    assert proc.returncode == 0, proc.stderr
    assert not (out / JOURNAL).exists()
    assert h.tree_hashes(out) == ref.new
    with shardkit.open(str(out)) as lazy:
        assert sorted(lazy) == sorted(h.make_tensors(**h.TENSORS_A))
