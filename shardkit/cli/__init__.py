"""The ``shardkit`` command line: thin click commands over the library API.

Each ``shardkit/cli/<name>.py`` defines ``COMMANDS`` (a list of click commands); they are found
and registered here, so adding a command never touches this file.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import click

from .common import run_cli, silence_stdout

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@click.group(context_settings=CONTEXT)
@click.version_option(package_name="shardkit")
@click.option("--debug", is_flag=True, help="Show full tracebacks and shardkit's debug log (anywhere on the line).")
@click.option("--progress", is_flag=True, help="Show progress bars even when stderr is not a terminal.")
@click.pass_context
def cli(ctx: click.Context, debug: bool, progress: bool) -> None:
    """Split, convert, verify, push and plan large model checkpoints.

    \b
    Examples:
      shardkit split model.safetensors out/ --max-shard-size 5GB
      shardkit split pytorch_model.bin out/ --max-shard-size 2GiB --dtype bf16
      shardkit split ckpt-dir/ resharded/ --max-shard-size 500MB --dry-run
      shardkit convert v1-5-pruned.ckpt unet/ --strip-prefix model.diffusion_model. --dtype fp16
      shardkit info out/ && shardkit verify out/ --against model.safetensors
      shardkit push out/ my-org/model --private
      shardkit plan out/ --model diffusers:UNet2DConditionModel --config out/config.json --max-memory 0=8GB,cpu=16GB
      shardkit fit sdxl-sharded/ --gpu 8GB --cpu 24GB

    Run 'shardkit COMMAND --help' for each command's options and examples.

    Sizes: KB/MB/GB are powers of 10 (5GB = 5,000,000,000 bytes), KiB/MiB/GiB powers of 2.
    Exit codes: 0 ok, 1 a check failed, 2 bad input or usage.
    """
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug
    ctx.obj["progress"] = progress


def _register() -> None:
    for info in pkgutil.iter_modules(__path__):
        if info.name == "common":
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for command in getattr(module, "COMMANDS", []):
            cli.add_command(command)


_register()


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    code = run_cli(cli, argv)
    try:
        sys.stdout.flush()
    except BrokenPipeError:  # the reader of a pipe left before the last buffered line
        silence_stdout()
    sys.exit(code)
