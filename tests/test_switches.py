"""Memory/speed switches: each wraps diffusers' own method, or refuses with the reason."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers_fit import tiny_vq_model
from helpers_pipeline import build_tiny_sd_pipeline, generate

from shardkit.errors import InvalidInputError
from shardkit.runtime.switches import SWITCHES, apply_switches, normalize_switches, unsupported_reason


@pytest.fixture(scope="module")
def pipe(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_sd_pipeline(tmp_path_factory.mktemp("switches"))


def test_every_switch_documents_its_trade_off() -> None:
    assert set(SWITCHES) == {"dtype", "channels_last", "attention_backend", "attention_slicing",
                             "vae_slicing", "vae_tiling", "tf32"}
    for switch in SWITCHES.values():
        assert switch.memory and switch.speed


def test_vae_switches_use_diffusers_flags(pipe) -> None:
    assert apply_switches(pipe, ["vae_tiling", "vae_slicing"]) == ["vae_slicing", "vae_tiling"]
    assert pipe.vae.use_tiling and pipe.vae.use_slicing
    apply_switches(pipe, {"vae_tiling": False, "vae_slicing": False})
    assert not pipe.vae.use_tiling and not pipe.vae.use_slicing


def test_vae_without_tiling_is_refused_with_the_reason() -> None:
    vq = tiny_vq_model()
    reason = unsupported_reason(vq, "vae_tiling")
    assert reason and "VQModel does not support tiling" in reason
    with pytest.raises(InvalidInputError, match="vae_slicing: VQModel does not support slicing"):
        apply_switches(vq, ["vae_slicing"])
    assert not hasattr(vq, "use_slicing")  # refused before anything changed


def test_refusals_leave_the_pipeline_unchanged(pipe) -> None:
    with pytest.raises(InvalidInputError, match="attention_backend: unknown attention backend"):
        apply_switches(pipe, {"vae_tiling": True, "attention_backend": "flash9"})
    assert not pipe.vae.use_tiling
    with pytest.raises(InvalidInputError, match="unknown switch"):
        normalize_switches(["warp_speed"])


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _has_xformers() -> bool:
    import importlib.util

    return importlib.util.find_spec("xformers") is not None


@pytest.mark.skipif(_has_cuda(), reason="CUDA is available: tf32 is supported here, nothing to refuse")
def test_tf32_needs_cuda(pipe) -> None:
    assert "Ampere" in unsupported_reason(pipe, "tf32")


@pytest.mark.skipif(_has_xformers(), reason="xformers is installed: the backend is supported here, nothing to refuse")
def test_xformers_needs_the_package(pipe) -> None:
    assert "not installed" in unsupported_reason(pipe, "attention_backend", "xformers")


def test_outputs_match_with_exact_switches(tmp_path: Path) -> None:
    """Slicing, SDPA, channels_last and attention slicing compute the same image (fp32, 1e-4);
    bf16 weights stay within 0.05 of it on a [0, 1] image."""
    plain = generate(build_tiny_sd_pipeline(tmp_path))
    pipe = build_tiny_sd_pipeline(tmp_path)
    applied = apply_switches(pipe, {"channels_last": True, "attention_backend": "sdpa",
                                    "attention_slicing": "max", "vae_slicing": True})
    assert applied == ["channels_last", "attention_backend", "attention_slicing", "vae_slicing"]
    assert pipe.unet.conv_in.weight.is_contiguous(memory_format=__import__("torch").channels_last)
    assert type(pipe.unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1.processor).__name__ \
        == "SlicedAttnProcessor"
    np.testing.assert_allclose(generate(pipe), plain, atol=1e-4)
    half = build_tiny_sd_pipeline(tmp_path)
    apply_switches(half, {"dtype": "bf16"})
    assert half.unet.dtype == __import__("torch").bfloat16
    assert np.abs(generate(half).astype(np.float32) - plain).max() < 0.05
