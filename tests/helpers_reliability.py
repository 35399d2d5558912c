"""Crash-consistency harness and checkers, shared by the reliability tests and tests/crash_harness.py.

A *scenario* is one shardkit command (split, convert, merge; fresh output, overwrite, in place)
on a small checkpoint with many tensors and shards, or on a diffusers pipeline folder (several
components plus configs, tokenizer and README that are copied and must be fsynced too). The harness runs it once with
``SHARDKIT_FAULT_TRACE`` to list every fault point (each write call, each finished file, each
commit step; see ``shardkit/_faults.py``), then re-runs it from a fresh copy of its inputs and
SIGKILLs it at chosen points. After every kill it checks:

1. the source is bit-identical to before (unless the source *is* the output);
2. right after the kill, the output's visible files are exactly the old state (absent, or the
   previous checkpoint) or exactly the new one — or, only after the commit point of an in-place
   write, a pending journal whose folder still has no index naming a missing or partial shard;
3. opening the output with shardkit (which rolls a pending journal forward) gives exactly the
   old or the new checkpoint, and it verifies;
4. after ``commit.recover`` / the next run, no temporary file, staging folder or journal is left.

Only numpy and safetensors are needed to build checkpoints, so each killed run starts fast.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SHARDKIT_BIN = str(Path(sys.executable).with_name("shardkit"))
TMP_MARKS = (".shardkit-tmp-", ".shardkit-journal")
FAULT_VARS = ("SHARDKIT_FAULT_TRACE", "SHARDKIT_FAULT_KILL_AT", "SHARDKIT_FAULT_KILL_AFTER_BYTES",
              "SHARDKIT_FAULT_ERRNO_AT", "SHARDKIT_FAULT_WAIT_AT", "SHARDKIT_FAULT_WAIT_FILE")


# ----------------------------------------------------------------------------- checkpoints

def make_tensors(n_tensors: int = 48, *, seed: int = 0, total_bytes: int = 1_500_000) -> dict[str, Any]:
    """Seeded numpy tensors of mixed dtypes and sizes (a few KB to ~100 KB each)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    dtypes = [np.float32, np.float16, np.int64, np.uint8, np.float64, np.int32, np.bool_]
    weights = rng.random(n_tensors) + 0.05
    sizes = (weights / weights.sum() * total_bytes).astype(int)
    out: dict[str, Any] = {}
    for i, size in enumerate(sizes):
        dtype = np.dtype(dtypes[i % len(dtypes)])
        numel = max(1, int(size) // dtype.itemsize)
        if dtype == np.bool_:
            arr = rng.integers(0, 2, numel).astype(np.bool_)
        elif dtype.kind == "f":
            arr = rng.standard_normal(numel).astype(dtype)
        else:
            arr = rng.integers(0, 100, numel).astype(dtype)
        out[f"layers.{i // 4}.block.{i % 4}.weight"] = arr.reshape(-1, 2) if numel % 2 == 0 else arr
    return out


def write_checkpoint(folder: str | os.PathLike[str], tensors: dict[str, Any], *, shard_bytes: int | None = None,
                     prefix: str = "model") -> Path:
    """Save ``tensors`` with the official safetensors writer: one file, or shards + index."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if shard_bytes is None:
        save_file(tensors, str(folder / f"{prefix}.safetensors"), metadata={"format": "pt"})
        return folder
    groups: list[dict[str, Any]] = [{}]
    size = 0
    for name, arr in tensors.items():
        if groups[-1] and size + arr.nbytes > shard_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = arr
        size += arr.nbytes
    weight_map = {}
    for i, group in enumerate(groups, 1):
        shard = f"{prefix}-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file(group, str(folder / shard), metadata={"format": "pt"})
        weight_map.update({name: shard for name in group})
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())}, "weight_map": weight_map}
    (folder / f"{prefix}.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return folder


# ----------------------------------------------------------------------------- folder states

def tree_hashes(path: str | os.PathLike[str], *, visible_only: bool = False) -> dict[str, str]:
    """Relative path → sha256 of every file under ``path``; with ``visible_only`` skip shardkit temporaries."""
    root = Path(path)
    if root.is_file():
        return {root.name: hashlib.sha256(root.read_bytes()).hexdigest()}
    if not root.exists():
        return {}
    out = {}
    for p in sorted(root.rglob("*")):
        if visible_only and any(m in part for part in p.relative_to(root).parts for m in TMP_MARKS):
            continue
        if p.is_file():
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def leftovers(*paths: str | os.PathLike[str]) -> list[str]:
    """Shardkit temporaries, journals and staging folders in or beside each path."""
    found = []
    for path in map(Path, paths):
        if path.exists() and path.is_dir():
            found += [str(p) for p in path.rglob("*") if any(m in p.name for m in TMP_MARKS)]
        parent = path.parent
        if parent.exists():  # staging folders of a folder output, temporaries of a file output
            found += [str(p) for p in parent.iterdir()
                      if p.name.startswith(f".{path.name}.shardkit-tmp-") or p.name.startswith(TMP_MARKS)]
    return sorted(found)


def index_invariant_problems(folder: str | os.PathLike[str]) -> list[str]:
    """Every visible index names only shards that exist, parse, and hold exactly its tensors.

    Checked with the official safetensors reader, independently of shardkit's own.
    """
    from safetensors import safe_open

    folder = Path(folder)
    problems = []
    if not folder.is_dir():
        return problems
    indexes = [*folder.glob("*.index*.json"), *folder.glob("*/*.index*.json")]  # */: pipeline components
    for index_path in (p for p in indexes if not p.name.startswith(".")):
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            problems.append(f"{index_path.name}: unreadable index ({e})")
            continue
        for shard in sorted(set(weight_map.values())):
            names = {t for t, s in weight_map.items() if s == shard}
            try:
                with safe_open(str(index_path.parent / shard), framework="numpy") as f:
                    keys = set(f.keys())
                    for key in keys:
                        f.get_tensor(key)
            except Exception as e:  # noqa: BLE001 - any failure is the finding
                problems.append(f"{index_path.name} names {shard}, which is missing or partial ({type(e).__name__}: {e})")
                continue
            if keys != names:
                problems.append(f"{index_path.name}: {shard} holds {sorted(keys ^ names)[:3]} differently")
    return problems


def verify_problems(folder: str | os.PathLike[str]) -> list[str]:
    """Findings of ``shardkit.verify`` (a crash of verify is a finding too)."""
    from shardkit.checking.verify import verify

    try:
        report = verify(str(folder))
    except Exception as e:  # noqa: BLE001 - a crash of verify is a finding too
        return [f"shardkit.verify raised {type(e).__name__}: {e}"]
    return [] if report.ok else [str(f) for f in report.findings]


# ----------------------------------------------------------------------------- running shardkit

def clean_env(**faults: Any) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in FAULT_VARS}
    env.update({k: str(v) for k, v in faults.items()})
    return env


def run_shardkit(args: Iterable[Any], *, timeout: float = 120, **faults: Any) -> subprocess.CompletedProcess:
    return subprocess.run([SHARDKIT_BIN, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=clean_env(**faults))


def read_trace(path: str | os.PathLike[str]) -> list[tuple[int, str, int]]:
    """``[(n, label, bytes_so_far)]`` from a SHARDKIT_FAULT_TRACE file."""
    if not os.path.exists(path):
        return []
    out = []
    for line in Path(path).read_text().splitlines():
        n, label, nbytes = line.split()
        out.append((int(n), label, int(nbytes)))
    return out


# ----------------------------------------------------------------------------- scenarios

@dataclass
class Scenario:
    """One command; ``prepare(work)`` builds fresh inputs and returns (source, output) paths."""

    name: str
    args: Callable[[Path, Path], list[str]]
    prepare: Callable[[Path], tuple[Path, Path]]
    in_place: bool = False
    idempotent: bool = True  # False: re-running the command on its own output means something else


@dataclass
class KillOutcome:
    scenario: str
    point: int
    label: str
    killed: bool
    state_after_kill: str  # absent | old | new | pending
    state_after_recovery: str  # old | new
    problems: list[str] = field(default_factory=list)


@dataclass
class Reference:
    points: list[tuple[int, str, int]]
    old: dict[str, str]
    new: dict[str, str]
    source: dict[str, str]


def prepare_fresh(scenario: Scenario, work: Path) -> tuple[Path, Path]:
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    return scenario.prepare(work)


def reference_run(scenario: Scenario, work: Path) -> Reference:
    """Run once, unharmed, recording every fault point and the new output."""
    src, out = prepare_fresh(scenario, work)
    old, source = tree_hashes(out), tree_hashes(src)
    trace = work.parent / f"{work.name}.trace"
    trace.unlink(missing_ok=True)
    proc = run_shardkit(scenario.args(src, out), SHARDKIT_FAULT_TRACE=trace)
    assert proc.returncode == 0, f"{scenario.name}: reference run failed: {proc.stderr}"
    new = tree_hashes(out)
    assert new and new != old, f"{scenario.name}: reference run changed nothing"
    return Reference(read_trace(trace), old, new, source)


def classify(state: dict[str, str], ref: Reference) -> str:
    if state == ref.new:
        return "new"
    if state == ref.old:
        return "absent" if not state else "old"
    return "mixed"


def kill_at(scenario: Scenario, work: Path, ref: Reference, point: int) -> KillOutcome:
    """Kill the scenario's command at fault point ``point`` and check every invariant."""
    src, out = prepare_fresh(scenario, work)
    label = ref.points[point - 1][1] if 0 < point <= len(ref.points) else "?"
    proc = run_shardkit(scenario.args(src, out), SHARDKIT_FAULT_KILL_AT=point)
    outcome = KillOutcome(scenario.name, point, label, proc.returncode == -signal.SIGKILL, "?", "?")
    if not outcome.killed:
        outcome.problems.append(f"not killed: exit {proc.returncode} {proc.stderr.strip()[:200]}")
    check_after_kill(scenario, src, out, ref, outcome, rerun=point % 2 == 0 and scenario.idempotent)
    return outcome


def check_after_kill(scenario: Scenario, src: Path, out: Path, ref: Reference, outcome: KillOutcome, *,
                     rerun: bool = False) -> None:
    problems = outcome.problems
    if not scenario.in_place and tree_hashes(src) != ref.source:
        problems.append("source changed")
    visible = tree_hashes(out, visible_only=True)
    state = classify(visible, ref)
    journal = any(Path(out).glob(".shardkit-journal.json")) if out.is_dir() else False
    if state == "mixed" and journal:
        state = "pending"
    outcome.state_after_kill = state
    if state == "mixed":
        problems.append(f"visible files are neither old nor new right after the kill: {sorted(visible)}")
    problems += index_invariant_problems(out)
    _settle_with_shardkit(out, problems)
    if rerun:
        _rerun(scenario, src, out, problems)
    else:
        from shardkit.atomic.commit import recover

        recover(out if out.suffix != ".safetensors" else out.parent)
    after = classify(tree_hashes(out, visible_only=True), ref)
    outcome.state_after_recovery = after
    if after not in ("absent", "old", "new"):
        problems.append(f"after recovery the output is neither old nor new: {sorted(tree_hashes(out))}")
    if after in ("old", "new"):
        problems += verify_problems(out)
    if rerun and after != "new":
        problems.append(f"after the next run the output is {after}, not the new checkpoint")
    if state == "pending" and after != "new":
        problems.append("a journal was pending but recovery did not produce the new checkpoint")
    if leftovers(out, src):
        problems.append(f"leftovers after recovery: {leftovers(out, src)}")


def _rerun(scenario: Scenario, src: Path, out: Path, problems: list[str]) -> None:
    """The next run of the same command must succeed, or refuse cleanly an output that is complete."""
    proc = run_shardkit(scenario.args(src, out))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    if proc.returncode != 0 and not (proc.returncode == 2 and len(lines) == 1 and "exists" in lines[0]):
        problems.append(f"the next run failed: exit {proc.returncode}: {proc.stderr.strip()[:300]}")


def _settle_with_shardkit(out: Path, problems: list[str]) -> None:
    """Open the output as any shardkit reader would (this rolls a pending journal forward)."""
    if not out.exists() or out.is_dir() and not any(p for p in out.iterdir() if not p.name.startswith(".")):
        return
    from shardkit.atomic.snapshot import settle
    from shardkit.formats.layout import find_components, is_pipeline_folder
    from shardkit.sources import open_source

    try:
        if out.is_dir():  # a pending commit may have removed model_index.json first (it is a .json)
            settle(out)
        if is_pipeline_folder(out):  # one transaction for the whole folder: its journal is at the top
            folders = [c.path for c in find_components(out) if c.has_weights]
        else:
            folders = [str(out)]
        for folder in folders:
            with open_source(folder) as source:
                source.entries()
    except Exception as e:  # noqa: BLE001
        problems.append(f"shardkit could not open the output after the kill: {type(e).__name__}: {e}")


MUST_KILL = ("write:small-file", "file-done:side-file", "commit:before-commit-point", "commit:after-commit-point", "commit:renamed",
             "commit:before-journal-removal", "commit:before-staging-rename", "commit:before-file-rename")


def pick_points(ref: Reference, budget: int | None) -> list[int]:
    """All points, or ``budget`` of them: one of each commit step kind, the rest spread evenly."""
    n = len(ref.points)
    if budget is None or budget >= n:
        return list(range(1, n + 1))
    first_of: dict[str, int] = {}
    for p, label, _ in ref.points:
        if label in MUST_KILL:
            first_of.setdefault(label, p)
    chosen = set(list(first_of.values())[:budget])
    spare = budget - len(chosen)
    for i in range(spare):
        chosen.add(1 + round(i * (n - 1) / max(spare - 1, 1)))
    return sorted(chosen)[:budget] if len(chosen) > budget else sorted(chosen)


def run_scenario(scenario: Scenario, root: Path, *, budget: int | None = None,
                 on_outcome: Callable[[KillOutcome], None] | None = None) -> list[KillOutcome]:
    ref = reference_run(scenario, root / f"{scenario.name}-ref")
    outcomes = []
    for point in pick_points(ref, budget):
        outcome = kill_at(scenario, root / scenario.name, ref, point)
        outcomes.append(outcome)
        if on_outcome:
            on_outcome(outcome)
    return outcomes


def byte_kill(scenario: Scenario, work: Path, ref: Reference, nbytes: int) -> KillOutcome:
    """Kill at the first fault point after ``nbytes`` output bytes were written."""
    src, out = prepare_fresh(scenario, work)
    proc = run_shardkit(scenario.args(src, out), SHARDKIT_FAULT_KILL_AFTER_BYTES=nbytes)
    outcome = KillOutcome(scenario.name, -nbytes, f"after {nbytes} bytes", proc.returncode == -signal.SIGKILL, "?", "?")
    if not outcome.killed:
        outcome.problems.append(f"not killed: exit {proc.returncode}")
    check_after_kill(scenario, src, out, ref, outcome)
    return outcome


# ----------------------------------------------------------------------------- the scenario set

TENSORS_A = dict(n_tensors=48, seed=1)
TENSORS_B = dict(n_tensors=48, seed=2)
PIPELINE_UNET = dict(n_tensors=24, seed=3, total_bytes=800_000)
PIPELINE_TEXT_ENCODER = dict(n_tensors=12, seed=4, total_bytes=400_000)


def _master(cache: dict, key: str, write: Callable[[Path], Any]) -> Callable[[Path], None]:
    """``build(dest)``: copy a master input to ``dest``, writing the master once per root."""
    def build(dest: Path) -> None:
        master = Path(cache["root"]) / key
        if not master.exists():
            building = master.with_name(master.name + ".building")
            shutil.rmtree(building, ignore_errors=True)
            write(building)
            building.rename(master)
        shutil.copytree(master, dest)
    return build


def _cached(tensors_args: dict[str, Any], shard_bytes: int | None, cache: dict) -> Callable[[Path], None]:
    key = hashlib.sha256(repr((tuple(sorted(tensors_args.items())), shard_bytes)).encode()).hexdigest()[:12]
    return _master(cache, key, lambda dest: write_checkpoint(dest, make_tensors(**tensors_args), shard_bytes=shard_bytes))


Prepare = Callable[[Path], tuple[Path, Path]]


def _into_new(build: Callable[[Path], None], name: str = "src") -> Prepare:
    """The input built at ``work/name``, written into a new ``work/out``."""
    def prepare(work: Path) -> tuple[Path, Path]:
        build(work / name)
        return work / name, work / "out"
    return prepare


def _in_place(build: Callable[[Path], None], name: str = "ckpt") -> Prepare:
    """The input built at ``work/name``, rewritten in place."""
    def prepare(work: Path) -> tuple[Path, Path]:
        build(work / name)
        return work / name, work / name
    return prepare


def standard_scenarios(root: Path, *, extended: bool = False) -> list[Scenario]:
    """split fresh / overwrite / in place, merge, convert, and split of a pipeline folder."""
    cache: dict[Any, Any] = {"root": root / "masters"}
    (root / "masters").mkdir(parents=True, exist_ok=True)
    sharded_a = _cached(TENSORS_A, 400_000, cache)
    sharded_b = _cached(TENSORS_B, 400_000, cache)
    single_a = _cached(TENSORS_A, None, cache)

    fresh, in_place, single_in_place = _into_new(sharded_a), _in_place(sharded_a), _in_place(single_a)

    def overwrite(work: Path) -> tuple[Path, Path]:
        sharded_a(work / "src")
        sharded_b(work / "out")
        return work / "src", work / "out"

    scenarios = [
        Scenario("split-fresh", lambda s, o: ["split", s, o, "--max-shard-size", "250KB", "-q"], fresh),
        Scenario("split-overwrite", lambda s, o: ["split", s, o, "--max-shard-size", "400KB", "--overwrite", "-q"], overwrite),
        Scenario("split-in-place", lambda s, o: ["split", s, o, "--max-shard-size", "300KB", "--overwrite", "-q"],
                 in_place, in_place=True),
        Scenario("split-single-in-place", lambda s, o: ["split", s, o, "--max-shard-size", "500KB", "--overwrite", "-q"],
                 single_in_place, in_place=True),
    ]
    if extended:
        scenarios += [
            Scenario("split-in-place-fp16", lambda s, o: ["split", s, o, "--max-shard-size", "300KB", "--dtype", "fp16",
                                                          "--overwrite", "-q"], in_place, in_place=True),
            Scenario("split-in-place-to-single", lambda s, o: ["split", s, o, "--max-shard-size", "50MB", "--overwrite", "-q"],
                     in_place, in_place=True),
        ]
    single_b = _cached(TENSORS_B, None, cache)

    def merge_fresh(work: Path) -> tuple[Path, Path]:
        sharded_a(work / "src")
        return work / "src", work / "merged.safetensors"

    def merge_overwrite(work: Path) -> tuple[Path, Path]:
        sharded_a(work / "src")
        single_b(work / "old")
        (work / "old" / "model.safetensors").rename(work / "merged.safetensors")
        shutil.rmtree(work / "old")
        return work / "src", work / "merged.safetensors"

    convert = ["--rename", "layers.=blocks.", "--max-shard-size", "350KB", "-q"]
    scenarios += [
        Scenario("merge-fresh", lambda s, o: ["merge", s, o, "-q"], merge_fresh),
        Scenario("merge-overwrite", lambda s, o: ["merge", s, o, "--overwrite", "-q"], merge_overwrite),
        Scenario("convert-fresh", lambda s, o: ["convert", s, o, *convert], fresh),
    ]
    if extended:
        scenarios.append(Scenario("convert-in-place", lambda s, o: ["convert", s, o, *convert, "--overwrite"],
                                  in_place, in_place=True, idempotent=False))
    return scenarios + pipeline_scenarios(cache, extended=extended)


def _cached_pipeline(cache: dict) -> Callable[[Path], None]:
    """A diffusers pipeline folder (unet + text_encoder with configs, tokenizer, scheduler, README)."""
    from helpers_pipeline import write_pipeline_folder

    components = {"unet": PIPELINE_UNET, "text_encoder": PIPELINE_TEXT_ENCODER}
    return _master(cache, "pipeline", lambda dest: write_pipeline_folder(
        dest, {name: make_tensors(**args) for name, args in components.items()}))


def pipeline_scenarios(cache: dict, *, extended: bool = False) -> list[Scenario]:
    """split of a whole pipeline folder: into a new folder, over another pipeline, in place."""
    pipeline = _cached_pipeline(cache)
    fresh, in_place = _into_new(pipeline, "pipe"), _in_place(pipeline, "pipe")

    def overwrite(work: Path) -> tuple[Path, Path]:  # an older, unsharded pipeline with other configs
        pipeline(work / "pipe")
        pipeline(work / "out")
        (work / "out" / "unet" / "config.json").write_text('{"old": true}')
        (work / "out" / "README.md").write_text("an older pipeline\n")
        return work / "pipe", work / "out"

    args = ["--max-shard-size", "200KB", "-q"]
    scenarios = [
        Scenario("pipeline-fresh", lambda s, o: ["split", s, o, *args], fresh),
        Scenario("pipeline-in-place", lambda s, o: ["split", s, o, *args, "--overwrite"], in_place, in_place=True),
    ]
    if extended:
        scenarios.append(Scenario("pipeline-overwrite", lambda s, o: ["split", s, o, *args, "--overwrite"], overwrite))
    return scenarios


def summarize(outcomes: list[KillOutcome]) -> str:
    """A table: scenario, kill points, killed, state counts, failures."""
    rows = {}
    for o in outcomes:
        row = rows.setdefault(o.scenario, {"points": 0, "killed": 0, "failed": 0, "states": {}})
        row["points"] += 1
        row["killed"] += o.killed
        row["failed"] += bool(o.problems)
        key = f"{o.state_after_kill}->{o.state_after_recovery}"
        row["states"][key] = row["states"].get(key, 0) + 1
    lines = [f"{'scenario':<26} {'points':>6} {'killed':>6} {'survived':>8}  states after kill -> after recovery"]
    for name, row in rows.items():
        states = ", ".join(f"{k}: {v}" for k, v in sorted(row["states"].items()))
        lines.append(f"{name:<26} {row['points']:>6} {row['killed']:>6} {row['points'] - row['failed']:>8}  {states}")
    total = len(outcomes)
    failed = sum(bool(o.problems) for o in outcomes)
    lines.append(f"{'total':<26} {total:>6} {sum(o.killed for o in outcomes):>6} {total - failed:>8}")
    return "\n".join(lines)


def wait_for(predicate: Callable[[], bool], *, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.01)
