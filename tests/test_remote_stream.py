"""``split``/``convert`` of ``hf://`` sources: streamed (``--no-cache``) and through the HF cache.

Runs the real CLI against the offline Hub (tests/hub_server.py) through the real huggingface_hub
client; the server counts what it sends, so "each byte once" and "only the kept tensors" are
checked by what crossed the wire, and "no cache copy" by what is in HF_HUB_CACHE afterwards.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from helpers_hub import SHARDKIT_BIN, folder_files, hub_env, hub_files, run_measured, run_shardkit
from test_convert_diffusers import (  # noqa: F401  (fixtures, registered by their name=)
    fixture_ldm_checkpoint,
    fixture_pipeline_config,
    fixture_sd_models,
)
from test_remote import TENSOR_BYTES, one_error_line, split_folder, write_safetensors

pytestmark = pytest.mark.hub

SAFETENSORS = r"\.safetensors$"


def cache_files(home: Path) -> list[Path]:
    return [p for p in (home / "hub").rglob("*") if p.is_file()]


def source_bytes(files: dict[str, bytes]) -> int:
    return sum(len(v) for k, v in files.items() if k.endswith(".safetensors"))


def test_split_no_cache_streams_each_byte_once_and_equals_a_local_split(hub, tmp_path):
    import shardkit

    folder = split_folder(tmp_path, "src", "600KB")
    files = hub_files(folder)
    hub.state.add_repo("alice/tiny", {**files, "pytorch_model.bin": b"\0" * 64, "tokenizer.json": b'{"v": 1}'})
    home = tmp_path / "home"
    proc = run_shardkit(hub_env(hub, home), "split", "hf://alice/tiny", tmp_path / "streamed",
                        "--max-shard-size", "1100KB", "--no-cache", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert len(doc["shards"]) == 2 and "hf://alice/tiny" in doc["source"] and "shardkit-remote" not in proc.stdout
    (folder / "tokenizer.json").write_bytes(b'{"v": 1}')
    shardkit.split(folder, tmp_path / "local", max_shard_size="1100KB")
    got, want = folder_files(tmp_path / "streamed"), folder_files(tmp_path / "local")
    assert got == want and "tokenizer.json" in got and "config.json" in got
    assert hub.state.bytes_sent(SAFETENSORS) == source_bytes(files)  # every byte once: headers included
    assert not any(p.endswith(".bin") for _, p, _, _ in hub.state.sent)
    assert cache_files(home) == []  # nothing through the HF cache


def test_split_no_cache_of_a_pipeline_repo_equals_a_local_pipeline_split(hub, tmp_path):
    import shardkit

    pipe = tmp_path / "pipe"
    (pipe / "scheduler").mkdir(parents=True)
    (pipe / "model_index.json").write_text(json.dumps({
        "_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"],
        "text_encoder": ["transformers", "CLIPTextModel"], "scheduler": ["diffusers", "PNDMScheduler"]}))
    (pipe / "scheduler" / "scheduler_config.json").write_text('{"_class_name": "PNDMScheduler"}')
    write_safetensors(pipe / "unet" / "diffusion_pytorch_model.safetensors", count=6, seed=1)
    (pipe / "unet" / "config.json").write_text('{"_class_name": "UNet2DConditionModel"}')
    write_safetensors(pipe / "text_encoder" / "model.safetensors", count=3, seed=2)
    (pipe / "text_encoder" / "config.json").write_text('{"model_type": "clip_text_model"}')
    files = hub_files(pipe)
    hub.state.add_repo("alice/pipe", files)
    home = tmp_path / "home"
    proc = run_shardkit(hub_env(hub, home), "split", "hf://alice/pipe", tmp_path / "streamed",
                        "--max-shard-size", "600KB", "--no-cache", "-q")
    assert proc.returncode == 0, proc.stderr
    shardkit.split(pipe, tmp_path / "local", max_shard_size="600KB")
    got, want = folder_files(tmp_path / "streamed"), folder_files(tmp_path / "local")
    assert got == want and "unet/diffusion_pytorch_model.safetensors.index.json" in got
    assert hub.state.bytes_sent(SAFETENSORS) == source_bytes(files)
    assert cache_files(home) == []


def test_convert_no_cache_fetches_only_the_kept_tensors(hub, tmp_path):
    import shardkit
    from shardkit.stores.mirror import FIRST_RANGE_BYTES

    source = write_safetensors(tmp_path / "src" / "model.safetensors", count=200, seed=3)  # 52 MB
    hub.state.add_repo("alice/wide", hub_files(source.parent))
    proc = run_shardkit(hub_env(hub, tmp_path / "home"), "convert", "hf://alice/wide", tmp_path / "streamed",
                        "--include", "layer.1??.weight", "--strip-prefix", "layer.", "--no-cache", "-q")
    assert proc.returncode == 0, proc.stderr
    shardkit.convert(source.parent, tmp_path / "local", include=["layer.1??.weight"], strip_prefix="layer.")
    assert folder_files(tmp_path / "streamed") == folder_files(tmp_path / "local")
    # The header's first range, then the kept second half: the 25 MB in between were skipped.
    assert hub.state.bytes_sent(SAFETENSORS) == FIRST_RANGE_BYTES + 100 * TENSOR_BYTES


def test_a_corrupted_transfer_fails_the_sha256_check_and_publishes_nothing(hub, tmp_path):
    source = write_safetensors(tmp_path / "src" / "model.safetensors", count=8)
    hub.state.add_repo("alice/tiny", folder_files(source.parent))
    env = hub_env(hub, tmp_path / "home")
    hub.state.inject("GET", r"/resolve/.*model\.safetensors$", 1, times=None)  # every body has a flipped byte
    line = one_error_line(run_shardkit(env, "split", "hf://alice/tiny", tmp_path / "out", "--no-cache", "-q"))
    assert "hf://alice/tiny:model.safetensors: the bytes received do not match the sha256" in line, line
    assert not (tmp_path / "out").exists()


def test_a_server_that_ignores_range_is_refused_at_the_first_window(hub, tmp_path):
    """A 200 with the whole file for a partial range would be downloaded again for every window."""
    source = write_safetensors(tmp_path / "src" / "model.safetensors", count=8)
    hub.state.add_repo("alice/tiny", folder_files(source.parent))
    hub.state.ignore_range = True
    line = one_error_line(run_shardkit(hub_env(hub, tmp_path / "home"), "split", "hf://alice/tiny", tmp_path / "out",
                                       "--no-cache", "-q"))
    assert line.startswith("error: hf://alice/tiny:model.safetensors: asked for bytes 0-") and \
        "the server answered 200 OK" in line and "instead of 206 Partial Content" in line, line
    assert not (tmp_path / "out").exists()
    def weight_gets() -> list[int]:  # logged when the server is done with a request, even one the client dropped
        # (200 sent whole, or 500 when the client hung up mid-body)
        return [status for method, path, status in hub.state.requests
                if method == "GET" and path.endswith(".safetensors")]

    deadline = time.monotonic() + 10
    while not weight_gets() and time.monotonic() < deadline:  # the server logs a reply once it is sent
        time.sleep(0.05)
    assert len(weight_gets()) == 1, hub.state.requests  # refused on the first reply, before another request


@pytest.mark.parametrize("status", [503, 0], ids=["5xx", "cut-mid-body"])
def test_a_network_failure_mid_stream_is_retried_then_one_line_with_no_output(hub, tmp_path, status):
    source = write_safetensors(tmp_path / "src" / "model.safetensors", count=8)
    hub.state.add_repo("alice/tiny", folder_files(source.parent))
    env = hub_env(hub, tmp_path / "home")
    proc = run_shardkit(env, "split", "hf://alice/tiny", tmp_path / "ok", "--no-cache", "-q")
    assert proc.returncode == 0, proc.stderr
    streamed = r"^bytes=[1-9]"  # the streamed reads, not the mirror's header range (bytes=0-...)
    fault = hub.state.inject("GET", r"/resolve/.*model\.safetensors$", status, times=2, range=streamed)
    proc = run_shardkit(env, "split", "hf://alice/tiny", tmp_path / "retried", "--no-cache", "-q")
    assert proc.returncode == 0 and fault.times == 0, proc.stderr
    assert folder_files(tmp_path / "retried") == folder_files(tmp_path / "ok")
    hub.state.inject("GET", r"/resolve/.*model\.safetensors$", status, times=None, range=streamed)
    line = one_error_line(run_shardkit(env, "split", "hf://alice/tiny", tmp_path / "failed", "--no-cache", "-q"))
    assert line.startswith("error: hf://alice/tiny: ") and "retries" in line, line
    assert not (tmp_path / "failed").exists()


def test_convert_of_a_pickle_repo_goes_through_the_cache(hub, tmp_path):
    import torch

    import shardkit

    state = {"model.w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "model.b": torch.ones(4)}
    torch.save({"state_dict": state}, tmp_path / "pytorch_model.bin")
    hub.state.add_repo("alice/old", {"pytorch_model.bin": (tmp_path / "pytorch_model.bin").read_bytes(),
                                     "config.json": b"{}"})
    env = hub_env(hub, tmp_path / "home")
    proc = run_shardkit(env, "convert", "hf://alice/old", tmp_path / "out", "--strip-prefix", "model.", "-q")
    assert proc.returncode == 0, proc.stderr
    loaded = shardkit.open(tmp_path / "out")
    assert torch.equal(loaded["w"], state["model.w"]) and sorted(loaded.keys()) == ["b", "w"]
    line = one_error_line(run_shardkit(env, "convert", "hf://alice/old", tmp_path / "streamed", "--no-cache"))
    assert "pickle weights only (pytorch_model.bin" in line and not (tmp_path / "streamed").exists()


def test_convert_of_one_file_in_a_repo_downloads_that_file(hub, tmp_path):
    import shardkit

    source = write_safetensors(tmp_path / "src" / "v1-5.safetensors", count=4)
    hub.state.add_repo("alice/sd", {"ckpts/v1-5.safetensors": source.read_bytes(),
                                    "ckpts/other.safetensors": b"x" * 10})
    env = hub_env(hub, tmp_path / "home")
    proc = run_shardkit(env, "convert", "hf://alice/sd/ckpts/v1-5.safetensors", tmp_path / "out",
                        "--max-shard-size", "600KB", "-q")
    assert proc.returncode == 0, proc.stderr
    shardkit.convert(source, tmp_path / "local", max_shard_size="600KB")
    assert folder_files(tmp_path / "out") == folder_files(tmp_path / "local")
    assert not any("other" in p for _, p, _, _ in hub.state.sent)
    missing = one_error_line(run_shardkit(env, "convert", "hf://alice/sd/ckpts/nope.safetensors", tmp_path / "x"))
    assert "no file 'ckpts/nope.safetensors' in alice/sd" in missing, missing


def test_remote_flags_are_checked_before_any_work(hub, tmp_path):
    source = write_safetensors(tmp_path / "src" / "model.safetensors", count=2)
    env = hub_env(hub, tmp_path / "home")
    local = one_error_line(run_shardkit(env, "split", source, tmp_path / "out", "--no-cache"))
    assert "--no-cache applies to an hf://ORG/REPO source" in local
    pr = one_error_line(run_shardkit(env, "split", source, tmp_path / "out", "--create-pr"))
    assert "--create-pr applies with --push-to" in pr
    assert not (tmp_path / "out").exists() and hub.state.requests == []


def test_reshard_a_repo_as_a_pull_request_without_the_cache(hub, tmp_path):
    from helpers_hub import download

    folder = split_folder(tmp_path, "src", "600KB")
    hub.state.add_repo("alice/tiny", hub_files(folder))
    env = hub_env(hub, tmp_path / "home")
    proc = run_shardkit(env, "split", "hf://alice/tiny", tmp_path / "out", "--max-shard-size", "1100KB",
                        "--no-cache", "--push-to", "alice/tiny", "--create-pr", "-q")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("/discussions/1"), proc.stdout
    got = folder_files(download(env, "alice/tiny", tmp_path / "pr", revision="refs/pr/1"))
    assert {k: v for k, v in got.items() if not k.startswith(".cache/")} == folder_files(tmp_path / "out")
    main = folder_files(download(env, "alice/tiny", tmp_path / "main"))
    assert {k: v for k, v in main.items() if not k.startswith(".cache/")} == folder_files(folder)  # main untouched


def lazy_sharded_repo(files_count: int, tensor_bytes: int) -> dict[str, object]:
    """``files_count`` safetensors files of 4 BF16 tensors of ``tensor_bytes`` each (zeros, true sha256s)."""
    from hub_state import LazyBlob

    from shardkit.formats.header import TensorEntry, build_header

    files: dict[str, object] = {}
    weight_map = {}
    for n in range(1, files_count + 1):
        entries = [TensorEntry(f"blocks.{n}.{k}.weight", "BF16", (tensor_bytes // 2,), tensor_bytes) for k in range(4)]
        head, _ = build_header(entries)
        name = f"model-{n:05d}-of-{files_count:05d}.safetensors"
        files[name] = LazyBlob(head, len(head) + 4 * tensor_bytes, true_oid=True)
        weight_map.update({e.name: name for e in entries})
    files["model.safetensors.index.json"] = json.dumps(
        {"metadata": {"total_size": 4 * files_count * tensor_bytes}, "weight_map": weight_map}).encode()
    return files


@pytest.mark.slow
def test_streaming_memory_does_not_grow_with_the_repo(hub, tmp_path):
    peaks = {}
    for label, files_count, tensor_bytes in (("small", 1, 75_000_000), ("big", 3, 100_000_000)):  # 0.3 / 1.2 GB
        files = lazy_sharded_repo(files_count, tensor_bytes)
        hub.state.add_repo(f"alice/{label}", files)
        home, out = tmp_path / f"home-{label}", tmp_path / f"out-{label}"
        before = hub.state.bytes_sent(SAFETENSORS)
        code, _, peaks[label], stderr = run_measured(
            [SHARDKIT_BIN, "split", f"hf://alice/{label}", out, "--max-shard-size", "500MB", "--no-cache", "-q"],
            hub_env(hub, home))
        assert code == 0, stderr
        sent = hub.state.bytes_sent(SAFETENSORS) - before
        assert sent == sum(len(v) for k, v in files.items() if k.endswith(".safetensors"))  # each byte once
        assert cache_files(home) == []
        verified = run_shardkit(hub_env(hub, home), "verify", out)
        assert verified.returncode == 0, verified.stdout + verified.stderr
    # 4x the bytes, about the same peak (~150 MiB measured): the windows in flight, not the files
    assert peaks["big"] - peaks["small"] < 64 * 2**20 and peaks["big"] < 256 * 2**20, peaks


def test_the_python_api_takes_hf_sources(hub, tmp_path):
    from helpers_hub import run_python

    import shardkit

    folder = split_folder(tmp_path, "src", "600KB")
    hub.state.add_repo("alice/tiny", hub_files(folder))
    code = """
import sys, shardkit
out = sys.argv[1]
result = shardkit.split("hf://alice/tiny", out + "/streamed", max_shard_size="1100KB", cache=False)
print(len(result.plan.shards), shardkit.info("hf://alice/tiny").tensor_count)
print(shardkit.verify(out + "/streamed").ok, shardkit.verify(out + "/streamed", against="hf://alice/tiny").ok)
shardkit.convert("hf://alice/tiny", out + "/converted", strip_prefix="layer.")
try:
    shardkit.split(out + "/streamed", out + "/x", cache=False)
except shardkit.InvalidInputError as e:
    print("refused:", e)
"""
    lines = run_python(code, hub_env(hub, tmp_path / "home"), tmp_path).stdout.splitlines()
    assert lines[0] == "2 8"
    assert lines[1] == "True False"  # resharded: same tensors, other files than the repository's
    assert lines[2].startswith("refused: cache=False applies to an hf://ORG/REPO source")
    shardkit.split(folder, tmp_path / "local", max_shard_size="1100KB")
    assert folder_files(tmp_path / "streamed") == folder_files(tmp_path / "local")
    assert sorted(shardkit.open(tmp_path / "converted").keys())[0] == "0.weight"


def test_convert_to_diffusers_from_a_hub_file_with_a_hub_config(hub, tmp_path, sd_models, ldm_checkpoint,
                                                                pipeline_config):
    """The single file and the config both on the Hub: the file through the cache, the config repository's
    configs only (its weights are never fetched)."""
    from conftest import assert_bit_equal
    from diffusers import UNet2DConditionModel
    from safetensors.torch import save_file

    save_file(ldm_checkpoint, tmp_path / "sd.safetensors")
    hub.state.add_repo("alice/sd-single", {"ckpt/sd.safetensors": (tmp_path / "sd.safetensors").read_bytes()})
    write_safetensors(pipeline_config / "unet" / "diffusion_pytorch_model.safetensors", count=4)  # must stay put
    hub.state.add_repo("alice/sd-config", folder_files(pipeline_config))
    proc = run_shardkit(hub_env(hub, tmp_path / "home"), "convert", "hf://alice/sd-single/ckpt/sd.safetensors",
                        tmp_path / "unet", "--to", "diffusers", "--config", "hf://alice/sd-config", "-q")
    assert proc.returncode == 0, proc.stderr
    assert_bit_equal(UNet2DConditionModel.from_pretrained(tmp_path / "unet").state_dict(), sd_models[0].state_dict())
    assert not any("sd-config" in p and p.endswith(".safetensors") for _, p, _, _ in hub.state.sent)
    streamed = one_error_line(run_shardkit(hub_env(hub, tmp_path / "home"), "convert", "hf://alice/sd-single/ckpt",
                                           tmp_path / "x", "--to", "diffusers", "--config", pipeline_config,
                                           "--no-cache"))
    assert "--to diffusers maps the checkpoint file into memory" in streamed


def test_a_dataset_repository_is_a_source_too(hub, tmp_path):
    import shardkit
    from shardkit.stores.hf_spec import parse_spec

    assert str(parse_spec("hf://datasets/alice/ckpts@v1/run-3")) == "hf://datasets/alice/ckpts@v1/run-3"
    assert parse_spec("hf://datasets/alice/ckpts").repo_type == "dataset"
    assert parse_spec("hf://datasets/ckpts").repo_id == "datasets/ckpts"  # a model repo of the user "datasets"
    folder = split_folder(tmp_path, "src", "600KB")
    hub.state.add_repo("alice/ckpts", {f"run-3/{k}": v for k, v in folder_files(folder).items()}, repo_type="dataset")
    env = hub_env(hub, tmp_path / "home")
    info = run_shardkit(env, "info", "hf://datasets/alice/ckpts/run-3", "--json")
    assert info.returncode == 0 and json.loads(info.stdout)["tensor_count"] == 8, info.stderr
    proc = run_shardkit(env, "split", "hf://datasets/alice/ckpts/run-3", tmp_path / "out", "--max-shard-size",
                        "1100KB", "--no-cache", "-q")
    assert proc.returncode == 0, proc.stderr
    shardkit.split(folder, tmp_path / "local", max_shard_size="1100KB")
    assert folder_files(tmp_path / "out") == folder_files(tmp_path / "local")
    missing = one_error_line(run_shardkit(env, "info", "hf://alice/ckpts"))  # not a model repository
    assert "repository alice/ckpts not found" in missing, missing


def test_a_streamed_pipeline_leaves_out_loose_weights_instead_of_copying_holes(hub, tmp_path):
    """Weights outside the components (SD 1.5's root ``v1-5-pruned.safetensors``) exist in the mirror only
    as a header and a hole: they are left out with a warning, never copied as zeros."""
    pipe = tmp_path / "pipe"
    (pipe / "model_index.json").parent.mkdir(parents=True)
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline",
                                                       "unet": ["diffusers", "UNet2DConditionModel"]}))
    write_safetensors(pipe / "unet" / "diffusion_pytorch_model.safetensors", count=3, seed=1)
    write_safetensors(pipe / "v1-5-pruned.safetensors", count=2, seed=2)
    write_safetensors(pipe / "vae_1_0" / "diffusion_pytorch_model.safetensors", count=2, seed=3)
    hub.state.add_repo("alice/pipe", hub_files(pipe))
    proc = run_shardkit(hub_env(hub, tmp_path / "home"), "split", "hf://alice/pipe", tmp_path / "out",
                        "--no-cache", "--json")
    assert proc.returncode == 0, proc.stderr
    assert "left out v1-5-pruned.safetensors, vae_1_0/diffusion_pytorch_model.safetensors" in proc.stderr
    assert "shardkit-remote" not in proc.stdout and json.loads(proc.stdout)["source"].endswith("hf://alice/pipe")
    import shutil

    import shardkit

    (pipe / "v1-5-pruned.safetensors").unlink()
    shutil.rmtree(pipe / "vae_1_0")
    shardkit.split(pipe, tmp_path / "local")
    assert folder_files(tmp_path / "out") == folder_files(tmp_path / "local")  # the components, unchanged


def test_a_stalled_transfer_times_out_and_is_retried_then_one_line(hub, tmp_path):
    source = write_safetensors(tmp_path / "src" / "model.safetensors", count=8)
    hub.state.add_repo("alice/tiny", folder_files(source.parent))
    env = {**hub_env(hub, tmp_path / "home"), "HF_HUB_DOWNLOAD_TIMEOUT": "1"}
    streamed = r"^bytes=[1-9]"
    fault = hub.state.inject("GET", r"/resolve/.*model\.safetensors$", 2, times=1, range=streamed)
    proc = run_shardkit(env, "split", "hf://alice/tiny", tmp_path / "retried", "--no-cache", "-q")
    assert proc.returncode == 0 and fault.times == 0, proc.stderr
    hub.state.inject("GET", r"/resolve/.*model\.safetensors$", 2, times=None, range=streamed)
    line = one_error_line(run_shardkit(env, "split", "hf://alice/tiny", tmp_path / "failed", "--no-cache", "-q"))
    assert "network failure" in line and "timed out" in line, line
    assert not (tmp_path / "failed").exists()
