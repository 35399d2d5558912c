"""``shardkit push``: publish a verified checkpoint folder to the Hugging Face Hub."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from ..units import format_size
from .common import byte_progress, echo_json, push_options

if TYPE_CHECKING:
    from ..api.jobs import PushResult
    from ..api.options import PushOptions

EPILOG = """\b
Examples:
  shardkit push out/ my-org/sdxl-unet-sharded --private --message "reshard to 5GB"
  shardkit push out/ my-org/sdxl-unet-sharded --revision fp16 --create-pr
  shardkit push unet-out/ my-org/sd15 --path-in-repo unet --dry-run
  shardkit push sd15-pipeline/ my-org/sd15 --include "unet/*" --include "*.json"
  shardkit split model.safetensors out/ --max-shard-size 5GB --push-to my-org/model
  shardkit push s3://models/unet-sharded my-org/unet   # from a bucket: streamed by ranged GETs, no local copy

\b
The folder is verified first and a broken checkpoint is refused (--no-verify skips it).
Files identical to the remote ones (sha256 for LFS files, git blob id for small files) are
not sent again; an unchanged folder makes no commit. A push is one commit (several only
above 100 files, the index always last), so the remote never shows an index whose shards
are missing; an interrupted push, run again, does not resend what already arrived.
Remote shards of the same checkpoint that the folder no longer has are deleted with it.
Token: --token, else HF_TOKEN, else the stored `hf auth login`. Files over 50 GB are refused.
A file that is a symlink leading outside PATH (other than into a Hugging Face cache's blobs/)
is refused before anything is sent: push would upload its target (a token, an SSH key).
--follow-symlinks uploads such targets knowingly; links to folders are never followed.
--dry-run and --json list every link followed.
"""


@click.command(epilog=EPILOG, short_help="Upload a checkpoint to the Hub, sending only what changed.")
@click.argument("path", type=click.Path(path_type=str))
@click.argument("repo_id")
@push_options
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar; print only the commit URL.")
def push(path: str, repo_id: str, as_json: bool, quiet: bool, **options: Any) -> None:
    """Upload the checkpoint in PATH (a folder, a file or s3://BUCKET/PREFIX) to the Hub repository REPO_ID.

    Creates the repository if it does not exist, uploads only what changed, and prints the
    commit URL (and the pull request URL with --create-pr).
    """
    from ..api.options import PushOptions

    result = push_and_report(path, repo_id, PushOptions(**options),
                             report="none" if as_json else "url" if quiet else "summary")
    if as_json:
        echo_json(result.to_dict())


def push_and_report(path: str, repo_id: str, options: PushOptions, *, report: str = "summary") -> PushResult:
    """Push with a byte progress bar; ``report`` is "summary", "url" (quiet) or "none" (JSON)."""
    from ..api.jobs import push as push_api

    with byte_progress("push", enabled=report == "summary" and not options.dry_run) as progress:
        result = push_api(path, repo_id, options=options, progress=progress)
    return report_push(result, report=report)


def report_push(result: PushResult, *, report: str) -> PushResult:
    """Print a push's result as ``report`` says: "summary", "url" (quiet) or "none" (JSON)."""
    if report == "summary":
        print_summary(result)
    elif report == "url" and result.commit_url and not result.dry_run:
        click.echo(result.pr_url or result.commit_url)
    return result


def print_summary(result: PushResult) -> None:
    target = f"{result.repo_id}@{result.revision}"
    if result.dry_run:
        for path in result.uploaded:
            click.echo(f"  upload     {path}")
        for path in result.unchanged:
            click.echo(f"  unchanged  {path}")
        for path in result.deleted:
            click.echo(f"  delete     {path}")
        for link in result.links:
            where = "outside the folder" if link.outside else "inside the folder or a Hugging Face cache"
            click.echo(f"  link       {link.path_in_repo} -> {link.target} ({where})")
        if result.offline:
            click.echo(f"dry run without the Hub ({result.offline}): would upload at most {len(result.uploaded)} "
                       f"file(s) ({format_size(result.uploaded_bytes)}); files already on {target} are skipped by "
                       "the real push")
            return
        creates = [w for w, flag in (("repository", result.created_repo), ("branch", result.created_branch)) if flag]
        extra = f"; would create the {' and '.join(creates)}" if creates else ""
        click.echo(f"dry run: would upload {len(result.uploaded)} file(s) ({format_size(result.uploaded_bytes)}), "
                   f"{len(result.unchanged)} already on {target}, {len(result.deleted)} to delete{extra}")
        return
    if not result.commits:
        click.echo(f"nothing to upload: {target} already has these {len(result.unchanged)} file(s)")
        click.echo(result.commit_url)
        return
    deleted = f", deleted {len(result.deleted)} stale file(s)" if result.deleted else ""
    click.echo(f"uploaded {len(result.uploaded)} file(s) ({format_size(result.uploaded_bytes)}) to {target} in "
               f"{len(result.commits)} commit(s), {len(result.unchanged)} unchanged{deleted}")
    outside = [link for link in result.links if link.outside]
    if outside:
        shown = ", ".join(f"{link.path_in_repo} -> {link.target}" for link in outside[:5])
        more = f" and {len(outside) - 5} more" if len(outside) > 5 else ""
        click.echo(f"followed {len(outside)} symlink(s) leading outside the folder (--follow-symlinks): {shown}{more}")
    if result.pr_url:
        click.echo(f"pull request: {result.pr_url}")
    click.echo(result.commit_url)


COMMANDS = [push]
