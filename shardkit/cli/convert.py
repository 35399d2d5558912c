"""``shardkit convert``."""

from __future__ import annotations

from typing import Any, get_args

import click

from ..api.options import ConvertTo
from .common import byte_progress, echo_json, hub_token_option, no_cache_option, shard_options
from .run import plan_options, run_as_plan

EPILOG = """\b
Examples:
  shardkit convert v1-5-pruned.ckpt unet-out/ --key state_dict \\
      --strip-prefix model.diffusion_model. --dtype fp16
  shardkit convert pytorch_model.bin.index.json out/ --max-shard-size 5GB
  shardkit convert fsdp-checkpoint/ out/ --max-shard-size 5GB     # torch.distributed.checkpoint folder
  shardkit convert model.ckpt out/ --exclude 'model_ema.*' --rename first_stage_model.=vae.
  shardkit convert my-sd-pipeline/ out/ --max-shard-size 2GB       # every component of a pipeline
  shardkit convert v1-5-pruned.safetensors unet/ --to diffusers --config sd15-pipeline/
  shardkit convert flux1-dev.safetensors transformer/ --to diffusers --config flux-transformer/config.json
  shardkit convert sd_xl_base_1.0.safetensors sdxl/ --to diffusers --config sdxl-configs/ --component all
  shardkit convert hf://org/old-model out/ --max-shard-size 5GB            # a Hub repo, via the HF cache
  shardkit convert hf://org/model out/ --include 'text_model.*' --no-cache  # streamed, only what is kept
  shardkit convert hf://org/sd/v1-5.safetensors unet/ --to diffusers --config sd15-pipeline/
  shardkit convert sdxl-pipeline/ sdxl.safetensors --to single-file --component all   # for ComfyUI/A1111
  shardkit convert flux-dev/transformer flux1-dev.safetensors --to single-file --dtype bf16
  shardkit convert llama-q4_k_m.gguf llama-hf/ --dtype bf16          # GGUF → transformers folder
  shardkit convert llama-hf/ llama-q8_0.gguf --to gguf --quantize q8_0   # → llama.cpp / transformers GGUF
  shardkit convert flux-dev/transformer flux1-dev-Q8_0.gguf --to gguf --quantize q8_0   # ComfyUI-GGUF
  shardkit convert llama-hf/ llama-merged/ --lora my-adapter/ --dtype bf16   # a PEFT LoRA merged in
  shardkit convert ckpt/ out/ --dtype bf16 --write-plan plan.json   # then: shardkit run plan.json
  shardkit convert ckpt/ out/ --dtype bf16 --resume                 # killed? run it again: continues
  shardkit convert llama-hf/ llama-q8_0.gguf --to gguf --quantize q8_0 --resume   # a GGUF too (per file)

\b
SOURCE kinds: .safetensors file, index or folder; .bin/.pt/.pth/.ckpt pickle (loaded with
weights_only: pickled code never runs); pytorch_model.bin.index.json or a folder with it;
a torch.distributed.checkpoint (DCP) folder; a diffusers pipeline folder (model_index.json);
hf://ORG/REPO[@REVISION][/SUBFOLDER or /FILE], downloaded through the Hugging Face cache (pickle
weights only where the folder has no safetensors), or with --no-cache (safetensors only) streamed
by range reads into the output, fetching only the tensors kept.

\b
Key options, applied in this order:
  --include/--exclude GLOB   match the names as stored in the source (after --key)
  --strip-prefix P           keep only names starting with P, and remove P
  --rename OLD=NEW           a name starting with OLD gets NEW instead (first match wins)
  --add-prefix P             prepend P
A prefix or rename that matches nothing, filters that leave nothing, or two tensors renamed
to one name are errors. --key picks a nested state dict ('state_dict', 'model', 'a/b'); by
default a top-level state_dict/model/module dict is picked (Lightning, SD .ckpt, FSDP).
Values in the state dict that are not tensors are an error naming them.

\b
--to diffusers converts a single-file SD/SDXL/SD3/Flux... checkpoint (original key names) into a
diffusers model folder (config.json + diffusion_pytorch_model shards) that from_pretrained loads,
with diffusers' own from_single_file key mapping. It needs the model's diffusers config locally,
--config takes a config.json, a model folder, or a pipeline folder (model_index.json) whose
--component (default: unet or transformer) is written, local or hf://ORG/REPO[/SUBFOLDER] (its
configs, tokenizers and schedulers are downloaded through the HF cache, never its weights); --component all
writes the whole pipeline (CLIP/T5 text encoders converted by diffusers too, tokenizers and
schedulers copied from --config). The key options do not apply; --key picks a pickle's state dict.
A ComfyUI scaled-fp8 file gets its scales applied before diffusers' mapping (bf16 unless --dtype).

\b
fp8 checkpoints with scales (FineGrainedFP8, compressed-tensors, ComfyUI scaled fp8) are copied
whole without --dtype and dequantized with --dtype bf16/fp16/fp32; --quantize fp8-block,
fp8-channel or fp8-tensor writes them (see `shardkit split --help`).

\b
--to single-file is the way back: SOURCE is a diffusers model folder (UNet, VAE, SD3 or Flux.1
transformer) or a pipeline folder (--component NAME, or all: SD 1.x/2.x/SDXL UNet + VAE + text
encoders in one checkpoint, model.diffusion_model.* / first_stage_model.* / cond_stage_model.* or
conditioner.embedders.N.*), written in the original layout with diffusers' own mapping run
backwards (Flux q/k/v and linear1 fused back). --variant picks the source's weight variant; OUTPUT
is a .safetensors file (or a folder for shards with an index). Other model types are refused.

\b
GGUF (llama.cpp, ComfyUI-GGUF) as SOURCE (a split one from its first part): Llama, Qwen2/3 and BERT files get
Hugging Face names (Llama's q/k rows unpermuted), config.json and the tokenizer files rebuilt from the metadata;
Flux files keep their BFL names (--to diffusers --config for a
diffusers folder). Quantized ggml tensors (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K) need --dtype
(bf16, fp16, or fp32 for gguf's exact dequantized values). --to gguf writes OUTPUT.gguf from a
transformers Llama, Mistral, Qwen2, Qwen3, Qwen2/3-MoE, Mixtral, gpt-oss (MXFP4 experts kept MXFP4), Gemma 2/3,
Phi-3, BERT or nomic-bert folder (as llama.cpp's convert_hf_to_gguf.py writes it, tokenizer.json's vocabulary included), a
diffusers Flux transformer (or pipeline) folder, a BFL Flux file or a GGUF; --quantize f32/f16/bf16/q8_0/q4_0/q4_1/q5_0/q5_1 sets the type of 2-D tensors (1-D
ones, norms and biases stay F32); without it types are kept. --max-shard-size writes llama.cpp's gguf-split
files (OUTPUT-00001-of-0000N.gguf).

\b
--lora ADAPTER (repeatable) merges a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors),
or a diffusers/kohya LoRA .safetensors file (SD, SDXL, Flux) into a UNet or transformer folder (or a pipeline
folder's, or an original Flux.1 file), local, s3:// or hf://, into SOURCE as it streams (with --to gguf
too): W + scale * (B @ A) in float32 from each band of rows, written in the output
dtype (--dtype, or the base's own), scale = lora_alpha / r (rsLoRA: / sqrt(r); rank_pattern and
alpha_pattern honoured) times --lora-scale; modules_to_save tensors replace the base's. Adapters whose
shapes, ranks or targets do not fit the base are refused before anything is written.

\b
Sizes: KB/MB/GB are powers of 10 (5GB = 5,000,000,000 bytes), KiB/MiB/GiB powers of 2.
"""


@click.command(epilog=EPILOG, short_help="Convert pickles, DCP or single-file SD into safetensors shards.")
@click.argument("source", type=click.Path(path_type=str))
@click.argument("output", type=click.Path(path_type=str))
@shard_options("max-shard-size", "dtype", "allow-lossy", "quantize")
@click.option("--key", help="The nested dict holding the state dict, e.g. 'state_dict' (default: auto).")
@click.option("--strip-prefix", help="Keep only tensors whose name starts with this, and remove it.")
@click.option("--add-prefix", help="Prepend this to every tensor name.")
@click.option("--include", multiple=True, metavar="GLOB",
              help="Keep only tensors whose name (as stored in SOURCE) matches (repeatable).")
@click.option("--exclude", multiple=True, metavar="GLOB",
              help="Drop tensors whose name (as stored in SOURCE) matches (repeatable).")
@click.option("--rename", multiple=True, metavar="OLD=NEW", help="Replace a leading OLD with NEW (repeatable).")
@click.option("--to", "to", type=click.Choice(get_args(ConvertTo)),
              help="diffusers: a single-file SD/SDXL/SD3/Flux checkpoint → a diffusers model folder; single-file: "
                   "the reverse (a diffusers model or pipeline folder → one original-layout checkpoint); gguf: a "
                   "language model (Llama, Mistral, Qwen2, Qwen3, BERT) or Flux model → one .gguf file.")
@click.option("--config", "config", type=click.Path(path_type=str), metavar="PATH",
              help="With --to diffusers: a config.json, a model folder or a pipeline folder, local or hf:// "
                   "(required).")
@click.option("--component", metavar="NAME",
              help="With --to diffusers and a pipeline --config, or --to single-file and a pipeline SOURCE: the "
                   "component to write (default: unet/transformer; 'all': the whole pipeline).")
@click.option("--lora", "lora", multiple=True, type=click.Path(path_type=str), metavar="ADAPTER",
              help="A PEFT LoRA folder, or a diffusers/kohya LoRA file, to merge into SOURCE's weights "
                   "(repeatable: merged in order).")
@click.option("--lora-scale", type=float, default=1.0, show_default=True,
              help="Multiplies each adapter's own scale (lora_alpha / r).")
@shard_options("name", "variant", "overwrite", "manifest", "dry-run", "json", "quiet")
@plan_options
@no_cache_option
@hub_token_option
def convert(source: str, output: str, key: str | None, strip_prefix: str | None, add_prefix: str | None,
            include: tuple[str, ...], exclude: tuple[str, ...], rename: tuple[str, ...], to: ConvertTo | None,
            config: str | None, component: str | None, as_json: bool, quiet: bool, no_cache: bool = False,
            token: str | None = None, lora: tuple[str, ...] = (), lora_scale: float = 1.0, plan_file: str | None = None,
            resume: bool = False, **write: Any) -> None:
    """Convert SOURCE (any supported checkpoint) into safetensors shards in the OUTPUT folder.

    Streams in bounded memory with the same atomic writer as `split`: on failure or Ctrl-C
    nothing partial is left, and the source is never modified.
    """
    from ..api.checkpoints import convert as convert_api
    from ..api.jobs import is_rank_zero, torchrun_group
    from ..api.options import WriteOptions
    from .split import print_plan

    if plan_file is not None or resume:  # the job as a plan (shardkit run), or run as one that resumes
        if to not in (None, "gguf") or config or component or no_cache:
            raise click.UsageError("--write-plan/--resume plan a convert into a folder, an s3:// prefix or (--to gguf) "
                                   "a .gguf file: drop --to diffusers/single-file, --config, --component and --no-cache")
        run_as_plan("convert", source, output, plan_file=plan_file, resume=resume, as_json=as_json, quiet=quiet,
                    options=WriteOptions(**write), key=key, include=include, exclude=exclude, strip_prefix=strip_prefix,
                    add_prefix=add_prefix, rename=rename, lora=lora, lora_scale=lora_scale,
                    to="gguf" if to == "gguf" else None)
        return
    with torchrun_group() as collective:  # under torchrun: every rank writes its share of the shards
        quiet, as_json = quiet or not is_rank_zero(), as_json and is_rank_zero()  # rank 0 reports for all
        with byte_progress("convert", enabled=not (quiet or as_json or write["dry_run"])) as progress:
            result = convert_api(source, output, options=WriteOptions(**write, progress=progress), key=key,
                                 include=include, exclude=exclude, strip_prefix=strip_prefix, add_prefix=add_prefix,
                                 rename=rename, to=to, config=config, component=component, token=token,
                                 cache=not no_cache, collective=collective, lora=lora, lora_scale=lora_scale)
    if as_json:
        echo_json(result.to_dict())
    elif not quiet:
        print_plan(result)
        parts = [result, *getattr(result, "components", {}).values()]  # a pipeline: its unet/transformer merged
        for merged in (a for part in parts for a in (getattr(part, "lora", None) or {}).get("adapters", ())):
            click.echo(f"merged {merged['adapter']}: {merged['pairs']} LoRA weight(s), {merged['replaced']} replaced "
                       f"whole (r={merged['r']}, lora_alpha={merged['lora_alpha']}, scale x{merged['scale']:g})")
        dropped = getattr(result, "dropped", 0)
        if dropped:
            why = "that are not part of this model (other components, EMA...)" if to else "by the key options"
            click.echo(f"left out {dropped} source tensor(s) {why}")


COMMANDS = [convert]
