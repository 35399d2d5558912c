"""load_model: skeleton + lazy checkpoint → accelerate dispatch over CPU and disk, checked against eager models.

Loaded host weights are views of the memory-mapped shards (as with safetensors' own load_file), so
they sit at file offsets that are rarely 64-byte aligned; CPU kernels pick different, equally valid
summation orders for unaligned weights. So weights are compared bit for bit, and outputs to float
rounding (1e-5).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from conftest import TINY_UNET_CONFIG, tensor_bytes, tiny_clip_text_config, tiny_unet, unet_forward
from helpers_load import TINY_VAE_CONFIG, folder_bytes, lm_forward, make_tied_lm, save_model, tiny_vae, vae_forward

import shardkit
from shardkit.errors import CheckpointIndexError, HeaderError, InvalidInputError, KeyMismatchError, ShardkitWarning
from shardkit.formats.dtypes import resolve_torch_dtype


def _unet() -> tuple[Any, Any, dict, Callable]:
    from diffusers import UNet2DConditionModel

    return tiny_unet(), UNet2DConditionModel, TINY_UNET_CONFIG, unet_forward


def _vae() -> tuple[Any, Any, dict, Callable]:
    from diffusers import AutoencoderKL

    return tiny_vae(), AutoencoderKL, TINY_VAE_CONFIG, vae_forward


def _lm() -> tuple[Any, Any, dict | None, Callable]:
    factory = make_tied_lm()
    torch.manual_seed(0)
    return factory().eval(), factory, None, lm_forward


MODELS = {"unet": _unet, "vae": _vae, "plain-lm": _lm}


def _model_bytes(model: Any) -> int:
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in model.state_dict().values()}.values())


def _close(got: Any, want: Any, *, exact: bool) -> None:
    if exact:
        assert torch.equal(got, want), (got - want).abs().max()
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_outputs_equal_eager_model_for_cpu_auto_disk_and_explicit_maps(tmp_path, kind) -> None:
    eager, cls, config, forward = MODELS[kind]()
    folder = save_model(eager, tmp_path / "ckpt", max_shard_size="16KB")
    want = forward(eager)

    model = shardkit.load_model(cls, folder, config=config, device_map="cpu")
    assert model.hf_device_map == {"": "cpu"} and not model.training
    for (name, got), expected in zip(model.state_dict().items(), eager.state_dict().values(), strict=True):
        assert got.dtype == expected.dtype and torch.equal(got, expected), name
    _close(forward(model), want, exact=False)

    budget = {"cpu": _model_bytes(eager) // 2}
    model = shardkit.load_model(cls, folder, config=config, device_map="auto", max_memory=budget,
                                offload_folder=tmp_path / "off-auto")
    assert set(model.hf_device_map.values()) == {"cpu", "disk"}
    _close(forward(model), want, exact=False)

    children = [name for name, _ in eager.named_children()]
    explicit = {name: ("disk" if i % 2 else "cpu") for i, name in enumerate(children)}
    explicit.update({name: "cpu" for name, _ in eager.named_buffers(recurse=False)})
    model = shardkit.load_model(cls, folder, config=config, device_map=explicit, offload_folder=tmp_path / "off-dict")
    assert model.hf_device_map == explicit
    _close(forward(model), want, exact=False)
    if kind == "plain-lm":
        assert model.head.weight is model.embed.weight or model.head.weight.is_meta


def test_disk_offload_points_into_the_shards_instead_of_copying(tmp_path) -> None:
    eager, cls, config, forward = _unet()
    folder = save_model(eager, tmp_path / "ckpt", max_shard_size="16KB")
    offload = tmp_path / "offload"
    model = shardkit.load_model(cls, folder, config=config, device_map="auto",
                                max_memory={"cpu": _model_bytes(eager) // 2}, offload_folder=offload)
    index = json.loads((offload / "index.json").read_text())
    disk_modules = [m for m, d in model.hf_device_map.items() if d == "disk"]
    assert disk_modules and len(index) > 10
    assert all(any(m in ("", name) or name.startswith(m + ".") for m in disk_modules) for name in index)
    assert all(Path(e["safetensors_file"]).parent == folder.resolve() for e in index.values())
    assert sorted(p.name for p in offload.iterdir()) == ["index.json"], "no weight was written again"
    assert folder_bytes(offload) < 1_000_000
    _close(forward(model), forward(eager), exact=False)


def test_disk_offload_writes_only_tensors_needing_a_cast(tmp_path) -> None:
    eager, cls, config, forward = _unet()
    folder = save_model(eager, tmp_path / "ckpt", max_shard_size="16KB")
    explicit = {name: ("disk" if name == "down_blocks" else "cpu") for name, _ in eager.named_children()}
    offload = tmp_path / "offload"
    model = shardkit.load_model(cls, folder, config=config, device_map=explicit, offload_folder=offload,
                                dtype=torch.float16)
    index = json.loads((offload / "index.json").read_text())
    dat = sorted(p.name for p in offload.glob("*.dat"))
    disk_params = {n: p for n, p in eager.named_parameters() if n.startswith("down_blocks.")}
    assert dat == sorted(f"{n}.dat" for n in disk_params)
    assert all(index[n]["dtype"] == "float16" and "safetensors_file" not in index[n] for n in disk_params)
    assert sum(p.stat().st_size for p in offload.glob("*.dat")) == sum(p.numel() * 2 for p in disk_params.values())
    assert model.conv_in.weight.dtype == torch.float16
    sample, context = torch.randn(1, 4, 8, 8), torch.randn(1, 3, 8)
    with torch.no_grad():
        got = model(sample.half(), torch.tensor([10]), encoder_hidden_states=context.half()).sample
        want = eager.half()(sample.half(), torch.tensor([10]), encoder_hidden_states=context.half()).sample
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_dtype_casts_and_none_keeps_checkpoint_dtypes(tmp_path) -> None:
    eager, cls, config, forward = _unet()
    folder = save_model(eager, tmp_path / "ckpt")
    model = shardkit.load_model("diffusers:UNet2DConditionModel", folder, config=folder / "config.json", dtype="bf16")
    ref = tiny_unet().to(torch.bfloat16)
    for (name, got), want in zip(model.state_dict().items(), ref.state_dict().values(), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want), name
    half = save_model(eager, tmp_path / "half", dtype="fp16")
    model = shardkit.load_model(cls, half, config=config)
    assert {p.dtype for p in model.parameters()} == {torch.float16}


def test_transformers_model_and_open_checkpoint_object(tmp_path) -> None:
    from transformers import CLIPTextModel

    config = tiny_clip_text_config()
    torch.manual_seed(0)
    eager = CLIPTextModel(config).eval()
    folder = save_model(eager, tmp_path / "clip", name="model", max_shard_size="8KB")
    ids = torch.tensor([[0, 5, 7, 1]])
    with shardkit.open(folder) as ckpt:
        model = shardkit.load_model("transformers:CLIPTextModel", ckpt, config=config.to_dict())
    with torch.no_grad():
        _close(model(ids).last_hidden_state, eager(ids).last_hidden_state, exact=False)


def test_tied_weights_end_up_tied(tmp_path) -> None:
    eager, factory, _, forward = _lm()
    folder = save_model(eager, tmp_path / "aliased", name="model", max_shard_size="2KB")
    with shardkit.open(folder) as ckpt:
        assert ckpt.aliases == {"head.weight": "embed.weight"}
    model = shardkit.load_model(factory, folder)
    assert model.head.weight is model.embed.weight
    _close(forward(model), forward(eager), exact=False)
    # A checkpoint that stores only one of the names, without alias metadata (transformers style).
    state = {k: v.clone() for k, v in eager.state_dict().items() if k != "head.weight"}
    safetensors.torch.save_file(state, tmp_path / "one-name.safetensors")
    model = shardkit.load_model(factory, tmp_path / "one-name.safetensors")
    assert model.head.weight is model.embed.weight
    _close(forward(model), forward(eager), exact=False)


def test_strict_names_missing_unexpected_and_mismatched_keys_in_one_error(tmp_path) -> None:
    eager, cls, config, forward = _unet()
    state = {k: v.clone() for k, v in eager.state_dict().items()}
    del state["conv_in.bias"]
    state["extra.weight"] = torch.zeros(2)
    state["conv_out.bias"] = torch.zeros(5)
    shardkit.save_sharded(state, tmp_path / "bad", max_shard_size="16KB")
    with pytest.raises(KeyMismatchError) as info:
        shardkit.load_model(cls, tmp_path / "bad", config=config)
    message = str(info.value)
    assert "\n" not in message
    for needle in ("conv_in.bias", "extra.weight", "conv_out.bias (checkpoint [5], model [4])", "strict=False"):
        assert needle in message
    with pytest.warns(ShardkitWarning, match="conv_in.bias"):
        model = shardkit.load_model(cls, tmp_path / "bad", config=config, strict=False)
    assert torch.count_nonzero(model.conv_in.bias) == 0 and torch.count_nonzero(model.conv_out.bias) == 0
    assert torch.equal(model.conv_in.weight, eager.conv_in.weight)


def test_bad_inputs_are_one_line_errors(tmp_path) -> None:
    eager, cls, config, _ = _unet()
    folder = save_model(eager, tmp_path / "ckpt", max_shard_size="16KB")
    missing_gpu = torch.cuda.device_count()  # the first index this machine does not have
    cases = [
        (dict(max_memory={missing_gpu: "1GB", "cpu": "1GB"}), InvalidInputError, f"GPU {missing_gpu}"),
        (dict(device_map={"": missing_gpu}), InvalidInputError, f"GPU {missing_gpu}"),
        (dict(device_map={"": "disk"}), InvalidInputError, "offload_folder"),
        (dict(device_map={"conv_in": "cpu"}), InvalidInputError, "device map"),
        (dict(device_map="everywhere"), InvalidInputError, "unknown device_map"),
        (dict(device_map=missing_gpu), InvalidInputError, f"GPU {missing_gpu}"),
        (dict(device_map=f"cuda:{missing_gpu}"), InvalidInputError, f"GPU {missing_gpu}"),
        (dict(device_map="disk"), InvalidInputError, "offload_folder"),
        (dict(device_map=True), InvalidInputError, "unknown device_map"),
        (dict(max_memory="cpu=lots"), InvalidInputError, "cpu"),
        (dict(offload_options={"device": "cpu"}), InvalidInputError, "offload="),
    ]
    for kwargs, error, needle in cases:
        with pytest.raises(error, match=needle) as info:
            shardkit.load_model(cls, folder, config=config, **kwargs)
        assert "\n" not in str(info.value), kwargs
    with pytest.raises(InvalidInputError, match="unknown model class"):
        shardkit.load_model("diffusers:NoSuchUNet", folder, config=config)
    shards = sorted(folder.glob("*.safetensors"))
    shards[1].write_bytes(b"\xff" * 64)
    with pytest.raises(HeaderError, match=shards[1].name):
        shardkit.load_model(cls, folder, config=config)
    shards[2].unlink()
    with pytest.raises(CheckpointIndexError, match=shards[2].name):
        shardkit.load_model(cls, folder, config=config)


@pytest.mark.parametrize("device_map", ["cpu", "CPU", torch.device("cpu")])
def test_one_device_for_the_whole_model_as_transformers_takes_it(tmp_path, device_map) -> None:
    eager, cls, config, forward = _unet()
    folder = save_model(eager, tmp_path / "ckpt", max_shard_size="16KB")
    model = shardkit.load_model(cls, folder, config=config, device_map=device_map)
    assert model.hf_device_map == {"": "cpu"}
    _close(forward(model), forward(eager), exact=False)


def test_a_host_only_load_never_counts_gpus(tmp_path, monkeypatch) -> None:
    # Counting GPUs initialises the CUDA driver (host memory, time): a load that names no GPU must not.
    eager, cls, config, forward = _unet()
    folder = save_model(eager, tmp_path / "ckpt", max_shard_size="16KB")
    want = forward(eager)

    def refuse() -> int:
        raise AssertionError("torch.cuda.device_count() called for a host-only load")

    monkeypatch.setattr(torch.cuda, "device_count", refuse)
    for options in (dict(), dict(device_map="cpu"), dict(device_map={"": "cpu"}), dict(device_map=torch.device("cpu"))):
        _close(forward(shardkit.load_model(cls, folder, config=config, **options)), want, exact=False)


@pytest.mark.gpu
@pytest.mark.parametrize("device_map", [0, "cuda", "cuda:0", torch.device("cuda", 0)])
def test_one_gpu_for_the_whole_model(tmp_path, device_map) -> None:
    eager, cls, config, _ = _unet()
    folder = save_model(eager, tmp_path / "ckpt", max_shard_size="16KB")
    model = shardkit.load_model(cls, folder, config=config, device_map=device_map)
    assert model.hf_device_map == {"": 0}
    for name, tensor in eager.state_dict().items():
        assert torch.equal(model.state_dict()[name].cpu(), tensor), name


def test_config_defaults_to_the_one_beside_the_checkpoint(tmp_path) -> None:
    """Like `shardkit plan`, load_model reads CHECKPOINT/config.json when not given config= (issue 14, item 14)."""
    eager, cls, _, forward = _unet()
    pipeline = tmp_path / "pipe"
    pipeline.mkdir()
    folder = save_model(eager, pipeline / "unet", max_shard_size="16KB")   # a component folder in a pipeline
    (pipeline / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline",
                                                           "unet": ["diffusers", "UNet2DConditionModel"]}))
    want = forward(eager)
    index = next(folder.glob("*.index.json"))
    for model, checkpoint in ((cls, folder), ("diffusers:UNet2DConditionModel", folder),
                              ("diffusers:UNet2DConditionModel", index)):
        _close(forward(shardkit.load_model(model, checkpoint)), want, exact=False)
    # A plain factory takes no config unless given one, even with a config.json beside the weights.
    factory = make_tied_lm()
    lm = save_model(factory(), tmp_path / "lm")
    (lm / "config.json").write_text(json.dumps({"vocab": 32}))
    assert isinstance(shardkit.load_model(factory, lm), factory)
    # An open checkpoint has no folder: the config must be given, and the error says how.
    with shardkit.open(folder) as ckpt, pytest.raises(InvalidInputError, match="needs a config"):
        shardkit.load_model(cls, ckpt)
    # The Python planner defaults the same way.
    from shardkit.loading.device_map import plan_device_map

    plan = plan_device_map("diffusers:UNet2DConditionModel", checkpoint=folder, max_memory={"cpu": "1GB"})
    assert plan.parameters == sum(p.numel() for p in eager.parameters())


def test_layerwise_casting_and_offload_are_applied_after_loading(tmp_path) -> None:
    eager, cls, config, forward = _unet()
    folder = save_model(eager, tmp_path / "ckpt")
    model = shardkit.load_model(cls, folder, config=config, layerwise_casting=("float8_e4m3fn", "bfloat16"))
    dtypes = {p.dtype for p in model.parameters()}
    assert torch.float8_e4m3fn in dtypes and torch.float32 not in dtypes
    model = shardkit.load_model(cls, folder, config=config, offload="sequential", offload_options={"device": "cpu"})
    assert any(hasattr(m, "_hf_hook") for m in model.modules())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _close(forward(model), forward(eager), exact=False)


PEAK_SCRIPT = textwrap.dedent("""
    import json, sys, torch, shardkit, accelerate.utils, shardkit.loading.load
    from torch import nn

    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    factory = lambda: nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(24)])
    dtype = getattr(torch, sys.argv[2]) if sys.argv[2] != "none" else None
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) so that import-time spikes do not count
    base = status("VmRSS")
    # read="mmap": auto would pick pread (a full read) if memory pressure evicted the new shards
    model = shardkit.load_model(factory, sys.argv[1], device_map="cpu", dtype=dtype, read="mmap")
    loaded = status("VmHWM")
    for p in model.parameters():  # touch every weight: mapped pages become resident
        p.sum()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"base": base, "loaded": loaded, "touched": status("VmHWM"), "model": model_bytes}))
""")


@pytest.mark.parametrize("dtype", ["none", "bfloat16"])
def test_peak_host_memory_stays_near_the_model_bytes(tmp_path, dtype) -> None:
    from torch import nn

    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(24)])
    shardkit.save_sharded(model, tmp_path / "ckpt", max_shard_size="30MB")
    del model
    (tmp_path / "peak.py").write_text(PEAK_SCRIPT)
    done = subprocess.run([sys.executable, str(tmp_path / "peak.py"), str(tmp_path / "ckpt"), dtype],
                          capture_output=True, text=True, timeout=300, check=True)
    m = json.loads(done.stdout.strip().splitlines()[-1])
    largest_fp32_tensor = 1024 * 1024 * 4
    # Even with every page touched: the model's own bytes plus one tensor in flight, never two copies.
    assert m["touched"] - m["base"] < 1.15 * m["model"] + largest_fp32_tensor, m
    if dtype == "none":  # zero-copy: loading itself reads (almost) nothing
        assert m["loaded"] - m["base"] < 0.25 * m["model"], m


# ----------------------------------------------------------------- reads overlapping the skeleton build


class _Weights(torch.nn.Module):
    """Parameters (floating) and buffers (integer) named and shaped as ``state``'s tensors."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in state.items():
            module = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            if tensor.is_floating_point():
                module.register_parameter(leaf, torch.nn.Parameter(torch.empty_like(tensor)))
            else:
                module.register_buffer(leaf, torch.empty_like(tensor))


def _weights(folder, *, tensors: int = 12, nbytes: int = 256 << 10, max_shard_size: str = "1MB") -> dict[str, torch.Tensor]:
    state = {f"blocks.{i:02d}.weight": torch.randn(nbytes // 2).to(torch.float16).reshape(16, -1) for i in range(tensors)}
    state["steps.index"] = torch.arange(1000, dtype=torch.int64)
    shardkit.save_sharded(state, folder, max_shard_size=max_shard_size)
    return state


def _shard_bytes_seen(mount) -> int:
    return sum(n for f, n in mount.stats()["files"].items() if f.endswith(".safetensors"))


def _wait_for(condition: Callable[[], bool], *, timeout_s: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_load_model_reads_the_weights_while_the_skeleton_builds(tmp_path) -> None:
    from helpers_latency import mount_or_skip

    mount = mount_or_skip(tmp_path, latency_ms=2, direct_io=True)
    try:
        state = _weights(mount.source)
        total = sum(t.nbytes for t in state.values())
        seen: dict[str, bool] = {}

        def build() -> _Weights:  # the model's constructor, called before anything else touches the shards
            seen["all read"] = _wait_for(lambda: _shard_bytes_seen(mount) >= total)
            return _Weights(state)

        model = shardkit.load_model(build, mount.mountpoint, read="pread")
        assert seen["all read"], "the weights are read while the model is built, not after"
        assert model.shardkit_load_report["early_bytes"] == total
        assert model.shardkit_load_report["host_batch_bytes"] == total
        got = model.state_dict()
        assert all(tensor_bytes(got[n]) == tensor_bytes(state[n]) for n in state)
        assert isinstance(model.get_submodule("blocks.00").weight, torch.nn.Parameter)
        assert model.get_submodule("blocks.00").weight.requires_grad
    finally:
        mount.stop()


def test_a_failed_build_cancels_the_early_reads_and_joins_every_thread(tmp_path) -> None:
    import threading

    from helpers_latency import mount_or_skip

    mount = mount_or_skip(tmp_path, latency_ms=10, direct_io=True)
    try:
        _weights(mount.source, tensors=24, nbytes=1 << 20, max_shard_size="8MB")
        seen: dict[str, bool] = {}

        def build() -> _Weights:
            seen["reading"] = _wait_for(lambda: _shard_bytes_seen(mount) > (1 << 20))
            raise ValueError("cross_attention_dim must be specified")

        with pytest.raises(InvalidInputError, match="cross_attention_dim"):
            shardkit.load_model(build, mount.mountpoint, read="pread")
        assert seen["reading"], "reads had started when the build failed"
        left = [t.name for t in threading.enumerate() if t.name.startswith("shardkit-")]
        assert left == [], left
    finally:
        mount.stop()


@pytest.mark.parametrize(("dtype", "early"), [(None, "all"), ("fp16", "all"), ("bf16", "integers"), ("fp32", "integers")])
def test_early_reads_take_only_tensors_that_keep_their_stored_dtype(tmp_path, dtype, early) -> None:
    state = _weights(tmp_path / "ckpt", tensors=4, nbytes=64 << 10, max_shard_size="100KB")
    model = shardkit.load_model(lambda: _Weights(state), tmp_path / "ckpt", read="pread", dtype=dtype)
    integers = state["steps.index"].nbytes
    report = model.shardkit_load_report
    assert report["early_bytes"] == (sum(t.nbytes for t in state.values()) if early == "all" else integers)
    got = model.state_dict()
    for name, tensor in state.items():
        want = tensor.to(resolve_torch_dtype(dtype)) if dtype and tensor.is_floating_point() else tensor
        assert got[name].dtype == want.dtype and tensor_bytes(got[name]) == tensor_bytes(want), name


def test_no_early_reads_into_a_checkpoint_the_caller_holds_or_a_map_not_known_yet(tmp_path) -> None:
    state = _weights(tmp_path / "ckpt", tensors=4, nbytes=64 << 10, max_shard_size="100KB")
    with shardkit.open(tmp_path / "ckpt", read="pread") as ckpt:
        held = shardkit.load_model(lambda: _Weights(state), ckpt)
    planned = shardkit.load_model(lambda: _Weights(state), tmp_path / "ckpt", read="pread", device_map="sequential",
                                  max_memory={"cpu": "1GB"})  # a host-only plan with a GPU present too
    for model in (held, planned):
        assert model.shardkit_load_report["early_bytes"] == 0
        assert model.shardkit_load_report["host_batch_bytes"] == sum(t.nbytes for t in state.values())
        got = model.state_dict()
        assert all(tensor_bytes(got[n]) == tensor_bytes(state[n]) for n in state)
