#!/usr/bin/env python3
"""shardkit demo: build a real UNet checkpoint, split it, inspect it, verify it, load it back.

Run through ``scripts/demo`` (which installs everything into .venv first).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.join(os.path.dirname(HERE), "tests"))  # tests/s3_server.py


def step(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def shardkit_cli(*args: str) -> None:
    cmd = [os.path.join(os.path.dirname(sys.executable), "shardkit"), *args]
    print("$ shardkit " + " ".join(args), flush=True)
    subprocess.run(cmd, check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiny", action="store_true", help="use a tiny UNet (seconds) instead of SD 1.5")
    parser.add_argument("--out", default="demo-out", help="working folder (default: demo-out)")
    parser.add_argument("--s3", action="store_true",
                        help="start a local S3 server (SeaweedFS), upload the tiny UNet, split it from one bucket "
                             "prefix to another and load_model from there; the server is stopped on every path")
    args = parser.parse_args()
    if args.s3:
        return s3_demo(args.out)
    kind, shard_size = ("tiny", "1MB") if args.tiny else ("sd15", "1GB")
    src = os.path.join(args.out, f"{kind}-unet")
    dst = os.path.join(args.out, f"{kind}-unet-sharded")
    started = time.perf_counter()

    build(kind, src)
    print(f"{src}/diffusion_pytorch_model.safetensors: "
          f"{os.path.getsize(os.path.join(src, 'diffusion_pytorch_model.safetensors')) / 1e9:.2f} GB")

    step(f"2. split it into {shard_size} shards (streamed, atomic)")
    shardkit_cli("split", src, dst, "--max-shard-size", shard_size, "--overwrite")

    step("3. inspect the result")
    shardkit_cli("info", dst)

    step("4. verify every byte against the source")
    shardkit_cli("verify", dst, "--against", src, "--quiet")

    step("5. load it back lazily into an empty UNet and compare with diffusers' own loader")
    check_forward(src, dst)
    print(f"\ndemo finished in {time.perf_counter() - started:.0f} s; outputs in {args.out}/ (rm -rf {args.out} to clean up)")
    return 0


def build(kind: str, src: str) -> None:
    """Step 1: the ``kind`` UNet at ``src`` (kept from an earlier run)."""
    step(f"1. build the {'tiny' if kind == 'tiny' else 'SD 1.5'} UNet from its config with random fp32 weights")
    if not os.path.exists(os.path.join(src, "diffusion_pytorch_model.safetensors")):
        from build_checkpoint import build_unet

        shutil.rmtree(src, ignore_errors=True)
        build_unet(kind, src)


def s3_demo(out: str) -> int:
    """The tiny UNet through a local SeaweedFS: upload, info, split bucket to bucket, verify, load_model."""
    import signal
    import tempfile

    from s3_server import SeaweedS3, weed_unavailable

    reason = weed_unavailable()
    if reason:
        print(f"error: --s3 needs the SeaweedFS binary: {reason}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    src = os.path.join(out, "tiny-unet")
    build("tiny", src)
    data = tempfile.mkdtemp(prefix="shardkit-demo-s3-")
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill runs the finally below too
    server = SeaweedS3(data)
    try:
        step("2. start a local S3 server (SeaweedFS) and upload the checkpoint to s3://demo/unet")
        server.start()
        os.environ.update(server.client_env())  # the standard AWS_* variables; the CLI below reads them
        os.environ["AWS_CONFIG_FILE"] = os.environ["AWS_SHARED_CREDENTIALS_FILE"] = os.path.join(data, "none")
        server.upload(src, "demo", "unet")
        print("\n".join(f"uploaded s3://demo/unet/{name}" for name in sorted(os.listdir(src))))
        step("3. inspect it where it lives (headers only, by ranged GETs)")
        shardkit_cli("info", "s3://demo/unet")
        step("4. split it from one bucket prefix to another (index published last)")
        shardkit_cli("split", "s3://demo/unet", "s3://demo/unet-sharded", "--max-shard-size", "1MB")
        step("5. verify every byte of the new prefix against the first")
        shardkit_cli("verify", "s3://demo/unet-sharded", "--against", "s3://demo/unet", "--quiet")
        step("6. load_model from s3://demo/unet-sharded (parallel ranged GETs) and compare with diffusers")
        check_forward(src, "s3://demo/unet-sharded")
    finally:
        server.stop()
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(data, ignore_errors=True)
    print(f"\ns3 demo finished in {time.perf_counter() - started:.0f} s; the server is stopped and its data removed")
    return 0


def check_forward(src: str, dst: str) -> None:
    import torch
    from diffusers import UNet2DConditionModel

    import shardkit

    config = None if dst.startswith("s3://") else os.path.join(dst, "config.json")  # s3: its config.json
    model = shardkit.load_model(UNet2DConditionModel, dst, config=config, device_map="cpu")
    reference = UNet2DConditionModel.from_pretrained(src)
    cfg = reference.config
    gen = torch.Generator().manual_seed(0)
    sample = torch.randn(1, cfg.in_channels, 16, 16, generator=gen)
    context = torch.randn(1, 8, cfg.cross_attention_dim, generator=gen)
    ours_sd, theirs_sd = model.state_dict(), reference.state_dict()
    mismatched = [k for k in theirs_sd if not torch.equal(ours_sd[k], theirs_sd[k])]
    if set(ours_sd) != set(theirs_sd) or mismatched:
        raise SystemExit(f"weights differ from the source: {mismatched[:5]}")
    print(f"all {len(theirs_sd)} tensors bit-identical to UNet2DConditionModel.from_pretrained(source)")
    with torch.no_grad():
        ours = model(sample, 10, encoder_hidden_states=context).sample
        theirs = reference(sample, 10, encoder_hidden_states=context).sample
    # Same weights, but CPU kernels may round the last bit differently depending on where the
    # weights lie in memory (mapped shards vs copied tensors), so outputs are compared closely.
    diff = (ours - theirs).abs().max().item()
    if not torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5):
        raise SystemExit(f"forward outputs differ by up to {diff:.3g}")
    print(f"forward pass on a {tuple(sample.shape)} latent: outputs match (max abs difference {diff:.2g})")

if __name__ == "__main__":
    sys.exit(main())
