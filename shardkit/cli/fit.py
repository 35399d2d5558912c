"""``shardkit fit``: rank inference setups for a memory budget, without loading weights."""

from __future__ import annotations

import click

from ..units import format_size
from .common import SIZE, echo_json

EPILOG = """\b
Examples:
  shardkit fit sdxl-sharded/ --gpu 8GB --cpu 24GB
  shardkit fit flux-sharded/ --gpu 16GB --gpu 16GB --json
  shardkit fit sdxl-sharded/unet --gpu 6GB --height 768 --width 768 --batch-size 2

\b
Speed is relative to everything on one GPU (1.00x); classes come from the diffusers memory
guides. A setup fits when its estimated peak stays under each budget minus the safety margin
(10% of the budget, plus 512 MiB per GPU for the CUDA context and workspaces).
Sizes: KB/MB/GB are powers of 10, KiB/MiB/GiB powers of 2.
Exit codes: 0 a setup fits, 2 bad input or no setup fits (the error names the smallest budget).
"""


@click.command(epilog=EPILOG)
@click.argument("folder", type=click.Path(path_type=str))
@click.option("--gpu", "gpus", type=SIZE, multiple=True, help="Memory of one GPU; repeat for several GPUs.")
@click.option("--cpu", type=SIZE, help="CPU RAM available for offloaded weights (default: not limited).")
@click.option("--height", type=click.IntRange(min=8), help="Image height (default: the pipeline's).")
@click.option("--width", type=click.IntRange(min=8), help="Image width (default: the pipeline's).")
@click.option("--batch-size", type=click.IntRange(min=1), default=1, show_default=True, help="Images per call.")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), help="Compute dtype (default: the checkpoint's).")
@click.option("--attention", type=click.Choice(["sdpa", "eager"]), default="sdpa", show_default=True,
              help="Attention kernel: sdpa never materialises scores; eager does.")
@click.option("--no-fp8", is_flag=True, help="Never propose fp8 layerwise casting (lossy).")
@click.option("--exclude", multiple=True, help="Drop setups by name prefix (group, sequential, staged...).")
@click.option("--reserve", type=SIZE, default="512MiB", show_default=True,
              help="Memory kept free on each GPU on top of the 10% margin (CUDA context, workspaces).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan and the ranking as JSON.")
def fit(folder: str, gpus: tuple[int, ...], cpu: int | None, height: int | None, width: int | None,
        batch_size: int, dtype: str | None, attention: str, no_fp8: bool, exclude: tuple[str, ...],
        reserve: int, as_json: bool) -> None:
    """Rank inference setups for the pipeline or component in FOLDER and pick the fastest that fits.

    Reads only safetensors headers and config files (no weights). Candidates: everything on one
    GPU, components balanced across GPUs, a staged split of the denoiser over GPUs, model offload,
    group offload (block/leaf, with or without CUDA streams), sequential offload, each with or
    without fp8 layerwise casting, plus VAE tiling/slicing and attention slicing where the
    components support them.
    """
    from ..fitting.autofit import DEFAULT_MARGIN, Margin
    from ..fitting.autofit import fit as fit_api

    margin = Margin(DEFAULT_MARGIN.fraction, reserve)
    plan = fit_api(folder, gpu=list(gpus), cpu=cpu, height=height, width=width, batch_size=batch_size,
                   dtype=dtype, attention=attention, allow_fp8=not no_fp8, exclude=exclude, margin=margin)
    if as_json:
        echo_json(plan.to_dict())
        return
    print_ranking(plan)
    click.echo("")
    click.echo(str(plan))


def print_ranking(plan: object) -> None:
    rows = plan.candidates  # type: ignore[attr-defined]
    devices = sorted({d for c in rows for d in c.peak_by_device() if d != "cpu"}) + ["cpu"]
    header = ["", "setup", "speed", *devices, "fits"]
    table = []
    for c in rows:
        peaks = c.peak_by_device()
        mark = "->" if c is plan.chosen else ""  # type: ignore[attr-defined]
        cells = [format_size(peaks[d]) if d in peaks and (d == "cpu" or c.peaks.gpu) else "-" for d in devices]
        table.append([mark, c.label, f"{c.slowdown:.2f}x {_short(c)}", *cells, "yes" if c.fits else "no"])
    widths = [max(len(str(r[i])) for r in [header, *table]) for i in range(len(header))]
    for row in [header, *table]:
        click.echo("  ".join(str(cell).ljust(w) if i < 3 else str(cell).rjust(w)
                             for i, (cell, w) in enumerate(zip(row, widths))).rstrip())


def _short(candidate: object) -> str:
    from ..fitting.candidates import speed_class

    return f"({speed_class(candidate.slowdown)})"  # type: ignore[attr-defined]


COMMANDS = [fit]
