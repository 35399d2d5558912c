#!/usr/bin/env python3
"""Hub benchmarks against the tests' offline Hub (tests/hub_server.py, its lazy repositories tests/hub_repos.py) on
loopback: ``split`` (reshard hf://) and ``info`` (info + fit by range reads).
Method: docs/benchmarks.md, "How each benchmark measures".

    .venv/bin/python scripts/bench_hub.py split --runs 3
    .venv/bin/python scripts/bench_hub.py info                     # info + fit; the download's bytes computed
    .venv/bin/python scripts/bench_hub.py info --download          # also time snapshot_download (~34 GB to disk)
    .venv/bin/python scripts/bench_hub.py info --download 'vae/*'  # time the download of part of it
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import benchlib  # first: puts tests/ (the tests' Hub and its helpers) on sys.path
from benchlib import markdown, med
from build_checkpoint import CONFIGS, FLUX_DEV
from helpers_hub import hub_env, run_measured
from hub_repos import hub_flux_repo, hub_unet_repo
from hub_server import HubServer

FLOOR = "curl (floor: the same bytes to disk)"
HF_RESHARD = """
import sys
from huggingface_hub import save_torch_state_dict, snapshot_download
from safetensors.torch import load_file
import json, os
root = snapshot_download(sys.argv[1])
index = json.load(open(os.path.join(root, "diffusion_pytorch_model.safetensors.index.json")))
state = {}
for shard in sorted(set(index["weight_map"].values())):
    state.update(load_file(os.path.join(root, shard)))
save_torch_state_dict(state, sys.argv[2], filename_pattern="diffusion_pytorch_model{suffix}.safetensors",
                      max_shard_size="1GB")
"""


@contextlib.contextmanager
def serve(repo: str, files: dict[str, Any]) -> Iterator[tuple[Path, Any, dict[str, str]]]:
    """A scratch folder, the Hub serving ``files`` as ``repo``, and the environment that points at it."""
    with tempfile.TemporaryDirectory(prefix="bench-hub-", dir=os.environ.get("BENCH_DIR")) as tmp, \
            HubServer(Path(tmp) / "hub") as hub:
        hub.state.add_repo(repo, files)
        yield Path(tmp), hub, hub_env(hub, Path(tmp) / "home", token=None)


def split_cases(repo: str, url: str, files: dict[str, Any], tmp: Path) -> dict[str, list[str]]:
    curl = ["curl", "-sSf", "--parallel"]
    for name in (n for n in files if n.endswith(".safetensors")):
        curl += [f"{url}/{repo}/resolve/main/{name}", "-o", str(tmp / "out" / name)]
    py, split = sys.executable, [sys.executable, "-m", "shardkit", "split", f"hf://{repo}", str(tmp / "out"),
                                 "--max-shard-size", "1GB", "-q"]
    return {
        FLOOR: curl,
        "python start-up + shardkit import": [py, "-c", "import shardkit.cli"],
        "snapshot_download (incumbent, to the cache)": [py, "-c", "import sys; from huggingface_hub import "
                                                        "snapshot_download; snapshot_download(sys.argv[1])", repo],
        "snapshot_download + save_torch_state_dict (incumbent reshard)": [py, "-c", HF_RESHARD, repo, str(tmp / "out")],
        "shardkit split hf:// (through the cache)": split,
        "shardkit split hf:// --no-cache (streamed)": [*split, "--no-cache"],
    }


def bench_split(args: Any) -> str:
    limit = 2 * 10**9 if args.unet == "sd15" else 1 << 20  # sd15: two shards, as diffusers saves it
    repo, files = f"bench/{args.unet}-unet", hub_unet_repo(CONFIGS[args.unet], limit=limit)
    weight_bytes = sum(len(v) for k, v in files.items() if k.endswith(".safetensors"))
    with serve(repo, files) as (tmp, hub, env):
        cases = split_cases(repo, hub.url, files, tmp)

        def one(label: str, r: int) -> dict[str, float]:
            for leftover in (tmp / "out", tmp / "home"):
                shutil.rmtree(leftover, ignore_errors=True)
            (tmp / "out").mkdir()  # an empty folder: curl and save_torch_state_dict need it, shardkit takes it
            before = hub.state.bytes_sent()
            code, seconds, peak, stderr = run_measured(cases[label], env)
            if code != 0:
                raise SystemExit(f"{label} failed:\n{stderr}")
            return {"seconds": seconds, "peak": peak, "sent": hub.state.bytes_sent() - before,
                    "cache": benchlib.tree_bytes(str(tmp / "home"))}

        results = benchlib.rounds(list(cases), args.runs, one,
                                  line=lambda d: f"{d['seconds']:.2f} s, {d['peak'] / 2**20:,.0f} MiB")
    floor = med(results[FLOOR], "seconds")
    rows = [[label, f"{med(rs, 'seconds'):.2f} s", f"{med(rs, 'seconds') / floor:.2f}×",
             f"{max(r['peak'] for r in rs) / 2**20:,.0f} MiB", f"{med(rs, 'sent') / 1e9:.2f} GB",
             f"{med(rs, 'cache') / 1e9:.2f} GB"] for label, rs in results.items()]
    return (f"repository {repo}: {weight_bytes / 1e9:.2f} GB of safetensors in {len(files)} files; median of "
            f"{args.runs} rounds\n\n" + markdown(["case", "time", "× curl", "peak RSS", "transferred",
                                                  "left in HF cache"], rows))


def bench_info(args: Any) -> str:
    repo, files = "bench/FLUX.1-dev", hub_flux_repo(FLUX_DEV)
    repo_bytes = sum(len(v) for v in files.values())
    rows = []
    with serve(repo, files) as (tmp, hub, env):
        for label, argv in (("shardkit info", ["-m", "shardkit", "info", f"hf://{repo}"]),
                            ("shardkit fit --gpu 16GB --gpu 16GB", ["-m", "shardkit", "fit", f"hf://{repo}", "--gpu",
                                                                   "16GB", "--gpu", "16GB"]),
                            *([] if not args.download else [(
                                "snapshot_download" + (f" of {args.download}" if args.download != "*" else ""),
                                ["-c", "import sys; from huggingface_hub import snapshot_download; snapshot_download("
                                 "sys.argv[1], local_dir=sys.argv[2], allow_patterns=[sys.argv[3]])", repo,
                                 f"{tmp}/snapshot", args.download])])):
            before, start = hub.state.bytes_sent(), time.perf_counter()
            subprocess.run([sys.executable, *argv], env=env, check=True, capture_output=True)
            rows.append((label, hub.state.bytes_sent() - before, time.perf_counter() - start))
    if not args.download:
        rows.append(("snapshot_download (not run: --download)", repo_bytes, float("nan")))
    elif args.download != "*":
        rows.append(("snapshot_download (all, at that rate)", repo_bytes, rows[-1][2] * repo_bytes / rows[-1][1]))
    return (f"repository {repo}: {repo_bytes / 1e9:.1f} GB in {len(files)} files\n\n" +
            markdown(["command", "bytes transferred", "time"],
                     [[label, f"{nbytes / 1e6:,.2f} MB", f"{seconds:.1f} s"] for label, nbytes, seconds in rows]))


def main() -> None:
    p = benchlib.parser(__doc__)
    p.add_argument("table", choices=["split", "info"])
    p.add_argument("--unet", choices=["sd15", "tiny"], default="sd15", help="split: the repository (tiny: a check)")
    p.add_argument("--download", nargs="?", const="*", metavar="PATTERN",
                   help="info: also time snapshot_download (of the files matching PATTERN; all: ~34 GB to disk)")
    args = p.parse_args()
    benchlib.publish_report((bench_split if args.table == "split" else bench_info)(args), args.output)


if __name__ == "__main__":
    main()
