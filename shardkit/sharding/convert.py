"""``convert``: any supported checkpoint → safetensors shards, with key selection and renaming.

Sources: everything ``split`` reads (safetensors file/index/folder, ``.bin``/``.pt``/``.pth``/
``.ckpt`` pickles) plus sharded pickles (``pytorch_model.bin.index.json``), DCP folders written
by FSDP / ``torch.distributed.checkpoint.save``, and diffusers pipeline folders. The key options
wrap the source in a :class:`~shardkit.sources.keymap.KeyMapSource`; bytes still stream through
the same bounded-memory, atomic writer as ``split``.

Non-tensor values in the chosen state dict are an error that names them (choose the state dict
with ``key``); pickles are only ever loaded with ``weights_only=True``.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ..errors import InvalidInputError, ShardkitWarning
from ..sources import Source
from ..sources.keymap import KeyMap, KeyMapSource, parse_renames
from ..units import parse_size
from .split import (
    DEFAULT_MAX_SHARD_SIZE,
    SplitResult,
    open_settled,
    prepare_split,
    resolve_cast,
    side_files,
    split,
    write_plan,
)

EMA_PREFIX = "model_ema."


@dataclass
class ConvertResult(SplitResult):
    """A :class:`~shardkit.reshard.SplitResult` plus how many source tensors the key options dropped."""

    dropped: int = 0
    ema_tensors: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "dropped": self.dropped, "ema_tensors": self.ema_tensors}


def convert(source: Any, output: str | os.PathLike[str], *, max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
            dtype: str | None = None, allow_lossy: bool = False, key: str | None = None,
            strip_prefix: str | None = None, add_prefix: str | None = None, include: Iterable[str] = (),
            exclude: Iterable[str] = (), rename: Iterable[str] | dict[str, str] = (), name: str | None = None,
            variant: str | None = None, overwrite: bool = False, dry_run: bool = False,
            metadata: dict[str, str] | None = None,
            progress: Callable[[int, int], None] | None = None) -> SplitResult:
    """Convert a checkpoint of any supported kind into size-bounded safetensors shards.

    ``include``/``exclude`` are globs on the source's tensor names; ``strip_prefix`` keeps only
    the names that start with it and removes it; ``rename`` maps a leading ``OLD`` to ``NEW``
    (``["OLD=NEW"]`` or ``{"OLD": "NEW"}``); ``add_prefix`` is prepended last.

    >>> import shardkit
    >>> shardkit.convert("v1-5-pruned.ckpt", "unet/", key="state_dict",            # doctest: +SKIP
    ...                  strip_prefix="model.diffusion_model.", dtype="fp16")
    >>> shardkit.convert("fsdp-checkpoint/", "out/", max_shard_size="5GB")         # doctest: +SKIP
    """
    keymap = KeyMap(
        include=tuple(include), exclude=tuple(exclude), strip_prefix=strip_prefix or None,
        add_prefix=add_prefix or None,
        rename=tuple(rename.items()) if isinstance(rename, dict) else parse_renames(rename),
    )
    common = dict(max_shard_size=max_shard_size, dtype=dtype, allow_lossy=allow_lossy, variant=variant,
                  overwrite=overwrite, dry_run=dry_run, metadata=metadata, progress=progress)
    if _is_pipeline(source):
        if not keymap.is_identity():
            raise InvalidInputError(f"{source}: key options (--strip-prefix, --include, --rename ...) do not apply "
                                    "to a pipeline folder; convert a component folder instead")
        return split(source, output, name=name, key=key, **common)
    max_shard_bytes = parse_size(max_shard_size, name="max shard size")
    cast_to = resolve_cast(dtype, allow_lossy=allow_lossy)
    output = os.fspath(output)
    with open_settled(source, key=key, dry_run=dry_run) as inner:
        wrapped: Source = inner if keymap.is_identity() else KeyMapSource(inner, keymap)
        ema = _report_ema(inner, keymap)
        placements, plan = prepare_split(wrapped, max_shard_bytes=max_shard_bytes, cast_to=cast_to, name=name,
                                         variant=variant)
        if not dry_run:
            write_plan(plan, placements, wrapped, output, overwrite=overwrite, metadata=metadata, progress=progress,
                       extra_files=side_files(source, output))
        dropped = len(inner.entries()) - len(placements)
        return ConvertResult(output, plan, wrapped.description, cast_to, dry_run, wrapped.aliases(),
                             dropped=dropped, ema_tensors=ema)


def _is_pipeline(source: Any) -> bool:
    from ..formats.layout import is_pipeline_folder

    return isinstance(source, (str, os.PathLike)) and is_pipeline_folder(source)


def _report_ema(inner: Source, keymap: KeyMap) -> int:
    """Say how many EMA tensors (``model_ema.*``, as in SD/Lightning checkpoints) there are."""
    ema = [e.name for e in inner.entries() if e.name.startswith(EMA_PREFIX)]
    if not ema:
        return 0
    if any(keymap.map(n) is not None for n in ema):
        hint = f"drop them with --exclude '{EMA_PREFIX}*', or keep only them with --include '{EMA_PREFIX}*'"
        warnings.warn(f"{inner.description}: {len(ema)} EMA tensors ({EMA_PREFIX}*) are included; {hint}",
                      ShardkitWarning, stacklevel=3)
    else:
        warnings.warn(f"{inner.description}: also holds {len(ema)} EMA tensors ({EMA_PREFIX}*), not selected; "
                      f"select them with --include '{EMA_PREFIX}*'", ShardkitWarning, stacklevel=3)
    return len(ema)
