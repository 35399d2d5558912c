"""``shardkit fit``: rank inference setups for a memory budget, without loading weights."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from ..errors import ShardkitError
from ..units import COMPUTE_DTYPES as COMPUTE_CODES
from ..units import format_size, short_dtype
from .common import SIZE, Command, StrParamType, echo_json, hub_token_option

if TYPE_CHECKING:
    from ..api.planning import Candidate, FitPlan

EPILOG = """\b
Examples:
  shardkit fit sdxl-sharded/ --gpu 8GB --cpu 24GB
  shardkit fit sdxl-sharded/ --max-memory 0=8GB,cpu=24GB      (the same budget)
  shardkit fit flux-sharded/ --gpu 16GB --gpu 16GB --json
  shardkit fit sdxl-sharded/unet --gpu 6GB --height 768 --width 768 --batch-size 2
  shardkit fit hf://black-forest-labs/FLUX.1-dev --gpu 16GB --gpu 16GB   (headers only)

\b
Speed is relative to everything on one GPU (1.00x); classes come from the diffusers memory
guides. A setup fits when its estimated peak stays under each budget minus the safety margin
(10% of the budget, plus 512 MiB per GPU for the CUDA context and workspaces).
--gpu/--cpu and --max-memory are two spellings of one budget (--gpu number N is GPU N-1); they
may be mixed, but not give one device two sizes.
A component without config.json is guessed from its tensor names and shapes (a warning says how).
Sizes: KB/MB/GB are powers of 10, KiB/MiB/GiB powers of 2.
Exit codes: 0 a setup fits, 2 bad input or no setup fits (the error prints the flags of the
smallest budget that would, ready to paste).
"""

# The compute/load dtypes fit and plan take: the lossless subset of split/convert's --dtype (fp8 is
# storage, not compute: fit proposes fp8 layerwise casting itself, --no-fp8 turns it off).
COMPUTE_DTYPES = tuple(short_dtype(code) for code in COMPUTE_CODES)  # bf16, fp16, fp32
STRATEGY_PREFIXES = ("gpu, balanced, staged, model_offload, group (every group offload), group_block, "
                     "group_block_stream, group_leaf, group_leaf_stream, sequential")


class ComputeDtype(StrParamType):
    """bf16, fp16 or fp32; the long spellings (bfloat16, float16, half, float32, F16...) are accepted."""

    name = "[" + "|".join(COMPUTE_DTYPES) + "]"

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return self.name

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> str:
        from ..units import normalize_dtype

        try:
            code = normalize_dtype(str(value))
        except ShardkitError:
            code = None
        if code is None or code not in COMPUTE_CODES:
            self.fail(f"{value!r} is not a compute dtype: use one of {', '.join(COMPUTE_DTYPES)} "
                      "(fp8 storage is layerwise casting, which fit proposes itself)", param, ctx)
        return short_dtype(code)


COMPUTE_DTYPE = ComputeDtype()


def budget_options(f: Command) -> Command:
    """--gpu (repeatable), --cpu and --max-memory: the two spellings of one budget, as fit and plan share them."""
    for option in reversed([
        click.option("--gpu", "gpus", type=SIZE, multiple=True,
                     help="Memory of one GPU; repeat for several GPUs (the first is GPU 0)."),
        click.option("--cpu", type=SIZE, help="CPU RAM budget (default: not limited)."),
        click.option("--max-memory", "max_memory",
                     help="The budget per device in one flag, e.g. 0=16GB,1=16GB,cpu=64GB (same as --gpu/--cpu)."),
    ]):
        f = option(f)
    return f


def output_options(f: Command) -> Command:
    """--json and -q/--quiet, as fit and plan share them."""
    f = click.option("--quiet", "-q", is_flag=True, help="Print only the result line (warnings still go to stderr).")(f)
    return click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")(f)


@click.command(epilog=EPILOG, short_help="Pick the fastest inference setup that fits your memory budget.")
@click.argument("folder", type=click.Path(path_type=str))
@budget_options
@click.option("--height", type=click.IntRange(min=8), help="Image height (default: the pipeline's).")
@click.option("--width", type=click.IntRange(min=8), help="Image width (default: the pipeline's).")
@click.option("--batch-size", type=click.IntRange(min=1), default=1, show_default=True, help="Images per call.")
@click.option("--dtype", type=COMPUTE_DTYPE, help="Compute dtype (default: the checkpoint's).")
@click.option("--attention", type=click.Choice(["sdpa", "eager"]), default="sdpa", show_default=True,
              help="Attention kernel: sdpa never materialises scores; eager does.")
@click.option("--no-fp8", is_flag=True, help="Never propose fp8 layerwise casting (lossy).")
@click.option("--exclude", multiple=True, metavar="STRATEGY",
              help=f"Drop every setup whose strategy name starts with STRATEGY: {STRATEGY_PREFIXES}; "
                   "or fp8 (no fp8 casting). Repeatable. Not file or tensor names.")
@click.option("--reserve", type=SIZE, default="512MiB", show_default=True,
              help="Memory kept free on each GPU on top of the 10% margin (CUDA context, workspaces).")
@hub_token_option
@output_options
def fit(folder: str, gpus: tuple[int, ...], cpu: int | None, max_memory: str | None, height: int | None,
        width: int | None, batch_size: int, dtype: str | None, attention: str, no_fp8: bool,
        exclude: tuple[str, ...], reserve: int, as_json: bool, quiet: bool, token: str | None = None) -> None:
    """Rank inference setups for the pipeline or component in FOLDER and pick the fastest that fits.

    Reads only safetensors headers and config files (no weights). Candidates: everything on one
    GPU, components balanced across GPUs, a staged split of the denoiser over GPUs, model offload,
    group offload (block/leaf, with or without CUDA streams), sequential offload, each with or
    without fp8 layerwise casting, plus VAE tiling/slicing and attention slicing where the
    components support them.
    """
    from ..api.planning import DEFAULT_MARGIN, Margin
    from ..api.planning import fit as fit_api

    margin = Margin(DEFAULT_MARGIN.fraction, reserve)
    plan = fit_api(folder, gpu=list(gpus), cpu=cpu, max_memory=max_memory, height=height, width=width,
                   batch_size=batch_size, dtype=dtype, attention=attention, allow_fp8=not no_fp8,
                   exclude=exclude, margin=margin, token=token)  # hf://: a header-only mirror
    if as_json:
        echo_json(plan.to_dict())
    elif quiet:
        click.echo(plan.chosen.name)
    else:
        click.echo(f"workload: {plan.workload_line()}")
        print_ranking(plan)
        click.echo("")
        click.echo(str(plan))


def print_ranking(plan: FitPlan) -> None:
    rows = plan.candidates
    devices = sorted({d for c in rows for d in c.peak_by_device() if d != "cpu"}) + ["cpu"]
    header = ["", "setup", "speed", *devices, "fits"]
    table = []
    for c in rows:
        peaks = c.peak_by_device()
        mark = "->" if c is plan.chosen else ""
        cells = [format_size(peaks[d]) if d in peaks and (d == "cpu" or c.peaks.gpu) else "-" for d in devices]
        table.append([mark, c.label, f"{c.slowdown:.2f}x {_short(c)}", *cells, "yes" if c.fits else "no"])
    widths = [max(len(str(r[i])) for r in [header, *table]) for i in range(len(header))]
    for row in [header, *table]:
        click.echo("  ".join(str(cell).ljust(w) if i < 3 else str(cell).rjust(w)
                             for i, (cell, w) in enumerate(zip(row, widths, strict=True))).rstrip())


def _short(candidate: Candidate) -> str:
    from ..api.planning import speed_class

    return f"({speed_class(candidate.slowdown)})"


COMMANDS = [fit]
