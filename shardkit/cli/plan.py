"""``shardkit plan``: where a model's modules would go, before loading a byte."""

from __future__ import annotations

import os

import click

from ..errors import InvalidInputError
from .common import SIZE, echo_json

EPILOG = """\b
Examples:
  shardkit plan --model diffusers:FluxTransformer2DModel --config flux/config.json \\
      --max-memory 0=16GB,1=16GB,cpu=64GB --dtype bf16
  shardkit plan out/ --model diffusers:UNet2DConditionModel --max-memory 0=8GB,cpu=16GB --json
  shardkit plan flux/transformer --model diffusers:FluxTransformer2DModel --gpu 16GB --strategies

\b
The model is built on the meta device: no weights and no GPU are needed, and --max-memory may
name GPUs this machine does not have. With CHECKPOINT, dtypes and sizes come from its headers
and its keys are checked against the model; without it, from --dtype (else the class default).
--config defaults to CHECKPOINT/config.json. Sizes: GB = 10^9 bytes, GiB = 2^30 bytes.
--device-map strategies are accelerate's: auto and balanced spread evenly over the GPUs,
balanced_low_0 keeps GPU 0 light, sequential fills GPU 0 first; what does not fit goes to
CPU, then disk.
"""


@click.command(epilog=EPILOG)
@click.argument("checkpoint", required=False, type=click.Path(path_type=str))
@click.option("--model", "model_spec", required=True,
              help="Model class: diffusers:ClassName, transformers:ClassName or package.module:Name.")
@click.option("--config", "config_path", type=click.Path(path_type=str),
              help="config.json (or its folder); default CHECKPOINT/config.json.")
@click.option("--max-memory", "max_memory", help="Per-device budget, e.g. 0=16GB,1=16GB,cpu=64GB.")
@click.option("--dtype", help="Load dtype: bf16, fp16, fp32 (default: the checkpoint's, else the class default).")
@click.option("--device-map", "device_map", default="auto", show_default=True,
              type=click.Choice(["auto", "balanced", "balanced_low_0", "sequential"]), help="Placement strategy.")
@click.option("--strategies", is_flag=True, help="Also estimate the peak GPU memory of each offload strategy.")
@click.option("--gpu", "gpu_bytes", type=SIZE, help="GPU size for --strategies, e.g. 16GB.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def plan(checkpoint: str | None, model_spec: str, config_path: str | None, max_memory: str | None, dtype: str | None,
         device_map: str, strategies: bool, gpu_bytes: int | None, as_json: bool) -> None:
    """Show the device map MODEL would get for --max-memory, optionally for CHECKPOINT's weights."""
    if max_memory is None and not strategies:
        raise InvalidInputError("give --max-memory (e.g. 0=16GB,cpu=64GB), --strategies, or both")
    config = config_path
    if config is None and checkpoint is not None and os.path.isfile(os.path.join(checkpoint, "config.json")):
        config = os.path.join(checkpoint, "config.json")
    output: dict = {}
    if max_memory is not None:
        from ..loading.device_map import parse_max_memory, plan_device_map

        result = plan_device_map(model_spec, config=config, checkpoint=checkpoint, max_memory=parse_max_memory(max_memory),
                                 dtype=dtype, device_map=device_map)
        output.update(result.to_dict())
        if not as_json:
            click.echo(result.table())
    if strategies:
        estimate = _estimate(model_spec, config=config, checkpoint=checkpoint, dtype=dtype, gpu_bytes=gpu_bytes)
        output.setdefault("model", model_spec)
        output["strategies"] = estimate.to_dict()
        if not as_json:
            click.echo(("\n" if max_memory is not None else "") + estimate.table())
    if as_json:
        echo_json(output)


def _estimate(model_spec: str, *, config: str | None, checkpoint: str | None, dtype: str | None,
              gpu_bytes: int | None) -> object:
    from ..fitting.estimate import estimate_memory
    from ..loading.skeleton import build_skeleton

    skeleton = build_skeleton(model_spec, config=config)
    return estimate_memory(skeleton, gpu_bytes=gpu_bytes, dtype=dtype, checkpoint=checkpoint)


COMMANDS = [plan]
