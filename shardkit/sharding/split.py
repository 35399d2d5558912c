"""``split`` and ``save_sharded``: source → plan → writer → index, the tool's main job."""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Any, Callable

from ..atomic.commit import OutputTransaction
from ..errors import InvalidInputError
from ..formats.index import DIFFUSERS_PREFIX, Naming, dump_index
from ..sources import Source, open_source
from ..units import LOSSLESS_TARGETS, normalize_dtype, parse_size
from .plan import ShardPlan, plan_shards
from .writer import BackgroundSync, ByteCounter, Placement, place, write_safetensors

DEFAULT_MAX_SHARD_SIZE = "5GB"
ProgressCallback = Callable[[int, int], None]  # (bytes done, bytes total)


@dataclass
class SplitResult:
    """What a split wrote (or, with ``dry_run``, would write)."""

    output: str
    plan: ShardPlan
    source: str
    dtype: str | None = None
    dry_run: bool = False
    aliases: dict[str, str] = field(default_factory=dict)

    @property
    def files(self) -> list[str]:
        return [os.path.join(self.output, f) for f in self.plan.filenames()]

    def to_dict(self) -> dict[str, Any]:
        return {
            "output": self.output,
            "source": self.source,
            "dry_run": self.dry_run,
            "dtype": self.dtype,
            "total_bytes": self.plan.total_bytes,
            "max_shard_bytes": self.plan.max_shard_bytes,
            "index": self.plan.index_filename,
            "aliases": self.aliases,
            "shards": [
                {"file": s.filename, "tensors": len(s.names), "bytes": s.nbytes} for s in self.plan.shards
            ],
        }


def resolve_naming(source: Source, *, name: str | None, variant: str | None) -> Naming:
    """``name`` overrides; otherwise keep the source's convention (diffusers or transformers)."""
    base = source.naming
    if name is not None:
        if not name or "/" in name or "." in name:
            raise InvalidInputError(f"invalid --name {name!r}: give a file prefix such as 'model' or '{DIFFUSERS_PREFIX}'")
        base = Naming(name, base.variant)
    return Naming(base.prefix, variant if variant is not None else base.variant)


def resolve_cast(dtype: str | None, *, allow_lossy: bool) -> str | None:
    if dtype is None:
        return None
    code = normalize_dtype(str(dtype).removeprefix("torch."))
    if code not in LOSSLESS_TARGETS and not allow_lossy:
        raise InvalidInputError(f"casting to {dtype} loses precision; pass --allow-lossy (allow_lossy=True) to do it")
    return code


def warn_if_output_taken(output: str, *, overwrite: bool) -> None:
    """A dry run writes nothing, but says when the real run would refuse the output."""
    if not overwrite and os.path.isdir(output) and os.listdir(output):
        import warnings

        from ..errors import ShardkitWarning

        warnings.warn(f"{output} exists and is not empty: the real run needs --overwrite", ShardkitWarning, stacklevel=3)


def open_settled(source: Any, *, key: str | None, dry_run: bool) -> Source:
    """Open ``source`` after finishing any interrupted commit in its folder (skipped by a dry run).

    >>> with open_settled("ckpt/", key=None, dry_run=False) as src:    # doctest: +SKIP
    ...     len(src.entries())
    """
    if isinstance(source, (str, os.PathLike)) and not dry_run:
        from ..atomic.commit import recover

        path = os.fspath(source)
        recover(path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path)))
    return open_source(source, key=key)


def prepare_split(src: Source, *, max_shard_bytes: int, cast_to: str | None, name: str | None,
                  variant: str | None) -> tuple[list[Placement], ShardPlan]:
    """Every tensor of ``src`` placed in the output dtype, and the shard plan under the output naming.

    >>> placements, plan = prepare_split(src, max_shard_bytes=5 * 10**9, cast_to="BF16",   # doctest: +SKIP
    ...                                  name=None, variant=None)
    """
    naming = resolve_naming(src, name=name, variant=variant)
    placements = [place(e, cast_to) for e in src.entries()]
    plan = plan_shards([(p.out.name, p.out.nbytes) for p in placements], max_shard_bytes=max_shard_bytes, naming=naming)
    return placements, plan


def split(source: Any, output: str | os.PathLike[str], *, max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
          dtype: str | None = None, name: str | None = None, variant: str | None = None,
          allow_lossy: bool = False, overwrite: bool = False, dry_run: bool = False, key: str | None = None,
          metadata: dict[str, str] | None = None, progress: ProgressCallback | None = None) -> SplitResult:
    """Stream a checkpoint into size-bounded safetensors shards with an index.

    ``source`` is a path (safetensors file, index, sharded folder, pickle) or an open Source.

    >>> import shardkit
    >>> result = shardkit.split("model.safetensors", "out/", max_shard_size="5GB")  # doctest: +SKIP
    >>> [os.path.basename(f) for f in result.files]                                  # doctest: +SKIP
    ['model-00001-of-00003.safetensors', ..., 'model.safetensors.index.json']
    """
    from ..formats.layout import is_pipeline_folder

    if isinstance(source, (str, os.PathLike)) and is_pipeline_folder(source):
        from .pipeline import split_pipeline

        return split_pipeline(source, output, max_shard_size=max_shard_size, dtype=dtype, name=name, variant=variant,
                              allow_lossy=allow_lossy, overwrite=overwrite, dry_run=dry_run, key=key,
                              metadata=metadata, progress=progress)
    max_shard_bytes = parse_size(max_shard_size, name="max shard size")
    cast_to = resolve_cast(dtype, allow_lossy=allow_lossy)
    output = os.fspath(output)
    with open_settled(source, key=key, dry_run=dry_run) as src:
        placements, plan = prepare_split(src, max_shard_bytes=max_shard_bytes, cast_to=cast_to, name=name,
                                         variant=variant)
        result = SplitResult(output, plan, src.description, cast_to, dry_run, src.aliases())
        if dry_run:
            warn_if_output_taken(output, overwrite=overwrite)
        else:
            write_plan(plan, placements, src, output, overwrite=overwrite, metadata=metadata, progress=progress,
                       extra_files=side_files(source, output))
    return result


def save_sharded(obj: Any, output: str | os.PathLike[str], *, max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
                 dtype: str | None = None, name: str | None = None, variant: str | None = None,
                 allow_lossy: bool = False, overwrite: bool = False, metadata: dict[str, str] | None = None,
                 progress: ProgressCallback | None = None) -> SplitResult:
    """Save a state dict or ``nn.Module`` (tensors on any device) as sharded safetensors.

    Tensors are moved to the host one at a time; tied tensors are written once.

    >>> shardkit.save_sharded(model, "out/", max_shard_size="2GB")  # doctest: +SKIP
    """
    from ..sources.memory import MemorySource, module_state_dict

    source = MemorySource(module_state_dict(obj), description=f"in-memory {type(obj).__name__}")
    return split(source, output, max_shard_size=max_shard_size, dtype=dtype, name=name, variant=variant,
                 allow_lossy=allow_lossy, overwrite=overwrite, metadata=metadata, progress=progress)


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".distcp", ".index.json")


def side_files(source: Any, output: str) -> list[str]:
    """Files that travel with a checkpoint folder (config.json, README...) but hold no weights.

    They are copied unchanged when a folder is split into another folder.
    """
    if not isinstance(source, (str, os.PathLike)) or not os.path.isdir(source):
        return []
    folder = os.fspath(source)
    if os.path.abspath(folder) == os.path.abspath(output):
        return []
    from ..formats.index import shard_file

    return sorted(  # shard_file: a symlinked side file may not pull in a file from outside the folder
        shard_file(folder, name, where=folder) for name in os.listdir(folder)
        if not name.startswith(".") and os.path.isfile(os.path.join(folder, name))
        and not name.endswith(_WEIGHT_SUFFIXES) and not (".index." in name and name.endswith(".json"))
    )


def _existing_checkpoint_files(output: str, naming: Naming) -> list[str]:
    """Files in ``output`` named exactly as ``naming``'s checkpoint (replaced by a write).

    Only exact names count: ``vae.safetensors`` beside ``model.safetensors`` is another file,
    not part of the checkpoint, and is never deleted.
    """
    if not os.path.isdir(output):
        return []
    single, index = naming.single(), naming.index()
    shard = re.compile(re.escape(naming.shard(1, 1)).replace("00001", r"\d{5}") + "$")
    return sorted(name for name in os.listdir(output) if name in (single, index) or shard.match(name))


def write_plan(plan: ShardPlan, placements: list[Placement], source: Source, output: str, *,
               overwrite: bool = False, metadata: dict[str, str] | None = None,
               progress: ProgressCallback | None = None, extra_files: list[str] = ()) -> None:  # type: ignore[assignment]
    """Write every shard of ``plan`` and then its index, atomically (see :mod:`shardkit.commit`).

    ``extra_files`` (paths) are copied unchanged into the output beside the shards.
    """
    by_name = {p.out.name: p for p in placements}
    # The source's own metadata travels with its tensors, so a split and its merge keep it.
    shard_metadata = {"format": "pt", **source.metadata(), **(metadata or {}), **source.aliases()}
    tick = ByteCounter(plan.total_bytes, progress)
    stale = _existing_checkpoint_files(output, plan.naming)
    with OutputTransaction(output, overwrite=overwrite, stale=stale) as tx, BackgroundSync() as sync:
        for shard in plan.shards:
            write_safetensors(tx.path_for(shard.filename), [by_name[n] for n in shard.names], source,
                              metadata=shard_metadata, progress=tick, sync=sync)
        for path in extra_files:
            copy = tx.path_for(os.path.basename(path))
            shutil.copyfile(path, copy)
            sync.submit(copy)
        sync.wait()  # every shard is on disk before the index that names it can appear
        if plan.index_filename:
            tx.write_bytes(plan.index_filename, dump_index(plan.weight_map(), total_size_bytes=plan.total_bytes))
        tx.commit(last=plan.index_filename)
