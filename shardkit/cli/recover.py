"""``shardkit recover``."""

from __future__ import annotations

import click

from ..errors import OutputExistsError

EPILOG = """\b
Examples:
  shardkit recover out/
  shardkit recover unet-sharded/ vae-sharded/

Any shardkit command that reads or writes a folder does this by itself first; this command is
for read-only tools (or a read-only mount) that found a folder mid-commit.
"""


@click.command(epilog=EPILOG)
@click.argument("folders", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False, path_type=str))
def recover(folders: tuple[str, ...]) -> None:
    """Finish writes that were interrupted after their commit point; remove stale temporary files.

    A crash while replacing a checkpoint in place (split/convert/merge with --overwrite) can stop
    after the new shards were made durable but before every rename happened. The journal left
    behind names every step; this rolls it forward. Temporary files and staging folders of dead
    shardkit processes are removed. A folder another shardkit process is writing is left alone.
    """
    from ..atomic.commit import recover as recover_folder

    for folder in folders:
        if not recover_folder(folder):
            raise OutputExistsError(f"{folder} is being written by another shardkit process; try again when it ends")
        click.echo(f"{folder}: consistent")


COMMANDS = [recover]
