"""The fit planner: pure ranking on fake sizes, and fit="auto" on a tiny real pipeline."""

from __future__ import annotations

import numpy as np
import pytest

from shardkit.errors import InvalidInputError
from shardkit.fitting.autofit import Budget, FitError, FitPlan, Margin, fit, plan_fit
from shardkit.fitting.profile import ComponentProfile

GB = 10**9
NO_MARGIN = Margin(0.0, 0)


def fake_pipeline(*, vae_tiling: bool = True, castable: bool = True) -> list[ComponentProfile]:
    """Sizes shaped like a small SD pipeline (GB-scale round numbers so the peaks are easy to read).

    all on one GPU: 6.2 weights + 3.0 VAE decode = 9.2; tiling drops the decode to 0.5.
    """
    vae_acts = {"": 3 * GB, "vae_slicing": 3 * GB}
    if vae_tiling:
        vae_acts.update({"vae_tiling": GB // 2, "vae_slicing+vae_tiling": GB // 2})
    return [
        ComponentProfile.from_totals("text_encoder", "text_encoder", weight_bytes=GB, leaf_bytes=GB // 5,
                         activation_bytes={"": GB // 10}),
        ComponentProfile.from_totals("unet", "denoiser", weight_bytes=5 * GB, block_bytes=(4 * GB // 10,) * 10,
                         leaf_bytes=GB // 10, castable_bytes=4 * GB if castable else 0, dtype_bytes=2,
                         activation_bytes={"": GB, "attention_slicing": 3 * GB // 2}),
        ComponentProfile.from_totals("vae", "vae", weight_bytes=GB // 5, leaf_bytes=GB // 20, activation_bytes=vae_acts),
    ]


def choose(gpu_gb: float, **kwargs: object) -> FitPlan:
    return plan_fit(fake_pipeline(**kwargs.pop("profile", {})), Budget((int(gpu_gb * GB),)),  # type: ignore[arg-type]
                    margin=NO_MARGIN, **kwargs)  # type: ignore[arg-type]


NON_STREAM_GROUPS = {"allow_fp8": False, "streams": False, "exclude": ["sequential"]}


@pytest.mark.parametrize("gpu_gb, kwargs, expected", [
    (10, {}, "gpu"),
    (7.5, {}, "gpu+vae_tiling"),
    (6.5, {}, "model_offload"),           # measured faster than keeping fp8-cast weights on the GPU
    (5.5, {}, "gpu+fp8+vae_tiling"),
    (4.5, {}, "model_offload+fp8"),
    (3.7, {}, "group_block_stream"),
    (3.0, {"allow_fp8": False}, "group_block_stream+vae_tiling"),
    (2.5, {}, "group_block_stream+fp8+vae_tiling"),
    (1.5, {}, "group_leaf_stream+vae_tiling"),
    (1.15, {}, "sequential+vae_tiling"),  # measured ahead of every non-stream group offload
    (4.5, {"streams": False}, "model_offload+fp8"),
    (3.5, {"streams": False}, "sequential"),
    (6.5, {"allow_fp8": False}, "model_offload"),
    (5.0, NON_STREAM_GROUPS, "group_block_4"),
    (3.4, NON_STREAM_GROUPS, "group_block_2"),
    (3.0, NON_STREAM_GROUPS, "group_block_2+vae_tiling"),
    (2.5, NON_STREAM_GROUPS, "group_block_1+vae_tiling"),
    (1.15, NON_STREAM_GROUPS, "group_leaf+vae_tiling"),
    (1.15, {"allow_fp8": False, "exclude": ["group"]}, "sequential+vae_tiling"),
])
def test_budget_forces_each_strategy(gpu_gb: float, kwargs: dict, expected: str) -> None:
    plan = choose(gpu_gb, **kwargs)
    assert plan.chosen.name == expected
    # The pick fits, and every faster candidate was ruled out with a stated reason.
    assert max(plan.chosen.peaks.gpu) <= gpu_gb * GB
    faster = plan.candidates[:plan.candidates.index(plan.chosen)]
    assert all(not c.fits and c.reason for c in faster)
    assert len(plan.why()) == len(faster) + (1 if plan.chosen.switches else 0)


def test_multi_gpu_balanced_and_staged() -> None:
    # Two 6 GB GPUs: the 6.0 GB UNet + 1.0 GB activations needs a GPU of its own; the rest fits the other.
    plan = plan_fit(fake_pipeline(), Budget((int(7.5 * GB), 6 * GB)), margin=NO_MARGIN)
    assert plan.chosen.name == "balanced"
    assert plan.setup()["device_map"] == {"unet": 0, "vae": 1, "text_encoder": 1}
    # Two 5 GB GPUs: no GPU holds the whole UNet, so the staged split (denoiser blocks over both) wins
    # over offloading.
    plan = plan_fit(fake_pipeline(), Budget((5 * GB, 5 * GB)), margin=NO_MARGIN, allow_fp8=False)
    assert plan.chosen.strategy.name == "staged"
    assert plan.setup()["device_map"]["unet"] == [0, 1]
    assert all(p <= 5 * GB for p in plan.chosen.peaks.gpu)
    assert any("balanced" in line for line in plan.why())


def test_impossible_budget_names_the_smallest_budget_that_fits() -> None:
    with pytest.raises(FitError) as info:
        choose(0.5)
    err = info.value
    assert "smallest budget that would fit is gpu=" in str(err)
    assert err.min_gpu_bytes is not None and err.min_gpu_bytes > 0.5 * GB
    # The stated budget really is the smallest: it fits, and one byte less does not.
    plan = plan_fit(fake_pipeline(), Budget((err.min_gpu_bytes,)), margin=NO_MARGIN)
    assert plan.chosen.fits
    with pytest.raises(FitError):
        plan_fit(fake_pipeline(), Budget((err.min_gpu_bytes - 1,)), margin=NO_MARGIN)


def test_impossible_cpu_budget_says_both_budgets() -> None:
    with pytest.raises(FitError) as info:
        plan_fit(fake_pipeline(), Budget((GB,), cpu_bytes=GB), margin=NO_MARGIN)
    # Either a bigger GPU with the same RAM, or the smallest GPU with the RAM offloading needs
    # (offloaded weights live in CPU RAM).
    message = str(info.value)
    assert "gpu='5.30GB' (all on one GPU" in message
    assert ", or gpu='1.10GB' cpu='6.20GB' (sequential offload" in message
    assert info.value.min_gpu_bytes == int(5.3 * GB) and info.value.min_cpu_bytes == 0


def test_margin_is_applied_per_device() -> None:
    margin = Margin(0.10, 512 * 2**20)
    need = 9_200_000_000  # all on one GPU, see fake_pipeline
    assert plan_fit(fake_pipeline(), Budget((margin.budget_for(need, gpu=True),)), margin=margin).chosen.name == "gpu"
    plan = plan_fit(fake_pipeline(), Budget((margin.budget_for(need, gpu=True) - 1,)), margin=margin)
    assert plan.chosen.name == "gpu+vae_tiling"
    assert any(line.startswith("all on one GPU without vae tiling: cuda:0 would need 9.20 GB") and "usable" in line
               for line in plan.why())


def test_options_a_component_lacks_are_never_chosen() -> None:
    # Without VAE tiling, 7.5 GB cannot keep everything on the GPU (decode 3.0 GB): the planner
    # must pick something else rather than a switch the VAE does not have.
    profiles = fake_pipeline(vae_tiling=False)
    for gpu_gb in (10, 7.5, 6.5, 4.5, 3.5, 2.0):
        try:
            plan = plan_fit(profiles, Budget((int(gpu_gb * GB),)), margin=NO_MARGIN)
        except FitError:
            continue
        assert all("vae_tiling" not in c.switches for c in plan.candidates)
    assert plan_fit(profiles, Budget((int(7.5 * GB),)), margin=NO_MARGIN).chosen.name == "model_offload"
    # No castable layers: no fp8 candidate at all.
    plan = plan_fit(fake_pipeline(castable=False), Budget((int(6.5 * GB),)), margin=NO_MARGIN)
    assert not any(c.fp8 for c in plan.candidates)


def test_attention_slicing_only_when_it_lowers_the_peak() -> None:
    # With SDPA the sliced activation is larger: never chosen. With eager attention it is smaller.
    for plan in (choose(g) for g in (10, 7.5, 4.5, 3.0)):
        assert "attention_slicing" not in plan.chosen.switches
    eager = fake_pipeline()
    eager[1] = ComponentProfile.from_totals("unet", "denoiser", weight_bytes=5 * GB, leaf_bytes=GB // 10,
                                activation_bytes={"": 4 * GB, "attention_slicing": 2 * GB})
    plan = plan_fit(eager, Budget((int(8.5 * GB),)), margin=NO_MARGIN)
    assert plan.chosen.name == "gpu+attention_slicing+vae_tiling"


def test_budget_parsing_and_input_errors() -> None:
    budget = Budget.parse(max_memory={1: "16GB", 0: "8GB", "cpu": "24GiB"})
    assert budget == Budget((8 * GB, 16 * GB), 24 * 2**30)
    assert Budget.parse(["8GB", "16GB"], "1GB") == Budget((8 * GB, 16 * GB), GB)
    with pytest.raises(Exception, match="unknown device"):
        Budget.parse(max_memory={"tpu": "8GB"})
    with pytest.raises(Exception, match="no memory budget"):
        plan_fit(fake_pipeline(), Budget())
    # CPU-only budget: everything on the CPU.
    assert plan_fit(fake_pipeline(), Budget((), 20 * GB), margin=NO_MARGIN).chosen.name == "cpu"
    with pytest.raises(FitError, match="cpu="):
        plan_fit(fake_pipeline(), Budget((), GB), margin=NO_MARGIN)


def test_plan_explains_itself() -> None:
    plan = choose(4.5, streams=False)
    text = str(plan)
    assert text.startswith("chosen: model offload + fp8 layerwise casting")
    assert "cuda:0" in text and "faster setups ruled out" in text
    data = plan.to_dict()
    assert data["chosen"]["name"] == "model_offload+fp8"
    assert data["setup"]["offload"] == "model"
    assert data["setup"]["layerwise_casting"] == ("float8_e4m3fn", "bfloat16")
    assert [c["name"] for c in data["candidates"]][: len(plan.why())] == [c.name for c in plan.candidates][: len(plan.why())]
    assert fit(fake_pipeline(), gpu="4.5GB", margin=NO_MARGIN, device="cpu").chosen.name == "model_offload+fp8"


# ----------------------------------------------------------------------------- a real tiny pipeline

@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory):
    from helpers_fit import save_tiny_pipeline

    root = tmp_path_factory.mktemp("fit")
    save_tiny_pipeline(root / "pipe", root / "scratch")
    return root / "pipe"


@pytest.fixture(scope="module")
def plain_image(tiny_folder):
    from helpers_pipeline import generate

    import shardkit

    return generate(shardkit.load_pipeline(tiny_folder))


def test_profiles_come_from_headers_and_skeletons(tiny_folder) -> None:
    from safetensors import safe_open

    plan = fit(tiny_folder, gpu="1GB")
    sizes = {p.name: p for p in plan.components}
    assert set(sizes) == {"text_encoder", "unet", "vae"}
    with safe_open(str(tiny_folder / "unet" / "diffusion_pytorch_model.safetensors"), "pt") as f:
        unet_bytes = sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys()) * 4  # fp32 checkpoint
    assert sizes["unet"].weight_bytes == unet_bytes
    assert [len(blocks) for blocks in sizes["unet"].weights.block_lists] == [2, 2]  # down_blocks, up_blocks
    assert sizes["unet"].fp8_saving_bytes > 0 and sizes["vae"].fp8_saving_bytes == 0
    assert {"vae_tiling", "vae_slicing"} <= sizes["vae"].switches()
    assert plan.workload.height == 16 * 2  # the UNet's sample_size x the VAE's scale factor
    assert plan.chosen.name == "gpu"


def test_vae_without_tiling_is_never_chosen(tmp_path) -> None:
    from helpers_fit import save_tiny_pipeline, swap_in_vq_vae

    save_tiny_pipeline(tmp_path / "pipe", tmp_path / "scratch")
    swap_in_vq_vae(tmp_path / "pipe")
    margin = Margin(0.1, 0)
    plan = fit(tmp_path / "pipe", gpu="1GB", height=256, width=256, margin=margin)
    vae = next(p for p in plan.components if p.name == "vae")
    assert not vae.switches() and any("VQModel does not support tiling" in n for n in vae.notes)
    for budget in ("1GB", "200MB", "120MB", "100MB"):
        try:
            plan = fit(tmp_path / "pipe", gpu=budget, height=256, width=256, margin=margin)
        except FitError:
            continue
        assert all("vae_tiling" not in c.switches and "vae_slicing" not in c.switches for c in plan.candidates)


def budget_forcing(folder, name: str, margin: Margin, **kwargs: object) -> int:
    """The GPU budget that just holds candidate ``name``'s estimated peak."""
    roomy = fit(folder, gpu="10GB", margin=margin, **kwargs)  # type: ignore[arg-type]
    return margin.budget_for(int(max(next(c for c in roomy.candidates if c.name == name).peaks.gpu)), gpu=True)


@pytest.mark.parametrize("expected, atol", [
    ("model_offload+fp8", 0.1),   # fp8 storage: within 0.1 on a [0, 1] image
    ("sequential", 1e-5),         # fp32 hooks only: the same image
])
def test_fitted_pipeline_matches_the_plain_one(tiny_folder, plain_image, expected, atol) -> None:
    from helpers_pipeline import generate

    import shardkit

    margin = Margin(0.1, 0)
    gpu = budget_forcing(tiny_folder, expected, margin, device="cpu")
    plan = fit(tiny_folder, gpu=gpu, cpu="1GB", margin=margin, device="cpu")
    assert plan.chosen.name == expected
    pipe = shardkit.load_pipeline(tiny_folder, fit=plan)
    assert pipe.shardkit_plan is plan
    assert pipe.shardkit_offload[0] == plan.setup()["offload"]
    if plan.chosen.fp8:
        assert pipe.unet.down_blocks[0].resnets[0].conv1.weight.dtype == __import__("torch").float8_e4m3fn
    np.testing.assert_allclose(generate(pipe), plain_image, atol=atol)


@pytest.fixture
def no_gpu(monkeypatch):
    """This machine, whatever it has, seen without a GPU (as torch reports it)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def test_fit_auto_without_a_gpu_refuses_gpu_budgets_like_load_model(tiny_folder, no_gpu, tmp_path) -> None:
    """load_pipeline(fit="auto") used to run on the CPU silently where load_model refused (issue 14, item 14)."""
    from conftest import tiny_unet
    from helpers_load import save_model

    import shardkit

    for call in (lambda: shardkit.load_pipeline(tiny_folder, fit="auto", max_memory={0: "1GB", "cpu": "2GB"}),
                 lambda: shardkit.load_pipeline(tiny_folder, fit=fit(tiny_folder, gpu="1GB")),
                 lambda: shardkit.load_pipeline(tiny_folder, device_map="balanced", max_memory={"cuda:0": "1GB"})):
        with pytest.raises(InvalidInputError, match=r"names GPU 0, but this machine has no GPU") as info:
            call()
        assert "max_memory={'cpu'" in str(info.value) and "shardkit.fit(" in str(info.value)
    unet = save_model(tiny_unet(), tmp_path / "unet")
    with pytest.raises(InvalidInputError, match=r"max_memory names GPU 0, but this machine has no GPU"):
        shardkit.load_model("diffusers:UNet2DConditionModel", unet, max_memory={0: "1GB", "cpu": "2GB"})


def test_fit_auto_with_a_cpu_budget_runs_on_the_cpu(tiny_folder, plain_image, no_gpu) -> None:
    from helpers_pipeline import generate

    import shardkit

    pipe = shardkit.load_pipeline(tiny_folder, fit="auto", max_memory={"cpu": "2GB"})
    plan = pipe.shardkit_plan
    assert plan.chosen.strategy.name == "cpu" and plan.device == "cpu"
    assert pipe.unet.device.type == "cpu"
    np.testing.assert_allclose(generate(pipe), plain_image, atol=1e-6)


@pytest.mark.gpu
def test_fit_auto_in_load_pipeline_on_a_gpu(tiny_folder, plain_image) -> None:
    from helpers_pipeline import generate

    import shardkit

    pipe = shardkit.load_pipeline(tiny_folder, fit="auto", max_memory={0: "1GB", "cpu": "2GB"})
    plan = pipe.shardkit_plan
    assert plan.chosen.name == "gpu" and "estimated peak: cuda:0" in str(plan)
    np.testing.assert_allclose(generate(pipe), plain_image, atol=1e-3)


def test_fit_auto_options_and_impossible_budgets(tiny_folder) -> None:
    import shardkit

    with pytest.raises(InvalidInputError, match="fit= chooses"):
        shardkit.load_pipeline(tiny_folder, fit="auto", max_memory={0: "1GB"}, offload="model")
    with pytest.raises(FitError, match="smallest budget that would fit is cpu="):
        shardkit.load_pipeline(tiny_folder, fit="auto", max_memory={"cpu": "1MB"})
    # The switches are load_pipeline options too.
    assert shardkit.load_pipeline(tiny_folder, switches=["vae_tiling"]).vae.use_tiling


def test_fit_plans_a_meta_skeleton() -> None:
    from shardkit.loading.skeleton import build_skeleton

    config = {"block_out_channels": [32, 64], "layers_per_block": 1, "sample_size": 16,
              "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
              "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"], "cross_attention_dim": 32,
              "attention_head_dim": 4, "norm_num_groups": 8}
    skeleton = build_skeleton("diffusers:UNet2DConditionModel", config=config, dtype="bf16")
    plan = fit(skeleton, gpu="1GB", height=64, width=64)
    unet = plan.components[0]
    assert unet.role == "denoiser" and unet.dtype_bytes == 2
    assert unet.weight_bytes == sum(p.numel() for p in skeleton.parameters()) * 2


def _weights_folder(folder, shapes: dict) -> str:
    import torch
    from safetensors.torch import save_file

    folder.mkdir()
    save_file({k: torch.zeros(v) for k, v in shapes.items()}, str(folder / "model.safetensors"))
    return str(folder)


def test_config_less_components_are_guessed_and_every_guess_is_said(tmp_path) -> None:
    """No config.json: role and sizes from the tensors, a ShardkitWarning and ``guessed`` say how (item 7)."""
    from shardkit.errors import ShardkitWarning

    dit = _weights_folder(tmp_path / "mystery", {"transformer_blocks.0.attn.to_q.weight": (128, 128),
                                                 "context_embedder.weight": (128, 64)})
    with pytest.warns(ShardkitWarning, match=r"mystery: no config.json: taken for a diffusion transformer "
                                             r"\(from its tensor names\); read num_attention_heads 2"):
        plan = fit(dit, gpu="1GB", height=64, width=64)
    component = plan.components[0]
    assert component.role == "denoiser" and "joint_attention_dim 64" in component.guessed[0]
    assert plan.to_dict()["components"][0]["guessed"] == list(component.guessed)
    odd = _weights_folder(tmp_path / "odd", {"foo.weight": (4, 4)})
    with pytest.warns(ShardkitWarning, match="tensor names unlike any known component.*add the component's config"):
        plan = fit(odd, gpu="1GB")
    assert plan.components[0].role == "other" and "guessed: odd: no config.json" in str(plan)
