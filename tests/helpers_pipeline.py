"""A tiny Stable Diffusion pipeline built from configs, offline (no Hub access).

UNet, VAE and CLIP text encoder get random weights from a fixed seed; the CLIP tokenizer is
built from a hand-written byte-level vocabulary and merges file. :func:`write_pipeline_folder`
lays out the same folder shape from plain numpy arrays (no torch, no diffusers), for tests that
only need the files, such as the crash harness's many short-lived runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Byte-level BPE alphabet as CLIP's tokenizer maps bytes to unicode characters.
_WORDS = ["a", "photo", "of", "cat", "dog", "red", "blue", "the"]


def _bytes_to_unicode() -> list[str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def write_tiny_clip_tokenizer_files(folder: Path) -> tuple[Path, Path]:
    """vocab.json + merges.txt: every byte symbol, its end-of-word form, a few whole words."""
    folder.mkdir(parents=True, exist_ok=True)
    symbols = _bytes_to_unicode()
    vocab: dict[str, int] = {}
    for s in symbols + [s + "</w>" for s in symbols]:
        vocab.setdefault(s, len(vocab))
    merges = []
    for word in _WORDS:
        # merge left to right: ((a b) c) ... with the last symbol carrying </w>
        parts = list(word[:-1]) + [word[-1] + "</w>"]
        while len(parts) > 1:
            merges.append(f"{parts[0]} {parts[1]}")
            parts = [parts[0] + parts[1]] + parts[2:]
            vocab.setdefault(parts[0], len(vocab))
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab.setdefault(special, len(vocab))
    vocab_path, merges_path = folder / "vocab.json", folder / "merges.txt"
    vocab_path.write_text(json.dumps(vocab), encoding="utf-8")
    merges_path.write_text("#version: 0.2\n" + "\n".join(dict.fromkeys(merges)) + "\n", encoding="utf-8")
    return vocab_path, merges_path


def write_pipeline_folder(folder: Path, components: dict[str, dict[str, Any]]) -> Path:
    """A diffusers pipeline folder: ``model_index.json``, one weight-bearing subfolder per entry of
    ``components`` (``{"unet": {name: numpy array}}``), a tokenizer, a scheduler and a README.

    ``text_encoder*`` components get transformers naming (``model.safetensors``), the others
    diffusers naming (``diffusion_pytorch_model.safetensors``); every one gets a ``config.json``.
    """
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    index: dict[str, Any] = {"_class_name": "StableDiffusionPipeline", "_diffusers_version": "0.30.0"}
    for name, tensors in components.items():
        transformers = name.startswith("text_encoder")
        index[name] = ["transformers", "CLIPTextModel"] if transformers else ["diffusers", "UNet2DConditionModel"]
        (folder / name).mkdir(exist_ok=True)
        weights = "model.safetensors" if transformers else "diffusion_pytorch_model.safetensors"
        save_file(tensors, str(folder / name / weights), metadata={"format": "pt"})
        (folder / name / "config.json").write_text(json.dumps({"_class_name": index[name][1], "tensors": len(tensors)}))
    index["tokenizer"] = ["transformers", "CLIPTokenizer"]
    write_tiny_clip_tokenizer_files(folder / "tokenizer")
    index["scheduler"] = ["diffusers", "DDIMScheduler"]
    (folder / "scheduler").mkdir(exist_ok=True)
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps({"_class_name": "DDIMScheduler"}))
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))
    (folder / "README.md").write_text("tiny test pipeline\n")
    return folder


def build_tiny_sd_pipeline(scratch: Path, *, seed: int = 0) -> Any:
    """A StableDiffusionPipeline with tiny random components (a few MB in all)."""
    import torch
    from diffusers import (
        AutoencoderKL,
        DDIMScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=1, sample_size=16, in_channels=4, out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=4, norm_num_groups=8,
    )
    vae = AutoencoderKL(
        block_out_channels=(16, 32), in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=8,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), sample_size=32,
    )
    vocab, merges = write_tiny_clip_tokenizer_files(scratch / "tok-src")
    tokenizer = CLIPTokenizer(str(vocab), str(merges), model_max_length=16)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_attention_heads=4,
        num_hidden_layers=2, max_position_embeddings=16, projection_dim=32,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=1,
    ))
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False)
    return StableDiffusionPipeline(unet=unet, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)


def generate(pipe: Any, *, seed: int = 0) -> Any:
    """One tiny image (numpy array) from a fixed seed, 2 inference steps."""
    import torch

    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator("cpu").manual_seed(seed)
    return pipe("a photo of a cat", num_inference_steps=2, height=32, width=32, guidance_scale=2.0,
                generator=generator, output_type="np").images[0]
