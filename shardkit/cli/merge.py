"""``shardkit merge``."""

from __future__ import annotations

import click

from ..units import format_size
from .common import byte_progress, echo_json

EPILOG = """\b
Examples:
  shardkit merge out/ model.safetensors
  shardkit merge out/model.safetensors.index.json merged.safetensors --overwrite
  shardkit merge my-pipeline/unet/ unet.safetensors
  shardkit merge out/ model.safetensors --dry-run     # check the shards, write nothing
  shardkit merge s3://models/llama/sharded model.safetensors   # tensor bytes by ranged GETs
  shardkit merge out/ s3://models/llama/model.safetensors      # one object, published whole

\b
Tensors keep their order (shard by shard) and the shards' metadata, so merging a split of a
file shardkit wrote gives back that file byte for byte. Bytes are copied kernel-side; the
output appears only when complete.
"""


@click.command(epilog=EPILOG, short_help="Merge a sharded checkpoint into one .safetensors file.")
@click.argument("folder", type=click.Path(path_type=str))
@click.argument("output", type=click.Path(path_type=str))
@click.option("--overwrite", is_flag=True, help="Replace OUTPUT if it exists.")
@click.option("--dry-run", is_flag=True, help="Check the shards and print what would be merged; write nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar and no summary.")
def merge(folder: str, output: str, overwrite: bool, dry_run: bool, as_json: bool, quiet: bool) -> None:
    """Merge the sharded safetensors checkpoint in FOLDER into one OUTPUT .safetensors file."""
    from ..api.maintenance import merge as merge_api

    with byte_progress("merge", enabled=not (quiet or as_json or dry_run)) as progress:
        result = merge_api(folder, output, overwrite=overwrite, dry_run=dry_run, progress=progress)
    if as_json:
        echo_json(result.to_dict())
    elif not quiet:
        verb = "would merge" if result.dry_run else "merged"
        click.echo(f"{verb} {result.shards} shard(s), {result.tensors} tensors, "
                   f"{format_size(result.total_bytes)} into {result.output}")


COMMANDS = [merge]
