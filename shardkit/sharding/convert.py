"""``convert``: any supported checkpoint → safetensors shards, with key selection and renaming.

Sources: everything ``split`` reads (safetensors file/index/folder, ``.bin``/``.pt``/``.pth``/
``.ckpt`` pickles) plus sharded pickles (``pytorch_model.bin.index.json``), DCP folders written
by FSDP / ``torch.distributed.checkpoint.save``, and diffusers pipeline folders. The key options
wrap the source in a :class:`~shardkit.sources.keymap.KeyMapSource`, which then goes through the
very job ``split`` runs (:func:`~shardkit.sharding.job.split_source`): convert is split plus key
mapping, never a second copy of it.

Non-tensor values in the chosen state dict are an error that names them (choose the state dict
with ``key``); pickles are only ever loaded with ``weights_only=True``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from ..errors import InvalidInputError, Option
from ..formats.json_types import JsonObject
from ..formats.layout import is_pipeline_folder
from ..sources import Source
from ..sources.keymap import KeyMap, KeyMapSource, parse_renames
from ..sources.ranged import RangedCheckpoint
from .job import (
    SplitResult,
    open_settled,
    refuse_output_inside_source,
    settle_source,
    side_files,
    split_source,
)
from .options import WriteOptions, warn
from .single_file import is_file_output, split_to_file
from .split import split_with

if TYPE_CHECKING:
    from .lora import LoraSource

__all__ = ["ConvertResult", "build_keymap", "convert_with"]

EMA_PREFIX = "model_ema."


@dataclass
class ConvertResult(SplitResult):
    """A :class:`~shardkit.sharding.job.SplitResult` plus how many source tensors the key options dropped."""

    dropped: int = 0
    ema_tensors: int = 0
    lora: JsonObject | None = None  # what the adapters merged (sharding/lora.py), None without any

    def to_dict(self) -> JsonObject:
        return {**super().to_dict(), "dropped": self.dropped, "ema_tensors": self.ema_tensors,
                **({"lora": self.lora} if self.lora is not None else {})}


def build_keymap(*, include: Iterable[str] = (), exclude: Iterable[str] = (), strip_prefix: str | None = None,
                 add_prefix: str | None = None, rename: Iterable[str] | Mapping[str, str] = ()) -> KeyMap:
    """The :class:`~shardkit.sources.keymap.KeyMap` of convert's key options (empty strings mean unset).

    >>> build_keymap(strip_prefix="model.", rename=["a.=b."]).map("model.a.w")
    'b.w'
    """
    return KeyMap(
        include=tuple(include), exclude=tuple(exclude), strip_prefix=strip_prefix or None,
        add_prefix=add_prefix or None,
        rename=tuple(rename.items()) if isinstance(rename, Mapping) else parse_renames(rename),
    )


def convert_with(source: Any, output: str | os.PathLike[str], *, options: WriteOptions, key: str | None = None,
                 keymap: KeyMap | None = None, to: str | None = None, config: str | os.PathLike[str] | None = None,
                 component: str | None = None, lora: Sequence[str | os.PathLike[str]] = (),
                 lora_scale: float = 1.0) -> SplitResult:
    """Convert a checkpoint of any supported kind: ``shardkit.convert``'s writer, a split of a keymapped source.

    The options and the key map are built by the caller (:mod:`shardkit.api.checkpoints`); ``to``,
    ``config``, ``component``, ``lora`` and ``lora_scale`` are as ``shardkit.convert`` documents them
    (the adapters are merged into the source's own names, before the key options).

    convert_with("m.ckpt", "out/", options=WriteOptions(), keymap=KeyMap(strip_prefix="model."))
    """
    output = os.fspath(output)
    keymap = keymap or KeyMap()
    if lora and to not in (None, "gguf"):
        raise InvalidInputError(Option("lora"), " merges into a checkpoint written as safetensors or with ",
                                Option("to", "gguf"), "; merge "
                                "first (without ", Option("to"), "), then convert the merged folder")
    if to == "gguf":
        from .gguf_out import convert_to_gguf

        if not keymap.is_identity() or key is not None or config is not None:
            raise InvalidInputError(Option("key"), ", ", Option("config"), " and the key options do not apply with ",
                                    Option("to", "gguf"), ": the model's "
                                    "folder or file names its config and tensors")
        plain = replace(options, quantize=None)
        views: list[LoraSource] = []

        def merge(src: Source) -> Source:  # the adapters merged into the model's tensors as they stream
            from .lora import merged_view

            views.append(merged_view(src, lora, scale=lora_scale, options=plain))
            return views[-1]

        gguf = convert_to_gguf(source, output, options=plain, quantize=options.quantize, component=component,
                               view=merge if lora else None)
        if not views:
            return gguf
        return ConvertResult(**{f.name: getattr(gguf, f.name) for f in fields(SplitResult)}, lora=views[0].report())
    if to == "single-file":
        from .to_single_file import convert_to_single_file

        return convert_to_single_file(source, output, options=options, component=component, config=config, key=key,
                                      keymap_is_identity=keymap.is_identity())
    if to is not None or config is not None or component is not None:
        if isinstance(source, RangedCheckpoint):
            raise InvalidInputError(f"{source}: ", Option("to", "diffusers"),
                                    " maps the checkpoint file into memory; it cannot "
                                    "read it by range (convert a local copy; a location with a cache, such as the "
                                    "Hub, is read whole without ", Option("cache", False), ")")
        return _convert_to(source, output, options=options, key=key, keymap=keymap, to=to, config=config,
                           component=component)
    if isinstance(source, (str, os.PathLike)) and is_pipeline_folder(source):
        if not keymap.is_identity():
            raise InvalidInputError(f"{source}: key options (", Option("strip_prefix"), ", ", Option("include"), ", ",
                                    Option("rename"), ") do not apply "
                                    "to a pipeline folder; convert a component folder instead")
        if lora:
            from .lora import pipeline_lora

            whole, reports = pipeline_lora(source, output, lora, scale=lora_scale, options=options, key=key)
            for name, report in reports.items():
                part = whole.components[name]
                whole.components[name] = ConvertResult(**{f.name: getattr(part, f.name) for f in fields(SplitResult)},
                                                       lora=report)
            return whole
        return split_with(source, output, options=options, key=key)  # checks the output itself
    refuse_output_inside_source(source, output)
    with open_settled(source, key=key, dry_run=options.dry_run, output=output) as inner:
        lora_view = _merged(inner, lora, scale=lora_scale, options=options)
        merged: Source = lora_view or inner
        mapped: Source = merged if keymap.is_identity() else KeyMapSource(merged, keymap)
        ema = _report_ema(inner, keymap)
        if is_file_output(output):
            result = split_to_file(mapped, output, options=options)
        else:
            result = split_source(mapped, output, options=options, side_files=side_files(source, output))
        dropped = len(inner.entries()) - len(mapped.entries())
    as_split = {f.name: getattr(result, f.name) for f in fields(SplitResult)}
    return ConvertResult(**as_split, dropped=dropped, ema_tensors=ema, lora=None if lora_view is None else lora_view.report())


def _merged(inner: Source, lora: Sequence[str | os.PathLike[str]], *, scale: float,
            options: WriteOptions) -> LoraSource | None:
    """``inner`` with the adapters merged (:mod:`shardkit.sharding.lora`); None without any."""
    if not lora:
        return None
    from .lora import merged_view

    return merged_view(inner, lora, scale=scale, options=options)


def _convert_to(source: Any, output: str, *, options: WriteOptions, key: str | None, keymap: KeyMap,
                to: str | None, config: str | os.PathLike[str] | None, component: str | None) -> SplitResult:
    """``--to diffusers``: diffusers' own single-file conversion, written by the normal job."""
    if to != "diffusers":
        if to is not None:
            raise InvalidInputError(Option("to", to), ": the only conversion target is 'diffusers'")
        raise InvalidInputError(Option("config"), " and ", Option("component"), " apply with ", Option("to",
                                                                                                       "diffusers"),
                                "; add it, or drop them")
    if not keymap.is_identity():
        raise InvalidInputError("key options (", Option("strip_prefix"), ", ", Option("include"), ", ",
                                Option("rename"), ") do not apply with ", Option("to", "diffusers"), ": "
                                "diffusers' conversion picks and names the model's tensors itself")
    if not isinstance(source, (str, os.PathLike)):
        raise InvalidInputError(Option("to", "diffusers"), f" converts a checkpoint file; got {type(source).__name__}")
    if is_file_output(output):
        raise InvalidInputError(f"{output}: a diffusers model is a folder (config.json + weights); give a folder as "
                                f"OUTPUT, e.g. {output[: -len('.safetensors')]}/")
    refuse_output_inside_source(source, output)
    settle_source(source, output, dry_run=options.dry_run)  # rolled forward only in place
    if component == "all":
        from .to_diffusers_pipeline import convert_pipeline_to_diffusers

        return convert_pipeline_to_diffusers(source, output, options=options, config=config, key=key)
    from .to_diffusers_pipeline import convert_to_diffusers

    result, unused = convert_to_diffusers(source, output, options=options, config=config, component=component,
                                          key=key)
    as_split = {f.name: getattr(result, f.name) for f in fields(SplitResult)}
    return ConvertResult(**as_split, dropped=unused)


def _report_ema(inner: Source, keymap: KeyMap) -> int:
    """Say how many EMA tensors (``model_ema.*``, as in SD/Lightning checkpoints) there are."""
    ema = [e.name for e in inner.entries() if e.name.startswith(EMA_PREFIX)]
    if not ema:
        return 0
    if any(keymap.map(n) is not None for n in ema):
        warn(f"{inner.description}: {len(ema)} EMA tensors ({EMA_PREFIX}*) are included; drop them with ",
             Option("exclude", [f"{EMA_PREFIX}*"]), ", or keep only them with ", Option("include", [f"{EMA_PREFIX}*"]))
    else:
        warn(f"{inner.description}: also holds {len(ema)} EMA tensors ({EMA_PREFIX}*), not selected; "
             "select them with ", Option("include", [f"{EMA_PREFIX}*"]))
    return len(ema)
