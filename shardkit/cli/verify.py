"""``shardkit verify``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from ..api.records import MANIFEST_NAME
from ..errors import VerificationError
from ..units import format_size
from .common import byte_progress, echo_json, hub_token_option

if TYPE_CHECKING:
    from ..api.checkpoints import VerifyReport

EPILOG = """\b
Examples:
  shardkit verify out/                                  # structure + read every byte
  shardkit verify out/ --against model.safetensors      # + every tensor bit for bit
  shardkit verify out-bf16/ --against pytorch_model.bin # source cast the same way first
  shardkit verify sd-pipeline/ --against sd-pipeline-orig/ --json
  shardkit verify hf://org/model                        # structure from headers + file listing
  shardkit verify out/ --against hf://org/model         # sha256 vs the Hub's LFS oids, tensor by tensor
  shardkit verify s3://models/unet --against unet/      # every object read by range, tensor by tensor
                                                        # (weights, indexes, configs; the rest listed)

\b
Checks: the index against the files and their headers (every tensor where the index says,
no duplicates, no orphan tensors or shard files, total_size), offsets and tiling, truncation
and trailing bytes; then it reads every byte and prints each file's sha256. Every byte is
compared with shardkit.manifest.json, which shardkit writes with each output (for a
.safetensors file a crc32 of its header and of every tensor; for every other file its
sha256): a changed byte is reported with its file and tensor. Without a
manifest the data can only be checked for structure (files in the Hugging Face cache are
compared with their blob's name). With --against, missing and extra tensors, shape and dtype
mismatches, and the first differing byte of each tensor are reported.
Exit codes: 0 clean, 1 any finding, 2 bad input.
"""


@click.command(epilog=EPILOG, short_help="Check a checkpoint's structure and data, byte for byte.")
@click.argument("path", type=click.Path(path_type=str))
@click.option("--against", "against", type=click.Path(path_type=str),
              help="Compare every tensor with this source (.safetensors, sharded folder, index, pickle; "
                   "for a pipeline folder, another pipeline folder).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="Print only the findings.")
@hub_token_option
def verify(path: str, against: str | None, as_json: bool, quiet: bool, token: str | None = None) -> None:
    """Check a checkpoint (file, sharded folder, index or pipeline folder) for damage.

    Lists every finding by file and tensor; exits 1 if there is any.
    """
    from ..api.checkpoints import describe_remote_report
    from ..api.checkpoints import verify as verify_api

    # no bar in logs and pipes: findings and the summary line are what matter there; a check decided
    # from a listing (a remote folder alone, or compared by listed digests) reads no tensor byte and shows none
    with byte_progress("verify", enabled=not (quiet or as_json)) as progress:
        report = verify_api(path, against=against, progress=progress, token=token)
    summary = describe_remote_report(report)
    if as_json:
        echo_json(report.to_dict())
    elif summary is not None:
        print_report(report, quiet=True)
        if not quiet and report.ok:
            click.echo(summary)
    else:
        print_report(report, quiet=quiet)
    if not report.ok:
        raise VerificationError(f"verify found {len(report.findings)} problem(s) in {path}",
                                findings=[str(f) for f in report.findings])


def print_report(report: VerifyReport, *, quiet: bool) -> None:
    files, findings = report.files, report.findings
    if not quiet and files:
        width = max(len(f.name) for f in files)
        for f in files:
            click.echo(f"  {f.name:<{width}}  {format_size(f.bytes):>10}  sha256 {f.sha256}")
    for finding in findings:
        click.echo(f"FAIL {finding}")
    for warning in report.warnings:
        click.echo(f"warning: {warning}", err=True)
    if quiet or findings:
        return
    compared = report.tensors_compared
    against = f", {compared} tensor(s) identical to {report.against}" if report.against else ""
    click.echo(integrity_line(report))
    click.echo(f"ok: {len(files)} file(s), {report.tensors_checked} tensor(s), "
               f"{format_size(report.bytes_read)} read{against}")


def integrity_line(report: VerifyReport) -> str:
    """What the data was checked against: the manifest, cache blob names, or structure only."""
    files, manifests = report.files, report.manifests
    unchecked = report.structure_only
    by_manifest = sum(f.checked == "manifest" and not f.name.endswith(MANIFEST_NAME) for f in files)
    by_blob = sum(f.checked == "hub-cache" for f in files)
    parts = []
    if by_manifest:
        parts.append(f"{by_manifest} file(s) match {' and '.join(manifests)} byte for byte")
    if by_blob:
        parts.append(f"{by_blob} file(s) match their Hugging Face cache blob names")
    by_values = sum(f.checked == "gguf-values" for f in files)
    if by_values:
        parts.append(f"{by_values} GGUF file(s): container and every value checked (dequantized, finite); a changed "
                     "byte that stays finite would go unnoticed (GGUF has no checksums)")
    unhashed = report.unhashed
    if unhashed:
        parts.append(f"{unhashed} tensor(s) not hashed (copied in the store): the manifest records no crc32 for "
                     "them, so their bytes were checked for structure only; pass --against SOURCE to compare them")
    if unchecked and not report.against:
        why = f"not listed in {' or '.join(manifests)}" if manifests else f"no {MANIFEST_NAME}"
        shown = ", ".join(unchecked[:3]) + (f" and {len(unchecked) - 3} more" if len(unchecked) > 3 else "")
        parts.append(f"structure only for {shown} ({why}): their data could only be checked for structure, "
                     "so a changed tensor byte would go unnoticed; pass --against SOURCE to compare every tensor")
    return "integrity: " + "; ".join(parts) if parts else "integrity: compared with the source only"


COMMANDS = [verify]
