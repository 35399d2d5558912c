"""Every api function that takes a location (open, load_model, load_pipeline, info, verify, split, convert,
merge, plan_device_map, recover), against every kind of location: a local folder, ``s3://`` on a real
SeaweedFS and ``hf://`` on the offline Hub (tests/hub_server.py), all holding the same checkpoint.

One script runs the functions on one location in a subprocess (``HF_ENDPOINT`` and the AWS
variables are read when the clients are imported) and prints what each produced as digests; every
remote row must equal the local one byte for byte.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import tiny_unet
from helpers_hub import hub_env, hub_files, run_python

pytestmark = pytest.mark.hub

SCRIPT = r"""
import hashlib, json, os, sys
import torch
import shardkit

location, work = sys.argv[1], sys.argv[2]

def digest(t):
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()

def files(folder):
    out = {}
    for root, _, names in os.walk(folder):
        for n in names:
            p = os.path.join(root, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, folder)] = hashlib.sha256(f.read()).hexdigest()
    return out

got = {}
with shardkit.open(location) as ckpt:
    got["open"] = {name: digest(ckpt[name]) for name in sorted(ckpt.keys())}
model = shardkit.load_model("diffusers:UNet2DConditionModel", location)
got["load_model"] = {name: digest(t) for name, t in model.state_dict().items()}
summary = shardkit.info(location)
got["info"] = [summary.format, summary.tensor_count, summary.parameter_count, summary.total_bytes]
got["verify"] = shardkit.verify(location).ok
got["verify_against"] = shardkit.verify(sys.argv[3], against=location).ok
shardkit.split(location, os.path.join(work, "split"), max_shard_size="200KB")
got["split"] = files(os.path.join(work, "split"))
shardkit.convert(location, os.path.join(work, "convert"), dtype="fp16", max_shard_size="300KB")
got["convert"] = files(os.path.join(work, "convert"))
os.makedirs(os.path.join(work, "merged"))
shardkit.merge(location, os.path.join(work, "merged", "model.safetensors"))
got["merge"] = files(os.path.join(work, "merged"))
plan = shardkit.plan_device_map("diffusers:UNet2DConditionModel", checkpoint=location, max_memory={"cpu": "1GB"})
got["plan_device_map"] = plan.device_map
print(json.dumps(got))
"""


@pytest.fixture(scope="module")
def unet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("matrix") / "unet"
    tiny_unet().save_pretrained(folder, max_shard_size="100KB")
    assert len(list(folder.glob("*.safetensors"))) > 1
    return folder


def run_on(location: str, env: dict[str, str], unet: Path, work: Path) -> dict[str, object]:
    work.mkdir(parents=True)
    proc = run_python(SCRIPT, env, location, work, unet, timeout=600)
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.slow
def test_every_function_reads_every_location_alike(unet, hub, s3_env, tmp_path) -> None:
    env = {**hub_env(hub, tmp_path / "home"), **s3_env.env}
    hub.state.add_repo("alice/unet", hub_files(unet))  # the .gitattributes of every Hub repository: here in all three
    s3_env.put_folder(unet, "models/unet")
    local = run_on(str(unet), env, unet, tmp_path / "local")
    assert local["verify"] is True and local["verify_against"] is True and local["open"] == local["load_model"]
    for location in (f"s3://{s3_env.bucket}/models/unet", "hf://alice/unet"):
        got = run_on(location, env, unet, tmp_path / location.partition(":")[0])
        for function, expected in local.items():
            assert got[function] == expected, (location, function)


QUICK = r"""
import hashlib, json, sys
import torch
import shardkit

location = sys.argv[1]
with shardkit.open(location) as ckpt:
    tensors = {name: hashlib.sha256(ckpt[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
               for name in sorted(ckpt.keys())}
summary = shardkit.info(location)
print(json.dumps({"open": tensors, "info": [summary.format, summary.tensor_count, summary.total_bytes],
                  "verify": shardkit.verify(location).ok, "recover": shardkit.recover(location).changed}))
"""


def test_open_info_and_verify_take_every_location_alike(hub, s3_env, tmp_path) -> None:
    """The quick row of the matrix: one small file, no model (the slow test above runs every function)."""
    from test_remote import write_safetensors

    source = write_safetensors(tmp_path / "src" / "model.safetensors", count=4)
    hub.state.add_repo("alice/tiny", hub_files(source.parent))
    s3_env.put_folder(source.parent, "tiny")
    env = {**hub_env(hub, tmp_path / "home"), **s3_env.env}
    rows = {location: json.loads(run_python(QUICK, env, location).stdout.strip().splitlines()[-1])
            for location in (str(source.parent), f"s3://{s3_env.bucket}/tiny", "hf://alice/tiny")}
    local = rows.pop(str(source.parent))
    assert local["verify"] is True and local["recover"] is False and len(local["open"]) == 4
    for location, got in rows.items():
        assert got == local, location


PIPELINE = r"""
import hashlib, json, sys
import torch
import shardkit

pipe = shardkit.load_pipeline(sys.argv[1], device_map="cpu")
print(json.dumps({
    "tensors": {f"{part}.{name}": hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                                                  ).hexdigest()
                for part in ("unet", "vae", "text_encoder") for name, t in getattr(pipe, part).state_dict().items()},
    "tokens": pipe.tokenizer("a photo of a cat").input_ids, "scheduler": type(pipe.scheduler).__name__}))
"""


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_load_pipeline_reads_every_location_alike(hub, s3_env, tmp_path) -> None:
    from helpers_pipeline import build_tiny_sd_pipeline

    import shardkit

    build_tiny_sd_pipeline(tmp_path / "scratch").save_pretrained(tmp_path / "saved")
    sharded = tmp_path / "sharded"
    shardkit.split(tmp_path / "saved", sharded, max_shard_size="200KB")
    hub.state.add_repo("alice/sd", hub_files(sharded))
    s3_env.put_folder(sharded, "sd")
    env = {**hub_env(hub, tmp_path / "home"), **s3_env.env}
    rows = [json.loads(run_python(PIPELINE, env, location, timeout=600).stdout.strip().splitlines()[-1])
            for location in (str(sharded), f"s3://{s3_env.bucket}/sd", "hf://alice/sd")]
    assert len(rows[0]["tensors"]) > 50
    assert rows[1] == rows[0] and rows[2] == rows[0]
