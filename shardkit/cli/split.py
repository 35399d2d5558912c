"""``shardkit split``."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import click

from ..api.store_writes import shown_path
from ..units import format_size
from .common import byte_progress, echo_json, hub_token_option, no_cache_option, shard_options
from .run import plan_options, run_as_plan

if TYPE_CHECKING:
    from ..api.checkpoints import SplitResult

EPILOG = """\b
Examples:
  shardkit split sdxl-unet.safetensors out/ --max-shard-size 5GB
  shardkit split pytorch_model.bin out/ --max-shard-size 2GiB --dtype bf16
  shardkit split ckpt-dir/ resharded/ --max-shard-size 500MB --dry-run
  shardkit split ckpt-dir/ ckpt-dir/ --max-shard-size 2GB --overwrite   # reshard in place
  shardkit split ckpt-dir/ out/ --max-shard-size 5GB --write-plan plan.json   # then: shardkit run plan.json
  shardkit split hf://org/model out/ --max-shard-size 2GB --no-cache    # stream a Hub repo, no cache copy
  shardkit split hf://org/model out/ --max-shard-size 2GB --push-to org/model --create-pr

\b
Sizes: KB/MB/GB/TB are powers of 10 (5GB = 5,000,000,000 bytes, like huggingface_hub);
KiB/MiB/GiB/TiB are powers of 2 (2GiB = 2,147,483,648 bytes, like accelerate).
The limit counts tensor bytes; a tensor larger than it gets a shard of its own.
Output naming follows the source (diffusers 'diffusion_pytorch_model' or transformers
'model'); --name overrides. One shard gets no suffix and no index.
Tied tensors of in-memory sources are written once; aliases go into the shard metadata.
A folder's other files and subfolders (configs, tokenizer, README.md, .gitattributes,
sentence-transformers' 1_Pooling/...) are copied to the same paths in OUTPUT (listed in the
summary and --json); .git and .cache are not. A symlink leading out of the folder, a symlinked
folder or a special file is refused.

\b
fp8 checkpoints with scales (transformers FineGrainedFP8 weight_scale_inv, compressed-tensors
weight_scale, ComfyUI scaled_fp8 scale_weight or _quantization_metadata): without --dtype they
are copied whole (fp8 weights, scales in their own dtype, config kept); --dtype bf16/fp16/fp32
dequantizes them (weight x scale, band by band; scales, input scales, markers and
quantization_config dropped). A missing or mis-shaped scale, a scale without its weight or fused
per-tensor scales that disagree exit 2 naming the tensors. --quantize fp8-block (128x128,
transformers FineGrainedFP8), fp8-channel or fp8-tensor (compressed-tensors) writes fp8 weights
with absmax scales and the quantization_config; norms, embeddings, biases, lm_head and
modulation layers stay unquantized, in bf16 when the source stores them in fp32 (--dtype fp32
keeps them fp32); --json gives each tensor's quantization error. A plain --dtype fp8_e4m3
cast writes fp8 without scales, which transformers and diffusers do not load (a warning says so).

\b
hf://ORG/REPO[@REVISION][/SUBFOLDER] sources are downloaded through the Hugging Face cache
(a later from_pretrained reuses them), or with --no-cache streamed by range reads straight into
the shards: each byte fetched once, memory bounded, every file read whole checked against the
Hub's sha256 before anything is published. Pickle weights are never downloaded by split.
"""


@click.command(epilog=EPILOG, short_help="Stream a checkpoint into size-bounded safetensors shards.")
@click.argument("source", type=click.Path(path_type=str))
@click.argument("output", type=click.Path(path_type=str))
@shard_options("max-shard-size", "dtype", "allow-lossy", "quantize", "name", "variant")
@click.option("--key", help="For pickles: the dict key holding the state dict (default: auto).")
@shard_options("dry-run", "overwrite", "manifest", "json", "quiet")
@click.option("--push-to", "push_to", metavar="REPO_ID",
              help="After the split, push OUTPUT to this Hub repository (see `shardkit push`).")
@click.option("--create-pr", is_flag=True, help="With --push-to: open a pull request instead of committing to main.")
@plan_options
@no_cache_option
@hub_token_option
def split(source: str, output: str, key: str | None, as_json: bool, quiet: bool, push_to: str | None = None,
          create_pr: bool = False, no_cache: bool = False, token: str | None = None, plan_file: str | None = None,
          resume: bool = False, **write: Any) -> None:
    """Stream SOURCE into size-bounded safetensors shards in the OUTPUT folder.

    SOURCE is a .safetensors file, a sharded folder or its index, a .bin/.pt/.pth/.ckpt pickle
    (loaded with weights_only, never executing code), or a Hub repository hf://ORG/REPO. The
    output loads unchanged with diffusers, transformers, accelerate and huggingface_hub. Writes are atomic: on failure or
    Ctrl-C nothing partial is left, and the source is never modified.
    """
    from ..api.checkpoints import split_and_push
    from ..api.options import WriteOptions
    from .push import report_push

    if plan_file is not None or resume:  # the job as a plan (shardkit run), or run as one that resumes
        if push_to or no_cache:
            raise click.UsageError("--write-plan/--resume plan a local split into a folder: drop --push-to and --no-cache")
        run_as_plan("split", source, output, plan_file=plan_file, resume=resume, as_json=as_json, quiet=quiet,
                    options=WriteOptions(**write), key=key)
        return
    dry_run = write["dry_run"]
    check_create_pr(create_pr=create_pr, push_to=push_to)
    report = "none" if as_json else "url" if quiet else "summary"
    with contextlib.ExitStack() as split_bar, byte_progress("push", enabled=report == "summary") as push_progress:
        progress = split_bar.enter_context(byte_progress("split", enabled=not (quiet or as_json or dry_run)))

        def after_split(result: SplitResult) -> None:
            split_bar.close()  # the split's bar ends before its plan prints
            if not (as_json or quiet):
                print_plan(result)

        done = split_and_push(source, output, push_to, options=WriteOptions(**write, progress=progress), key=key,
                              token=token, cache=not no_cache, create_pr=create_pr, push_progress=push_progress,
                              after_split=after_split)
    if done.push is not None:
        report_push(done.push, report=report)
    if as_json:
        echo_json(done.to_dict())


def check_create_pr(*, create_pr: bool, push_to: str | None) -> None:
    """--create-pr needs --push-to."""
    from ..errors import InvalidInputError

    if create_pr and not push_to:
        raise InvalidInputError("--create-pr applies with --push-to REPO_ID; add it, or drop --create-pr")


def print_plan(result: SplitResult) -> None:
    plan = result.plan
    verb = "would write" if result.dry_run else "wrote"
    width = max(len(s.filename) for s in plan.shards)
    for shard in plan.shards:
        click.echo(f"  {shard.filename:<{width}}  {len(shard.names):>6} tensors  {format_size(shard.nbytes):>10}")
    if plan.index_filename:
        click.echo(f"  {plan.index_filename}")
    if len(plan.shards) == 1 and not plan.index_filename and not getattr(result, "components", None):
        click.echo(f"{verb} 1 file, {format_size(plan.total_bytes)}: "  # name the file, not its folder
                   f"{shown_path(result.files[0])}")
    else:
        click.echo(f"{verb} {len(plan.shards)} shard(s), {format_size(plan.total_bytes)} to "
                   f"{shown_path(result.output)}")
    if not result.dry_run:
        click.echo(f"cloned {format_size(result.cloned_bytes)}, "
                   f"copied {format_size(result.copied_bytes)}")
    if result.copied:
        click.echo(copied_line(result.copied, dry_run=result.dry_run))
    if result.quantization:
        click.echo(quantization_line(result.quantization))


def copied_line(copied: list[str], *, dry_run: bool, shown: int = 8) -> str:
    """One line naming the other files copied beside the weights (all of them are in --json).

    >>> copied_line(["config.json", "1_Pooling/config.json"], dry_run=False)
    'copied 2 other file(s): config.json, 1_Pooling/config.json'
    """
    names = ", ".join(copied[:shown]) + (f" and {len(copied) - shown} more (--json lists all)" if len(copied) > shown else "")
    return f"{'would copy' if dry_run else 'copied'} {len(copied)} other file(s): {names}"


def quantization_line(quant: dict[str, Any]) -> str:
    """One line on what a write did with fp8 scales (see :func:`shardkit.sharding.quant.quant_report`)."""
    if "dequantized" in quant:
        return f"dequantized {quant['weights']} weight(s) from {quant['dequantized']} to {quant['dtype']}"
    errors = [e["relative_error"] for e in quant["errors"].values()]
    worst = f", largest relative error {max(errors):.4f}" if errors else ""
    kept = quant.get("kept_dtype")
    how = "as they were" if not kept else (
        f"in {kept} (stored wider; the compute dtype: --dtype fp32 keeps them fp32)" if quant.get("kept_dtype_chosen")
        else f"in {kept} (--dtype)")
    return f"quantized {quant['quantized']} weight(s) to {quant['scheme']}, kept {len(quant['kept'])} module(s) {how}{worst}"


COMMANDS = [split]
