#!/usr/bin/env python
"""The staged multi-device recipe from the diffusers docs, on shardkit-sharded pipeline folders.

A Flux pipeline is too big for one 16 GB GPU, but no stage needs all of it at once:

1. load only the text encoders (``device_map="balanced"`` over the GPUs), encode the prompt,
   free them;
2. load the denoiser with ``shardkit.load_model(device_map="auto", max_memory=...)`` so its
   blocks are split over the devices, run the denoising loop on the prompt embeddings, free it;
3. load the VAE and decode the latents.

Without a folder the script builds a tiny Flux-like pipeline from configs (random weights, local
tokenizers; nothing is downloaded), shards it with ``shardkit.split``, runs the recipe and checks
that the image equals the one-shot pipeline's. On a machine without CUDA every stage runs on the
CPU, which is what CI does.

    python docs/examples/staged_multi_gpu.py --steps 2 --size 64
    python docs/examples/staged_multi_gpu.py --folder flux-sharded/ --max-memory 0=16GB,1=16GB --dtype bf16
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from typing import Any

PROMPT = "a photo of a red cat under a blue sky"
WORDS = ["<pad>", "</s>", "<unk>", "<s>"] + "a photo of red blue cat dog under sky tree".split()


def _tokenizer(max_length: int) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   bos_token="<s>", model_max_length=max_length)


def build_tiny_flux_pipeline(seed: int = 0, *, width: int = 32) -> Any:
    """A FluxPipeline with the real classes at toy sizes (eval mode, random weights)."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    vocab = len(WORDS)
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=vocab, hidden_size=width, intermediate_size=37, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=77, projection_dim=width,
                                        eos_token_id=1, bos_token_id=3, pad_token_id=0))
    t5 = T5EncoderModel(T5Config(vocab_size=vocab, d_model=width, d_ff=37, d_kv=8, num_layers=2, num_heads=4,
                                 relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
                                         attention_head_dim=16, num_attention_heads=2, joint_attention_dim=width,
                                         pooled_projection_dim=width, axes_dims_rope=[4, 4, 8])
    # four levels: the same 8x spatial factor as the real Flux VAE, which the stages assume
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
                        up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[8, 8, 16, 16], latent_channels=4,
                        layers_per_block=1, norm_num_groups=8, sample_size=32, use_quant_conv=False,
                        use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035)
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=clip, tokenizer=_tokenizer(77),
                        text_encoder_2=t5, tokenizer_2=_tokenizer(16), transformer=transformer)
    for component in pipe.components.values():
        if hasattr(component, "eval"):
            component.eval()  # T5 and CLIP dropout would make runs differ
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe: Any, *, size: int, steps: int, **kwargs: Any) -> Any:
    """One generation with fixed settings; ``kwargs`` may replace the prompt with embeddings."""
    import torch

    if "prompt_embeds" not in kwargs:
        kwargs["prompt"] = PROMPT
    return pipe(height=size, width=size, num_inference_steps=steps, max_sequence_length=16, guidance_scale=3.5,
                generator=torch.Generator().manual_seed(0), **kwargs)


def _free(*objects: Any) -> None:
    import torch

    del objects
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _memory(max_memory: str | None) -> tuple[str | None, Any]:
    """(pipeline device_map, load_model max_memory) for the devices at hand."""
    import torch

    if max_memory:
        return ("balanced" if torch.cuda.is_available() else None), max_memory
    if torch.cuda.device_count() > 0:
        return "balanced", None
    return None, None


def staged(folder: str, *, size: int, steps: int, max_memory: str | None, dtype: str | None) -> tuple[Any, dict[str, Any]]:
    """Run the three stages on ``folder``; return (images, where each stage ran)."""
    import torch
    from diffusers import AutoencoderKL, DiffusionPipeline

    import shardkit

    torch_dtype = shardkit.formats.dtypes.resolve_torch_dtype(dtype) if dtype else None
    device_map, budget = _memory(max_memory)
    info: dict[str, Any] = {}

    # 1. text encoders only (transformer and VAE not even loaded)
    encoders = DiffusionPipeline.from_pretrained(folder, transformer=None, vae=None, device_map=device_map,
                                                 torch_dtype=torch_dtype, max_memory=_gpu_only(budget))
    info["encoders"] = encoders.hf_device_map or "cpu"
    with torch.no_grad():
        prompt_embeds, pooled, _ = encoders.encode_prompt(prompt=PROMPT, prompt_2=None, max_sequence_length=16)
    _free(encoders)
    del encoders

    # 2. the denoiser, split over the devices by shardkit.load_model
    transformer = shardkit.load_model("diffusers:FluxTransformer2DModel", os.path.join(folder, "transformer"),
                                      config=os.path.join(folder, "transformer", "config.json"),
                                      device_map="auto" if torch.cuda.is_available() else "cpu",
                                      max_memory=budget, dtype=torch_dtype)
    info["transformer"] = sorted(set(map(str, getattr(transformer, "hf_device_map", {"": "cpu"}).values())))
    denoise = DiffusionPipeline.from_pretrained(folder, transformer=transformer, text_encoder=None, text_encoder_2=None,
                                                tokenizer=None, tokenizer_2=None, vae=None, torch_dtype=torch_dtype)
    denoise.set_progress_bar_config(disable=True)
    with torch.no_grad():
        latents = generate(denoise, size=size, steps=steps, prompt_embeds=prompt_embeds, pooled_prompt_embeds=pooled,
                           output_type="latent").images
    vae_scale = denoise.vae_scale_factor
    _free(denoise, transformer)
    del denoise, transformer

    # 3. the VAE decodes
    vae = AutoencoderKL.from_pretrained(folder, subfolder="vae", torch_dtype=torch_dtype)
    vae.to("cuda" if torch.cuda.is_available() else "cpu")
    from diffusers import FluxPipeline

    latents = FluxPipeline._unpack_latents(latents, size, size, vae_scale)
    latents = latents / vae.config.scaling_factor + vae.config.shift_factor
    with torch.no_grad():
        image = vae.decode(latents.to(vae.device, vae.dtype), return_dict=False)[0]
    info["vae"] = str(vae.device)
    return (image / 2 + 0.5).clamp(0, 1).cpu(), info


def _gpu_only(budget: Any) -> Any:
    if not budget:
        return None
    from shardkit.loading.device_map import parse_max_memory

    return {k: v for k, v in parse_max_memory(budget).items() if k != "cpu"} or None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", help="a Flux pipeline folder (default: build a tiny one)")
    parser.add_argument("--size", type=int, default=64, help="image height and width (multiple of 16)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--max-memory", help="e.g. 0=16GB,1=16GB (GPUs for the denoiser split)")
    parser.add_argument("--dtype", help="bf16, fp16... (default: as saved)")
    args = parser.parse_args(argv)

    import torch

    import shardkit

    with tempfile.TemporaryDirectory(prefix="staged-") as tmp:
        folder, reference = args.folder, None
        if folder is None:
            pipe = build_tiny_flux_pipeline()
            pipe.save_pretrained(os.path.join(tmp, "saved"))
            reference = generate(pipe, size=args.size, steps=args.steps, output_type="pt").images
            folder = os.path.join(tmp, "sharded")
            shardkit.split(os.path.join(tmp, "saved", "transformer"), os.path.join(tmp, "transformer"), max_shard_size="40KB")
            _assemble_sharded(tmp, folder)
        start = time.perf_counter()
        image, info = staged(folder, size=args.size, steps=args.steps, max_memory=args.max_memory, dtype=args.dtype)
        seconds = time.perf_counter() - start
    print(f"devices: {torch.cuda.device_count()} CUDA" if torch.cuda.is_available() else "devices: CPU only")
    for stage, where in info.items():
        print(f"{stage}: {where}")
    print(f"image {tuple(image.shape)} in {seconds:.2f} s")
    if reference is not None:
        diff = (image - reference.cpu()).abs().max().item()
        print(f"max |staged - one-shot| = {diff:.2e}")
        if diff > 1e-4:
            print("error: the staged image differs from the one-shot pipeline", file=sys.stderr)
            return 1
    return 0


def _assemble_sharded(tmp: str, folder: str) -> None:
    """The saved pipeline with its transformer replaced by shardkit's shards."""
    import shutil

    shutil.copytree(os.path.join(tmp, "saved"), folder)
    target = os.path.join(folder, "transformer")
    for name in os.listdir(target):
        if name.endswith((".safetensors", ".json")) and name != "config.json":
            os.remove(os.path.join(target, name))
    for name in os.listdir(os.path.join(tmp, "transformer")):
        shutil.copy(os.path.join(tmp, "transformer", name), target)


if __name__ == "__main__":
    sys.exit(main())
