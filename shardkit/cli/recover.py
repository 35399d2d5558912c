"""``shardkit recover``."""

from __future__ import annotations

import click

from ..api.records import Recovery
from ..api.sources import is_remote
from ..units import format_size
from .common import StrParamType, echo_json

EPILOG = """\b
Examples:
  shardkit recover out/
  shardkit recover unet-sharded/ vae-sharded/ --json
  shardkit recover s3://models/llama   # abort the uploads of killed writes, delete their unpublished shards

Any shardkit command that reads or writes a folder does this by itself first; this command is
for read-only tools (or a read-only mount) that found a folder mid-commit.
"""


class FolderOrStore(StrParamType):
    """An existing local folder, or a remote location such as ``s3://BUCKET/PREFIX`` (``recover`` says which it cleans)."""

    name = "folder"

    def convert(self, value: str, param: click.Parameter | None, ctx: click.Context | None) -> str:
        if is_remote(value):
            return value
        path: str = click.Path(exists=True, file_okay=False, path_type=str).convert(value, param, ctx)
        return path


@click.command(epilog=EPILOG, short_help="Finish interrupted writes and remove stale temporary files.")
@click.argument("folders", nargs=-1, required=True, type=FolderOrStore())
@click.option("--json", "as_json", is_flag=True, help="Print what was rolled forward and removed, as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="Print nothing; the exit code tells.")
def recover(folders: tuple[str, ...], as_json: bool, quiet: bool) -> None:
    """Finish writes that were interrupted after their commit point; remove stale temporary files.

    A crash while replacing a checkpoint in place (split/convert/merge with --overwrite) can stop
    after the new shards were made durable but before every rename happened. The journal left
    behind names every step; this rolls it forward. Temporary files and staging folders of dead
    shardkit processes are removed. A folder another shardkit process is writing is left alone.
    """
    from ..api.maintenance import recover as recover_api

    reports = [recover_api(folder) for folder in folders]
    if as_json:
        echo_json([r.to_dict() for r in reports])
    elif not quiet:
        for report in reports:
            print_recovery(report)


def print_recovery(report: Recovery) -> None:
    folder = report.folder
    if report.rolled_forward:
        click.echo(f"{folder}: finished an interrupted commit ({len(report.rolled_forward)} file(s) published)")
    if report.removed:  # a store's leftovers have no byte count: uploads aborted, objects deleted
        size = "" if is_remote(folder) else f", {format_size(report.removed_bytes)}"
        what = "leftover(s)" if is_remote(folder) else "temporary file(s)"
        click.echo(f"{folder}: removed {len(report.removed)} {what} of dead writers{size}")
        for path in report.removed:
            click.echo(f"  {path}")
    click.echo(f"{folder}: consistent" + ("" if report.changed else " (nothing to do)"))


COMMANDS = [recover]
