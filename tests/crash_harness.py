#!/usr/bin/env python3
"""Crash-consistency harness, long mode: SIGKILL shardkit at every fault point of every scenario.

    .venv/bin/python tests/crash_harness.py                 # every point + byte kills (300+)
    .venv/bin/python tests/crash_harness.py --budget 8      # a sample per scenario (as in CI)
    .venv/bin/python tests/crash_harness.py --scenario split-in-place --keep

Scenarios: split into a new folder, over another checkpoint, in place (sharded → sharded, single →
sharded, sharded → single, with --dtype fp16), merge (new and over an existing file), convert (new
and in place), and split of a diffusers pipeline folder (new, in place, over an older pipeline:
every component plus the copied model_index.json, configs, tokenizer and README). For each, a traced reference run lists every fault point (each write call, each
finished file, each commit step); then the command is re-run from fresh inputs and killed at each
point. The checks after every kill are in tests/helpers_reliability.py. Prints a summary table and
exits 1 if any kill point was not survived.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import helpers_reliability as h  # tests/, this file's folder, is first on sys.path

BYTE_KILLS_PER_SCENARIO = 8


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=int, default=None, help="kill points per scenario (default: all)")
    parser.add_argument("--scenario", action="append", help="run only these scenarios (repeatable)")
    parser.add_argument("--workdir", type=Path, default=None, help="where to build (default: a temp folder)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    args = parser.parse_args(argv)

    root = args.workdir or Path(tempfile.mkdtemp(prefix="shardkit-crash-"))
    root.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    outcomes: list[h.KillOutcome] = []
    try:
        for scenario in h.standard_scenarios(root, extended=True):
            if args.scenario and scenario.name not in args.scenario:
                continue
            outcomes += _run(scenario, root, args.budget)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print()
    print(h.summarize(outcomes))
    failures = [o for o in outcomes if o.problems]
    for o in failures:
        print(f"FAILED {o.scenario} point {o.point} ({o.label}): {'; '.join(o.problems)}")
    print(f"\n{len(outcomes) - len(failures)} of {len(outcomes)} kill points survived "
          f"in {time.monotonic() - started:.0f} s")
    return 1 if failures or not outcomes else 0


def _run(scenario: h.Scenario, root: Path, budget: int | None) -> list[h.KillOutcome]:
    t0 = time.monotonic()
    ref = h.reference_run(scenario, root / f"{scenario.name}-ref")
    outcomes = [h.kill_at(scenario, root / scenario.name, ref, p) for p in h.pick_points(ref, budget)]
    total = ref.points[-1][2] if ref.points else 0
    if budget is None and total:
        for i in range(1, BYTE_KILLS_PER_SCENARIO + 1):
            outcomes.append(h.byte_kill(scenario, root / scenario.name, ref, max(1, total * i // (BYTE_KILLS_PER_SCENARIO + 1))))
    failed = sum(bool(o.problems) for o in outcomes)
    print(f"{scenario.name:<26} {len(ref.points):>4} fault points, {len(outcomes):>4} kills, {failed} failed "
          f"({time.monotonic() - t0:.0f} s)", flush=True)
    return outcomes


if __name__ == "__main__":
    raise SystemExit(main())
