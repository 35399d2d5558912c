"""``shardkit info``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from ..units import format_size
from .common import echo_json, hub_token_option

if TYPE_CHECKING:
    from ..api.checkpoints import CheckpointInfo

EPILOG = """\b
Examples:
  shardkit info model.safetensors
  shardkit info out/                      # a sharded folder (or its index .json)
  shardkit info sd-pipeline/              # a diffusers pipeline: one section per component
  shardkit info pytorch_model.bin --json
  shardkit info hf://black-forest-labs/FLUX.1-dev    # a Hub repo: headers only (range reads)

\b
Reads headers only (safetensors) or maps the pickle with torch.load(weights_only=True,
mmap=True): no tensor data is read, so it is fast on 100 GB checkpoints.
Memory columns: floating-point tensors recast to fp32 / bf16 / fp8, others as stored.
fp8 checkpoints with scales (transformers FineGrainedFP8, compressed-tensors, ComfyUI scaled
fp8) are named on a "quantized" line; their scales are not counted as parameters, and the
fp32 / bf16 columns are the dequantized sizes.
"shared extents": bytes the filesystem shares with other files (copy-on-write clones on
XFS/btrfs, e.g. after a split), shown where it tells (FIEMAP); ext4 always says none.
Sizes are decimal (1 GB = 10^9 bytes).
"""


@click.command(epilog=EPILOG, short_help="Show what a checkpoint holds: tensors, dtypes, shards, metadata.")
@click.argument("path", type=click.Path(path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="Print one line: format, tensors, parameters, bytes.")
@hub_token_option
def info(path: str, as_json: bool, quiet: bool, token: str | None = None) -> None:
    """Show what a checkpoint holds: format, tensors, parameters, dtypes, shards, metadata."""
    from ..api.checkpoints import info as info_api

    summary = info_api(path, token=token)
    if as_json:
        echo_json(summary.to_dict())
    elif quiet:
        click.echo(_one_line(summary))
    elif summary.components:
        print_pipeline(summary)
    else:
        print_checkpoint(summary)


def _one_line(s: CheckpointInfo) -> str:
    kind = f"pipeline of {len(s.components)} components" if s.components else s.format
    return f"{s.path}: {kind}, {s.tensor_count} tensors, {s.parameter_count:,} parameters, {format_size(s.total_bytes)}"


def print_checkpoint(s: CheckpointInfo, *, title: str | None = None) -> None:
    layout = s.format + (f", {len(s.shards)} shards" if s.index else "")
    naming = f"{s.naming}" + (f", variant {s.variant}" if s.variant else "") if s.naming else "-"
    click.echo(click.style(title or s.path, bold=True))
    rows = [("format", layout), ("naming", naming)]
    if s.class_name:
        rows.append(("class", f"{s.library} {s.class_name}"))
    rows += _totals_rows(s)
    if s.quantization:
        rows.append(("quantized", s.quantization.get("description") or f"unusable: {s.quantization.get('error')}"))
        if isinstance(vocab := s.quantization.get("vocabulary"), dict):  # a GGUF language model's tokenizer
            rows.append(("vocabulary", str(vocab.get("text"))))
    if s.shared_bytes is not None:
        rows.append(("shared extents", _shared_text(s.shared_bytes, sum(sh.file_bytes for sh in s.shards))))
    if s.metadata:
        rows.append(("metadata", ", ".join(f"{k}={_short(v)}" for k, v in sorted(s.metadata.items()))))
    if s.index_metadata:
        rows.append(("index metadata", ", ".join(f"{k}={_short(str(v))}" for k, v in sorted(s.index_metadata.items()))))
    _table([(f"  {k}", v) for k, v in rows], header=None)
    click.echo("  shards")
    if s.shared_bytes:  # a column only where copy-on-write clones exist
        _table([(f"    {sh.file}", f"{sh.tensors:,}", format_size(sh.bytes), format_size(sh.shared_bytes or 0))
                for sh in s.shards], header=("    file", "tensors", "size", "shared"), right=(1, 2, 3))
    else:
        _table([(f"    {sh.file}", f"{sh.tensors:,}", format_size(sh.bytes)) for sh in s.shards],
               header=("    file", "tensors", "size"), right=(1, 2))
    _print_largest(s)


def print_pipeline(s: CheckpointInfo) -> None:
    click.echo(click.style(f"{s.path}  (diffusers pipeline, {len(s.components)} weight-bearing components)", bold=True))
    for name, component in s.components.items():
        click.echo()
        print_checkpoint(component, title=f"[{name}]")
    click.echo()
    click.echo(click.style("totals", bold=True))
    rows = [(name, f"{c.tensor_count:,}", f"{c.parameter_count:,}", format_size(c.total_bytes),
             *[format_size(c.memory_bytes[k]) for k in ("fp32", "bf16", "fp8")]) for name, c in s.components.items()]
    rows.append(("total", f"{s.tensor_count:,}", f"{s.parameter_count:,}", format_size(s.total_bytes),
                 *[format_size(s.memory_bytes[k]) for k in ("fp32", "bf16", "fp8")]))
    _table([(f"  {r[0]}", *r[1:]) for r in rows],
           header=("  component", "tensors", "parameters", "size", "fp32", "bf16", "fp8"), right=(1, 2, 3, 4, 5, 6))
    _print_largest(s)


def _totals_rows(s: CheckpointInfo) -> list[tuple[str, str]]:
    by_dtype = ", ".join(f"{d} {format_size(b)} ({s.tensors_by_dtype[d]:,})" for d, b in s.bytes_by_dtype.items())
    memory = "  ".join(f"{k} {format_size(v)}" for k, v in s.memory_bytes.items())
    return [("tensors", f"{s.tensor_count:,}"), ("parameters", f"{s.parameter_count:,} ({_human(s.parameter_count)})"),
            ("size", f"{format_size(s.total_bytes)} of tensors"), ("by dtype", by_dtype or "-"),
            ("memory as", memory)]


def _shared_text(shared_bytes: int, file_bytes: int) -> str:
    """Whether the weight files share disk blocks with other files (FIEMAP), e.g. the file they were split from."""
    if not shared_bytes:
        return "none (no copy-on-write clones)"
    return f"{format_size(shared_bytes)} of {format_size(file_bytes)} (copy-on-write clones, e.g. of the source)"


def _print_largest(s: CheckpointInfo) -> None:
    if not s.largest:
        return
    click.echo("  largest tensors")
    _table([(f"    {t.name}", t.dtype, "x".join(map(str, t.shape)) or "scalar", format_size(t.bytes)) for t in s.largest],
           header=("    name", "dtype", "shape", "size"), right=(3,))


def _table(rows: list[tuple[str, ...]], *, header: tuple[str, ...] | None, right: tuple[int, ...] = ()) -> None:
    """Print rows as aligned columns (numbers right-aligned)."""
    allrows = ([header] if header else []) + rows
    widths = [max(len(r[i]) for r in allrows) for i in range(len(allrows[0]))]
    for row in allrows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        click.echo("  ".join(cells).rstrip())


def _human(count: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.2f}{unit}"
    return str(count)


def _short(value: str, limit: int = 80) -> str:
    return value if len(value) <= limit else value[: limit - 3] + "..."


COMMANDS = [info]
