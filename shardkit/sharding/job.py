"""The writing job every command shares: source → plan → shards, side files, index → publish.

``split``, ``convert``, ``save_sharded`` and pipeline folders differ only in which sources they
open (a keymapped view, an in-memory state dict, one source per component) and which side
files travel along; the planning, writing, syncing and publishing below is one piece of code.
A job never imports the commands built on it, so the commands form no import cycle.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ..atomic.commit import OutputTransaction
from ..errors import InvalidInputError, Option
from ..formats.index import DIFFUSERS_PREFIX, Naming, dump_index
from ..formats.json_types import JsonObject
from ..formats.manifest import MANIFEST_NAME
from ..formats.side_files import folder_side_files
from ..formats.suffixes import is_manifest_file
from ..sources import Source, open_source
from ..sources.base import CheckpointSource
from ..sources.ranged import RangedCheckpoint
from .digest import ManifestRecorder, stale_manifests, stale_side_files
from .flush import BackgroundSync, ByteCounter
from .options import WriteOptions, warn_if_many_shards, warn_if_output_taken
from .outputs import JobOutput, LocalOutput, OutputPlan, open_output, output_target, publish_files
from .plan import ShardPlan, plan_shards
from .quant import config_edits, dropped_side_files, kept_cast, quant_report, quant_view
from .writer import TensorWrite, tensor_write

__all__ = ["ShardJob", "SideFile", "SplitResult", "checkpoint_files", "copied_names", "copy_side_files", "open_settled",
           "ShardWriter", "plan_job", "plan_side_files", "publish", "resolve_naming", "run_jobs", "side_files", "split_source"]

SideFile = tuple[str, str]  # (path to copy from, file name inside the output)


@dataclass
class SplitResult:
    """What a split wrote (or, with ``dry_run``, would write)."""

    output: str
    plan: ShardPlan
    source: str
    dtype: str | None = None
    dry_run: bool = False
    aliases: dict[str, str] = field(default_factory=dict)
    cloned_bytes: int = 0  # tensor bytes cloned from the source (copy-on-write filesystems), not copied
    quantization: JsonObject | None = None  # fp8 scales dequantized or quantized (sharding/quant.py)
    copied: list[str] = field(default_factory=list)  # other files copied beside the weights (relative paths)

    @property
    def files(self) -> list[str]:
        return [os.path.join(self.output, f) for f in self.plan.filenames()]

    @property
    def copied_bytes(self) -> int:
        """Tensor bytes that were copied (or cast) rather than cloned; 0 for a dry run."""
        return 0 if self.dry_run else self.plan.total_bytes - self.cloned_bytes

    def to_dict(self) -> JsonObject:
        return {
            "output": self.output,
            "source": self.source,
            "dry_run": self.dry_run,
            "dtype": self.dtype,
            "total_bytes": self.plan.total_bytes,
            "max_shard_bytes": self.plan.max_shard_bytes,
            "index": self.plan.index_filename,
            "aliases": self.aliases,
            "cloned_bytes": self.cloned_bytes,
            "copied_bytes": self.copied_bytes,
            **({"quantization": self.quantization} if self.quantization is not None else {}),
            "copied": list(self.copied),
            "shards": [
                {"file": s.filename, "tensors": len(s.names), "bytes": s.nbytes} for s in self.plan.shards
            ],
        }


@dataclass
class ShardJob:
    """One checkpoint to write: its open source, every tensor's write, and the shard plan.

    ``folder`` is where it goes inside the output: ``""`` for the output itself, a component
    name (``"unet"``) for a pipeline folder.
    """

    source: Source
    writes: list[TensorWrite]
    plan: ShardPlan
    folder: str = ""
    cloned_bytes: int = 0  # filled in by the write
    cast_to: str | None = None  # what floating tensors are cast to (--dtype, or --quantize's kept dtype)

    def path(self, filename: str) -> str:
        """``filename`` relative to the output folder."""
        return f"{self.folder}/{filename}" if self.folder else filename

    def result(self, output: str, options: WriteOptions, *, copied: Sequence[SideFile] = ()) -> SplitResult:
        where = os.path.join(output, self.folder) if self.folder else output
        return SplitResult(where, self.plan, self.source.description, options.cast_to, options.dry_run,
                           self.source.aliases(), self.cloned_bytes,
                           quant_report(self.source, cast_to=self.cast_to, options=options),
                           copied_names(copied))


def resolve_naming(source: Source, *, name: str | None, variant: str | None) -> Naming:
    """``name`` overrides; otherwise keep the source's convention (diffusers or transformers)."""
    base = source.naming
    if name is not None:
        if not name or "/" in name or "." in name:
            raise InvalidInputError("invalid ", Option("name", name),
                                    f": give a file prefix such as 'model' or '{DIFFUSERS_PREFIX}'")
        base = Naming(name, base.variant)
    return Naming(base.prefix, variant if variant is not None else base.variant)


def refuse_output_inside_source(source: CheckpointSource, output: str) -> None:
    """Refuse an output folder strictly inside a source folder: the job would write into its own input.

    The same folder is allowed (an in-place reshard with ``overwrite``); a sibling or any other
    folder is fine.

    refuse_output_inside_source("ckpt/", "ckpt/sub")
    Traceback (most recent call last):
    shardkit.errors.InvalidInputError: output ckpt/sub is inside the source folder ckpt/: ...
    """
    if not isinstance(source, (str, os.PathLike)) or not os.path.isdir(source):
        return
    src, out = os.path.realpath(os.fspath(source)), os.path.realpath(output)
    if out != src and os.path.commonpath([src, out]) == src:
        raise InvalidInputError(
            f"output {output} is inside the source folder {os.fspath(source)}: the source would change while it is "
            "read; write to a folder outside it, or reshard in place with the source folder itself as the output "
            "and ", Option("overwrite", True)
        )


def open_settled(source: CheckpointSource, *, key: str | None, dry_run: bool, output: str | None = None) -> Source:
    """Open ``source`` for a write into ``output``, under the one interrupted-write policy.

    A folder left *pending* by a crashed shardkit write is rolled forward only by a write into that
    same folder (an in-place reshard, not a dry run: :func:`settle_source`) or by ``shardkit
    recover``; read as a source of a write elsewhere it is refused like every reader refuses it
    (:func:`shardkit.sources.open_source`: one line naming ``shardkit recover``; the source is never
    modified).

    with open_settled("ckpt/", key=None, dry_run=False, output="ckpt/") as src:
        len(src.entries())
    """
    settle_source(source, output, dry_run=dry_run)
    return open_source(source, key=key)


def settle_source(source: CheckpointSource, output: str | None, *, dry_run: bool) -> None:
    """The one interrupted-write policy for the source of a write: a journal a crashed shardkit write
    left in ``source``'s folder is rolled forward only when this write goes into that same folder
    (an in-place reshard, not a dry run); otherwise the folder is read as every reader reads it:
    a live writer's commit is waited for, a crashed one's journal is refused with one line naming
    ``shardkit recover``, and nothing in it is changed.

    settle_source("ckpt/", "ckpt/", dry_run=False)  # the journal a crash left in ckpt/ is finished
    """
    if not isinstance(source, (str, os.PathLike)):
        return
    path = os.fspath(source)
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    target = None if output is None else output if os.path.isdir(output) or not output.endswith(".safetensors") \
        else os.path.dirname(os.path.abspath(output))
    if not dry_run and target is not None and os.path.realpath(folder) == os.path.realpath(target):
        from ..atomic.commit import recover

        recover(folder)
    else:
        from ..atomic.snapshot import wait_settled

        wait_settled(folder)


def plan_job(src: Source, *, options: WriteOptions, folder: str = "") -> ShardJob:
    """Every tensor of ``src`` in its output dtype, and the shard plan under the output naming.

    job = plan_job(src, options=WriteOptions(max_shard_bytes=5 * 10**9, dtype="bf16"))
    job.plan.filenames()
    ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors', 'model.safetensors.index.json']
    """
    naming = resolve_naming(src, name=options.name, variant=options.variant)
    src, uncast = quant_view(src, options=options)  # fp8 scales: kept whole, dequantized or quantized
    cast_to = kept_cast(src, options)  # --dtype; with --quantize alone, fp32 kept modules → bf16
    writes = [tensor_write(e, None if e.name in uncast else cast_to) for e in src.entries()]
    plan = plan_shards([(w.out.name, w.out.nbytes) for w in writes], max_shard_bytes=options.max_shard_bytes,
                       naming=naming, rule=src.shard_rule)
    warn_if_many_shards(len(plan.shards), max_shard_bytes=options.max_shard_bytes, total_bytes=plan.total_bytes)
    return ShardJob(src, writes, plan, folder, cast_to=cast_to)


def split_source(src: Source, output: str, *, options: WriteOptions,
                 side_files: Sequence[SideFile] = ()) -> SplitResult:
    """Plan ``src`` and write it into ``output``: the job behind split, convert and save_sharded.

    with open_source("model.safetensors") as src:
        split_source(src, "out/", options=WriteOptions(max_shard_bytes=10**9))
    """
    job = plan_job(src, options=options)
    run_jobs(output, [job], options=options, side_files=side_files)
    return job.result(output, options, copied=side_files)


ShardWriter = Callable[[ShardJob, JobOutput, Mapping[str, str], ByteCounter], None]


def run_jobs(output: str, jobs: Sequence[ShardJob], *, options: WriteOptions,
             side_files: Sequence[SideFile] = (), shards: ShardWriter | None = None) -> None:
    """Write every job and side file into ``output`` in ONE transaction (a dry run only warns).

    The output appears complete or not at all (see :mod:`shardkit.atomic.commit`, and
    :mod:`shardkit.sharding.outputs` for an output bound to a store); every file is durable
    before any index names it, and before the commit publishes anything. ``shards`` puts each
    job's shards into the output (default: write them from the source; a plan's finalize adopts
    the shards its tasks wrote, :mod:`shardkit.distributed.plan_run`).
    """
    if options.dry_run:
        warn_if_output_taken(output, overwrite=options.overwrite)
        return
    stale = [job.path(name) for job in jobs for name in checkpoint_files(os.path.join(output, job.folder), job.plan.naming)]
    stale += stale_manifests(output, [job.folder for job in jobs])
    edits, copies = plan_side_files(side_files, jobs=jobs, output=output)
    names = [job.path(name) for job in jobs for name in job.plan.filenames()] + list(edits) + [n for _, n in copies]
    if options.overwrite and not _reads_from(output, jobs):  # in place, the side files stay where they are
        stale += [n for n in stale_side_files(output, names) if n not in stale]
    plan = OutputPlan(names + ([MANIFEST_NAME] if options.manifest else []), stale, options.overwrite, options.manifest)
    tick = ByteCounter(sum(job.plan.total_bytes for job in jobs), options.progress)
    with open_output(output, plan) as out:
        _write_side_files(out, edits, copies)
        for job in jobs:
            (shards or _write_shards)(job, out, options.metadata or {}, tick)
        out.publish(_indexes(jobs))


def _reads_from(output: str, jobs: Sequence[ShardJob]) -> bool:
    """Whether any job reads a file inside ``output`` (an in-place write)."""
    root = os.path.realpath(output) + os.sep
    files = {e.file for job in jobs for e in job.source.entries() if e.file}
    return any(os.path.realpath(f).startswith(root) for f in files)


def plan_side_files(side_files: Sequence[SideFile], *, jobs: Sequence[ShardJob] = (),
                    output: str = "") -> tuple[dict[str, bytes], list[SideFile]]:
    """The side files a write puts beside the weights: configs written edited (name → bytes), and the
    files copied unchanged.

    The ``config.json`` of a job that dequantizes or quantizes fp8 weights is written with its
    ``quantization_config`` removed or added (:func:`~shardkit.sharding.quant.config_edits`); the
    source's manifest is never copied (it is not ours).
    """
    edits = config_edits(output, [(job.path("config.json"), job.source) for job in jobs], side_files)
    dropped = dropped_side_files([(job.path("config.json"), job.source) for job in jobs])
    copies = [(path, name) for path, name in side_files
              if name not in edits and name not in dropped and not is_manifest_file(os.path.basename(name))]
    return edits, copies


def copy_side_files(side_files: Sequence[SideFile], tx: OutputTransaction, *, sync: BackgroundSync,
                    record: ManifestRecorder, jobs: Sequence[ShardJob] = (), output: str = "") -> None:
    """Copy the side files (configs, README...) into the local ``tx``, recording their digests (see :func:`plan_side_files`)."""
    _write_side_files(LocalOutput(tx, sync, record), *plan_side_files(side_files, jobs=jobs, output=output))


def _write_side_files(out: JobOutput, edits: Mapping[str, bytes], copies: Sequence[SideFile]) -> None:
    for name, data in edits.items():
        out.write_bytes(name, data)
        out.record.data(name, data)
    for path, name in copies:
        out.copy_file(path, name)


def publish(tx: OutputTransaction, jobs: Sequence[ShardJob], *, sync: BackgroundSync, record: ManifestRecorder,
            before_index: Callable[[], None] | None = None) -> None:
    """The one local publish path (single process and collective): wait for every file to be on disk,
    write the indexes and the manifest, commit.

    Every shard and side file is fsynced before an index that names it can appear; the manifest
    is fsynced in the transaction and published with the files it lists. ``before_index`` runs
    once the data is on disk (a collective write removes its marker there).
    """
    publish_files(tx, _indexes(jobs), sync=sync, record=record, before_index=before_index)


def _write_shards(job: ShardJob, out: JobOutput, metadata: Mapping[str, str], tick: ByteCounter) -> None:
    by_name = {w.out.name: w for w in job.writes}
    for shard in job.plan.shards:
        job.cloned_bytes += out.write_shard(job.path(shard.filename), [by_name[n] for n in shard.names], job.source,
                                            metadata=shard_metadata(job, metadata), progress=tick)


def shard_metadata(job: ShardJob, metadata: Mapping[str, str]) -> dict[str, str]:
    """The ``__metadata__`` of every shard of ``job``: the source's own, then the user's, then aliases.

    The source's metadata travels with its tensors, so a split and its merge keep it.
    """
    return {"format": "pt", **job.source.metadata(), **metadata, **job.source.aliases()}


def _indexes(jobs: Sequence[ShardJob]) -> list[tuple[str, bytes]]:
    """Each sharded job's index (name inside the output, bytes), in job order: the last is published last."""
    return [(job.path(job.plan.index_filename), dump_index(job.plan.weight_map(), total_size_bytes=job.plan.total_bytes))
            for job in jobs if job.plan.index_filename]


def side_files(source: CheckpointSource, output: str) -> list[SideFile]:
    """Files that travel with a checkpoint folder but hold no weights: every other file and subfolder
    (config.json, tokenizer, README.md, .gitattributes, 1_Pooling/...), see :mod:`shardkit.formats.side_files`.

    They are copied unchanged, at the same relative path, when a folder is written into another
    folder; none in place (they stay where they are).
    """
    if not isinstance(source, (str, os.PathLike)) or not os.path.isdir(source):
        return []
    folder = os.fspath(source)
    if os.path.realpath(folder) == os.path.realpath(output):
        return []
    if isinstance(source, RangedCheckpoint) and source.name and source.path == source.root \
            and source.name == output_target(output):  # s3://A resharded in place: its side files stay
        return []
    return [(os.path.join(folder, rel), rel) for rel in folder_side_files(folder)]


def copied_names(side_files: Sequence[SideFile]) -> list[str]:
    """The output names of the side files a write copies (the source's manifest is never one)."""
    return [name for _, name in side_files if not is_manifest_file(os.path.basename(name))]


def checkpoint_files(folder: str, naming: Naming) -> list[str]:
    """Files in ``folder`` named exactly as ``naming``'s checkpoint (replaced by a write).

    Only exact names count: ``vae.safetensors`` beside ``model.safetensors`` is another file,
    not part of the checkpoint, and is never deleted.
    """
    if not os.path.isdir(folder):
        return []
    single, index = naming.single(), naming.index()
    shard = re.compile(re.escape(naming.shard(1, 1)).replace("00001", r"\d{5}") + "$")
    return sorted(name for name in os.listdir(folder) if name in (single, index) or shard.match(name))
