"""``shardkit plan``: where a model's modules would go, before loading a byte."""

from __future__ import annotations

from typing import Any

import click

from ..units import format_size
from .common import echo_json, hub_token_option
from .fit import COMPUTE_DTYPE, budget_options, output_options

EPILOG = """\b
Examples:
  shardkit plan --model diffusers:FluxTransformer2DModel --config flux/config.json \\
      --max-memory 0=16GB,1=16GB,cpu=64GB --dtype bf16
  shardkit plan out/ --model diffusers:UNet2DConditionModel --max-memory 0=8GB,cpu=16GB --json
  shardkit plan flux/transformer --model diffusers:FluxTransformer2DModel --gpu 16GB --cpu 64GB --strategies

\b
The model is built on the meta device: no weights and no GPU are needed, and the budget may
name GPUs this machine does not have. --gpu/--cpu and --max-memory are two spellings of one
budget (--gpu 16GB --gpu 16GB --cpu 64GB is --max-memory 0=16GB,1=16GB,cpu=64GB); they may be
mixed, but not give one device two sizes. --dtype takes bf16, fp16 or fp32 (the lossless subset
of split/convert's --dtype). With CHECKPOINT, dtypes and sizes come from its headers
and its keys are checked against the model; without it, from --dtype (else the class default).
--config defaults to CHECKPOINT/config.json. Sizes: GB = 10^9 bytes, GiB = 2^30 bytes.
--device-map strategies are accelerate's: auto and balanced spread evenly over the GPUs,
balanced_low_0 keeps GPU 0 light, sequential fills GPU 0 first; what does not fit goes to
CPU, then disk.
"""


@click.command(epilog=EPILOG, short_help="Show where a model's modules go for a memory budget (device map).")
@click.argument("checkpoint", required=False, type=click.Path(path_type=str))
@click.option("--model", "model_spec", required=True,
              help="Model class: diffusers:ClassName, transformers:ClassName or package.module:Name.")
@click.option("--config", "config_path", type=click.Path(path_type=str),
              help="config.json (or its folder); default CHECKPOINT/config.json.")
@budget_options
@click.option("--dtype", type=COMPUTE_DTYPE, help="Load dtype (default: the checkpoint's, else the class default).")
@click.option("--device-map", "device_map", default="auto", show_default=True,
              type=click.Choice(["auto", "balanced", "balanced_low_0", "sequential"]), help="Placement strategy.")
@click.option("--no-strict", "no_strict", is_flag=True,
              help="Plan even if CHECKPOINT's tensors do not match the model (missing, unexpected or mis-shaped "
                   "keys are listed in a warning); the default refuses them.")
@click.option("--strategies", is_flag=True,
              help="Also estimate the peak GPU memory of each offload strategy (against the largest GPU budget).")
@hub_token_option
@output_options
def plan(checkpoint: str | None, model_spec: str, config_path: str | None, gpus: tuple[int, ...], cpu: int | None,
         max_memory: str | None, dtype: str | None, device_map: str, strategies: bool, as_json: bool,
         quiet: bool, token: str | None = None, no_strict: bool = False) -> None:
    """Show the device map MODEL would get for a memory budget, optionally for CHECKPOINT's weights."""
    from ..api.planning import plan_model

    result = plan_model(model_spec, checkpoint, config=config_path, max_memory=max_memory, gpu_bytes=gpus,
                        cpu_bytes=cpu, dtype=dtype, device_map=device_map, strict=not no_strict,
                        strategies=strategies, token=token)
    lines: list[str] = []
    if result.placement is not None:
        lines.append(_placement_line(result.placement) if quiet else result.placement.table())
    if result.strategies is not None:
        lines.append(_strategy_line(result.strategies) if quiet else result.strategies.table())
    if as_json:
        echo_json(result.to_dict())
    elif any(lines):
        click.echo(("\n" if quiet else "\n\n").join(line for line in lines if line))


def _placement_line(result: Any) -> str:
    """The quiet summary of a device map: bytes placed per device."""
    from ..api.planning import device_label

    return ", ".join(f"{device_label(d)} {format_size(result.device_bytes.get(d, 0))}" for d in result.devices())


def _strategy_line(estimate: Any) -> str:
    """The quiet summary of --strategies: the fastest strategy that fits, if a GPU budget was given."""
    if estimate.gpu_bytes is None:
        return ""
    fitting = estimate.fitting()
    return f"fastest that fits: {fitting[0].spec.name}" if fitting else "no strategy fits"


COMMANDS = [plan]
