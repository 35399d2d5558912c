"""Benchmark: ``shardkit info`` / ``fit`` of a Hub repository by range reads vs ``snapshot_download``.

A FLUX.1-dev-sized pipeline (transformer 11.9B, T5-XXL 4.8B, CLIP-L, VAE; bf16, real configs
and real tensor names and shapes from the diffusers/transformers classes built on the meta
device) is served by the offline Hub of the tests (tests/hub_server.py). Its weight files are
:class:`hub_state.LazyBlob` files: real headers, zeros generated as they are sent, so building
the repository costs nothing. The server counts every body byte it sends.

    .venv/bin/python scripts/bench_remote.py                 # info + fit; download bytes computed
    .venv/bin/python scripts/bench_remote.py --download      # also time snapshot_download (~34 GB to disk)
    .venv/bin/python scripts/bench_remote.py --download 'vae/*'   # time the download of part of it
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from hub_server import HubServer  # noqa: E402
from hub_state import LazyBlob  # noqa: E402

REPO = "bench/FLUX.1-dev"
SHARD_BYTES = {"transformer": 10 * 10**9, "text_encoder_2": 5 * 10**9}
FLUX_TRANSFORMER = {"attention_head_dim": 128, "guidance_embeds": True, "in_channels": 64,
                    "joint_attention_dim": 4096, "num_attention_heads": 24, "num_layers": 19,
                    "num_single_layers": 38, "patch_size": 1, "pooled_projection_dim": 768,
                    "axes_dims_rope": [16, 56, 56]}
FLUX_VAE = {"in_channels": 3, "out_channels": 3, "latent_channels": 16, "block_out_channels": [128, 256, 512, 512],
            "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
            "layers_per_block": 2, "norm_num_groups": 32, "sample_size": 1024, "scaling_factor": 0.3611,
            "shift_factor": 0.1159, "use_quant_conv": False, "use_post_quant_conv": False}
T5_XXL = {"d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64, "num_layers": 24, "vocab_size": 32128,
          "feed_forward_proj": "gated-gelu", "is_encoder_decoder": False, "relative_attention_num_buckets": 32}
CLIP_L = {"hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12, "num_hidden_layers": 12,
          "vocab_size": 49408, "max_position_embeddings": 77, "projection_dim": 768, "hidden_act": "quick_gelu"}


def meta_models() -> dict[str, tuple[str, str, Any]]:
    """component → (library, class name, model on the meta device)."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    with init_empty_weights():
        return {"transformer": ("diffusers", "FluxTransformer2DModel", FluxTransformer2DModel(**FLUX_TRANSFORMER)),
                "text_encoder": ("transformers", "CLIPTextModel", CLIPTextModel(CLIPTextConfig(**CLIP_L))),
                "text_encoder_2": ("transformers", "T5EncoderModel", T5EncoderModel(T5Config(**T5_XXL))),
                "vae": ("diffusers", "AutoencoderKL", AutoencoderKL(**FLUX_VAE))}


def lazy_weights(model: Any, *, dtype: str, prefix: str, limit: int = 10**12,
                 true_oid: bool = False) -> dict[str, bytes | LazyBlob]:
    """``model``'s tensors as safetensors files of ``dtype`` with real headers and zeros (lazily made), in
    shards of ``limit`` bytes named as save_pretrained names them, with their index when there are several."""
    import math

    from shardkit.formats.header import TensorEntry, build_header

    itemsize = 2 if dtype in ("BF16", "F16") else 4
    entries = [TensorEntry(k, dtype, tuple(t.shape), math.prod(t.shape) * itemsize) for k, t in model.state_dict().items()]
    groups: list[list[TensorEntry]] = [[]]
    for e in entries:
        if groups[-1] and sum(x.nbytes for x in groups[-1]) + e.nbytes > limit:
            groups.append([])
        groups[-1].append(e)
    names = [f"{prefix}.safetensors"] if len(groups) == 1 else \
        [f"{prefix}-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)]
    files: dict[str, bytes | LazyBlob] = {}
    for filename, group in zip(names, groups, strict=True):
        head, _ = build_header(group)
        files[filename] = LazyBlob(head, len(head) + sum(e.nbytes for e in group), true_oid=true_oid)
    if len(groups) > 1:
        weight_map = {e.name: f for f, g in zip(names, groups, strict=True) for e in g}
        files[f"{prefix}.safetensors.index.json"] = json.dumps(
            {"metadata": {"total_size": sum(e.nbytes for e in entries)}, "weight_map": weight_map}).encode()
    return files


def flux_repo() -> dict[str, bytes | LazyBlob]:
    files: dict[str, bytes | LazyBlob] = {}
    index: dict[str, object] = {"_class_name": "FluxPipeline", "_diffusers_version": "0.30.0",
                                "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
                                "tokenizer": ["transformers", "CLIPTokenizer"],
                                "tokenizer_2": ["transformers", "T5TokenizerFast"]}
    for name, (library, class_name, model) in meta_models().items():
        index[name] = [library, class_name]
        config = model.config
        files[f"{name}/config.json"] = (config.to_json_string() if hasattr(config, "to_json_string")
                                        else json.dumps(dict(config))).encode()
        weights = lazy_weights(model, dtype="BF16", limit=SHARD_BYTES.get(name, 10**12),
                               prefix="diffusion_pytorch_model" if library == "diffusers" else "model")
        files.update({f"{name}/{filename}": blob for filename, blob in weights.items()})
    files["model_index.json"] = json.dumps(index).encode()
    files["scheduler/scheduler_config.json"] = json.dumps(
        {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0, "use_dynamic_shifting": True}).encode()
    # tokenizer files at their real sizes; header-only commands must not fetch them
    files["tokenizer_2/tokenizer.json"] = LazyBlob(b"{}", 2_424_035)
    files["tokenizer_2/spiece.model"] = LazyBlob(b"", 791_656)
    files["tokenizer/vocab.json"] = LazyBlob(b"{}", 1_059_962)
    return files


def hub_env(url: str, home: str) -> dict[str, str]:
    """This environment without its HF_* variables, pointed at the Hub at ``url`` with ``home`` as HF_HOME."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "HF_ENDPOINT": url, "HF_HOME": home, "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_XET": "1"}


def run_cli(env: dict[str, str], *args: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "shardkit", *args], env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--download", nargs="?", const="*", metavar="PATTERN",
                        help="also time snapshot_download (of the files matching PATTERN; all: ~34 GB to disk)")
    args = parser.parse_args()
    files = flux_repo()
    repo_bytes = sum(len(v) for v in files.values())
    with tempfile.TemporaryDirectory(prefix="bench-remote-") as tmp, HubServer(Path(tmp) / "hub") as hub:
        hub.state.add_repo(REPO, files)
        env = hub_env(hub.url, f"{tmp}/home")
        rows = []
        for label, cli in (("shardkit info", ["info", f"hf://{REPO}"]),
                           ("shardkit fit --gpu 16GB --gpu 16GB", ["fit", f"hf://{REPO}", "--gpu", "16GB", "--gpu", "16GB"])):
            before = hub.state.bytes_sent()
            seconds = run_cli(env, *cli)
            rows.append((label, hub.state.bytes_sent() - before, seconds, len(hub.state.sent)))
        if args.download:
            before, start = hub.state.bytes_sent(), time.perf_counter()
            subprocess.run([sys.executable, "-c", "import sys; from huggingface_hub import snapshot_download; "
                            "snapshot_download(sys.argv[1], local_dir=sys.argv[2], allow_patterns=[sys.argv[3]])",
                            REPO, f"{tmp}/snapshot", args.download], env=env, check=True, capture_output=True)
            nbytes, seconds = hub.state.bytes_sent() - before, time.perf_counter() - start
            label = "snapshot_download" + (f" of {args.download}" if args.download != "*" else "")
            rows.append((label, nbytes, seconds, 0))
            if args.download != "*":
                rows.append(("snapshot_download (all, at that rate)", repo_bytes, seconds * repo_bytes / nbytes, 0))
        else:
            rows.append(("snapshot_download (not run: --download)", repo_bytes, float("nan"), 0))
    print(f"repository {REPO}: {repo_bytes / 1e9:.1f} GB in {len(files)} files\n")
    print("| command | bytes transferred | time |")
    print("|---|---:|---:|")
    for label, nbytes, seconds, _ in rows:
        print(f"| {label} | {nbytes / 1e6:,.2f} MB | {seconds:.1f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
