"""Benchmark: reshard a Hub repository: ``split hf://`` streamed (``--no-cache``) and through the cache,
against ``curl`` of the same bytes (the floor) and the incumbents (``snapshot_download``, then
huggingface_hub's ``save_torch_state_dict``).

The repository is a Stable Diffusion 1.5 UNet in fp32 (3.44 GB: real tensor names and shapes from
diffusers' ``UNet2DConditionModel`` on the meta device, zeros as data) in two shards, served by the
offline Hub of the tests (tests/hub_server.py) on loopback with true sha256 oids. Every case runs in
a fresh process with a fresh HF cache, cases interleaved round by round; the table shows the
median of the rounds, the peak RSS of the process (``wait4``), the body bytes the server sent and
what was left in the HF cache.

    .venv/bin/python scripts/bench_remote_split.py              # 3 rounds
    .venv/bin/python scripts/bench_remote_split.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from bench_remote import hub_env, lazy_weights  # noqa: E402
from helpers_hub import run_measured  # noqa: E402
from hub_server import HubServer  # noqa: E402
from hub_state import LazyBlob  # noqa: E402

REPO = "bench/sd15-unet"
SHARD_LIMIT_BYTES = 2 * 10**9
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


def unet_repo() -> dict[str, bytes | LazyBlob]:
    """config.json plus two fp32 shards and their index, named as diffusers saves them."""
    from accelerate import init_empty_weights
    from diffusers import UNet2DConditionModel

    with init_empty_weights():
        model = UNet2DConditionModel(cross_attention_dim=768)
    return {"config.json": json.dumps(dict(model.config)).encode(),
            **lazy_weights(model, dtype="F32", prefix="diffusion_pytorch_model", limit=SHARD_LIMIT_BYTES, true_oid=True)}


def run_case(argv: list[str], env: dict[str, str]) -> tuple[float, int]:
    """Wall seconds and peak RSS bytes of one fresh process (measured from a small launcher)."""
    code, seconds, peak, stderr = run_measured(argv, env)
    if code != 0:
        raise SystemExit(f"{argv[:4]} failed:\n{stderr}")
    return seconds, peak


def du_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink()) if path.exists() else 0


def cases(url: str, files: dict[str, bytes | LazyBlob], tmp: Path) -> dict[str, list[str]]:
    weights = [name for name in files if name.endswith(".safetensors")]
    curl = ["curl", "-sSf", "--parallel"]
    for name in weights:
        curl += [f"{url}/{REPO}/resolve/main/{name}", "-o", str(tmp / "out" / name)]
    py, cli = sys.executable, [sys.executable, "-m", "shardkit"]
    return {
        "curl (floor: the same bytes to disk)": curl,
        "python start-up + shardkit import": [py, "-c", "import shardkit.cli"],
        "snapshot_download (incumbent, to the cache)": [py, "-c", "import sys; from huggingface_hub import "
                                                        "snapshot_download; snapshot_download(sys.argv[1])", REPO],
        "snapshot_download + save_torch_state_dict (incumbent reshard)": [py, "-c", HF_RESHARD, REPO, str(tmp / "out")],
        "shardkit split hf:// (through the cache)": [*cli, "split", f"hf://{REPO}", str(tmp / "out"),
                                                    "--max-shard-size", "1GB", "-q"],
        "shardkit split hf:// --no-cache (streamed)": [*cli, "split", f"hf://{REPO}", str(tmp / "out"),
                                                      "--max-shard-size", "1GB", "--no-cache", "-q"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    files = unet_repo()
    weight_bytes = sum(len(v) for k, v in files.items() if k.endswith(".safetensors"))
    results: dict[str, list[tuple[float, int, int, int]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-remote-split-", dir=os.environ.get("BENCH_DIR")) as tmp_name, \
            HubServer(Path(tmp_name) / "hub") as hub:
        tmp = Path(tmp_name)
        hub.state.add_repo(REPO, files)
        env = hub_env(hub.url, str(tmp / "home"))
        for _ in range(args.rounds):
            for label, argv in cases(hub.url, files, tmp).items():
                for leftover in (tmp / "out", tmp / "home"):
                    shutil.rmtree(leftover, ignore_errors=True)
                (tmp / "out").mkdir()  # an empty folder: curl and save_torch_state_dict need it, shardkit takes it
                before = hub.state.bytes_sent()
                seconds, peak = run_case(argv, env)
                results.setdefault(label, []).append((seconds, peak, hub.state.bytes_sent() - before,
                                                      du_bytes(tmp / "home")))
    floor = statistics.median(r[0] for r in results["curl (floor: the same bytes to disk)"])
    print(f"repository {REPO}: {weight_bytes / 1e9:.2f} GB of safetensors in {len(files)} files; "
          f"median of {args.rounds} rounds\n")
    print("| case | time | × curl | peak RSS | transferred | left in HF cache |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, rows in results.items():
        seconds = statistics.median(r[0] for r in rows)
        print(f"| {label} | {seconds:.2f} s | {seconds / floor:.2f}× | {max(r[1] for r in rows) / 2**20:,.0f} MiB | "
              f"{statistics.median(r[2] for r in rows) / 1e9:.2f} GB | {statistics.median(r[3] for r in rows) / 1e9:.2f} GB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
