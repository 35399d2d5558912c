"""The public ``shardkit.split`` / ``convert`` / ``info`` / ``verify``: local paths and ``hf://`` repositories.

The local functions live with their stage (sharding, checking), which never imports ``hub``;
these wrappers route an ``hf://ORG/REPO[@REVISION][/SUBFOLDER]`` argument through
:mod:`shardkit.hub.remote_checkpoint` (split, convert) or the header-only mirror (info, verify),
and pass everything else straight on, so ``import shardkit`` gives one function per command
whatever the input.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal, TypedDict, cast

from ..checking.info import CheckpointInfo
from ..checking.verify import VerifyReport
from ..checking.verify import verify as _verify_local
from ..hub.remote_checkpoint import config_source, open_checkpoint
from ..hub.remote_spec import is_remote
from ..hub.remote_verify import describe as describe_remote_report
from ..sharding.convert import convert as _convert_local
from ..sharding.job import SplitResult
from ..sharding.options import ProgressCallback
from ..sharding.split import split as _split_local
from ..sources.base import CheckpointSource
from ..stores.urls import check_local, is_store_url
from .store_writes import write_to_store
from .stores import store_info, store_verify

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["CheckpointInfo", "ConvertKeywords", "SplitKeywords", "SplitResult", "VerifyKeywords", "VerifyReport", "convert",
           "describe_remote_report", "info", "is_remote", "split", "verify"]

Quantize = Literal["fp8-block", "fp8-channel", "fp8-tensor", "nvfp4", "mxfp4", "f16", "bf16", "q8_0", "q4_0"]
ConvertTo = Literal["diffusers", "single-file"]


class SplitKeywords(TypedDict, total=False):
    """The options :func:`split` passes to the local split (each documented there and in
    :class:`~shardkit.sharding.options.WriteOptions`): named, so a misspelt one is a type error."""

    max_shard_size: str | int
    dtype: str | None
    name: str | None
    variant: str | None
    allow_lossy: bool
    overwrite: bool
    dry_run: bool
    key: str | None
    metadata: dict[str, str] | None
    manifest: bool
    progress: ProgressCallback | None
    quantize: Quantize | None


class _MappingKeywords(SplitKeywords, total=False):
    strip_prefix: str | None
    add_prefix: str | None
    include: Iterable[str]
    exclude: Iterable[str]
    rename: Iterable[str] | dict[str, str]
    to: ConvertTo | None
    component: str | None


class ConvertKeywords(_MappingKeywords, total=False):
    """The options :func:`convert` takes besides :class:`SplitKeywords` (``config`` may be ``hf://``)."""

    config: str | os.PathLike[str] | None


class VerifyKeywords(TypedDict, total=False):
    """The options :func:`verify` passes to the local verify."""

    progress: ProgressCallback | None
    read_data: bool


def split(source: CheckpointSource, output: str | os.PathLike[str], *, token: str | None = None, cache: bool = True,
          **options: Unpack[SplitKeywords]) -> SplitResult:
    """:func:`shardkit.sharding.split.split`, for an ``hf://`` source too.

    Args:
        source: anything the local ``split`` takes, or ``hf://ORG/REPO[@REVISION][/SUBFOLDER]``.
        output: the output folder (or ``.safetensors`` file).
        token: a Hub token for ``hf://`` sources (default ``HF_TOKEN`` or the stored login).
        cache: download through the Hugging Face cache (default); False streams the tensor bytes
            by range reads into the output (bounded memory, each byte fetched once, no cache copy).
        options: ``max_shard_size``, ``dtype``, ``overwrite``... as the local ``split`` takes them.

    Returns:
        The :class:`~shardkit.sharding.job.SplitResult` of the write.

    shardkit.split("hf://org/model", "out/", max_shard_size="2GB", cache=False)
    """
    with open_checkpoint(source, token=token, cache=cache) as readable:  # anything but hf:// passes through
        if is_store_url(output):  # staged locally, then published into the store (api/store_writes.py)
            return write_to_store(output, lambda out, tick: _split_local(readable, out, **cast(
                "SplitKeywords", {**options, "overwrite": False, "progress": tick})), overwrite=bool(
                options.get("overwrite")), dry_run=bool(options.get("dry_run")), progress=options.get("progress"))
        return _split_local(readable, output, **options)


def convert(source: CheckpointSource, output: str | os.PathLike[str], *, token: str | None = None, cache: bool = True,
            **options: Unpack[ConvertKeywords]) -> SplitResult:
    """:func:`shardkit.sharding.convert.convert`, for an ``hf://`` source too.

    An ``hf://`` folder that holds pickle weights only is downloaded (through the cache): the
    caller asked for that repository. ``cache=False`` streams safetensors only.

    Args:
        source: anything the local ``convert`` takes, or ``hf://ORG/REPO[@REVISION][/SUBFOLDER or /FILE]``.
        output: the output folder.
        token, cache: as for :func:`split`.
        options: ``include``, ``strip_prefix``, ``to`` (``"diffusers"``, or ``"single-file"`` for a diffusers
            folder → one original-layout checkpoint), ``config``... as the local ``convert`` takes them;
            ``config`` may be ``hf://...`` too (its configs are downloaded, never its weights).

    Returns:
        A ``ConvertResult`` (a ``PipelineResult`` for a pipeline).

    shardkit.convert("hf://org/old-model", "out/", strip_prefix="model.")
    shardkit.convert("sdxl-pipeline/", "sdxl.safetensors", to="single-file", component="all")
    """
    given = options.get("config")
    rest = cast("_MappingKeywords", {k: v for k, v in options.items() if k != "config"})
    with open_checkpoint(source, token=token, cache=cache, pickles=True) as readable, \
            config_source(None if given is None else os.fspath(given), token=token) as config:
        if is_store_url(output):  # staged locally, then published into the store (api/store_writes.py)
            return write_to_store(output, lambda out, tick: _convert_local(readable, out, config=config, **cast(
                "_MappingKeywords", {**rest, "overwrite": False, "progress": tick})), overwrite=bool(
                rest.get("overwrite")), dry_run=bool(rest.get("dry_run")), progress=rest.get("progress"))
        return _convert_local(readable, output, config=config, **rest)


def info(path: str | os.PathLike[str], *, token: str | None = None) -> CheckpointInfo:
    """:func:`shardkit.checking.info.info`; for ``hf://...`` from headers, indexes and configs only.

    shardkit.info("hf://black-forest-labs/FLUX.1-dev").parameter_count
    """
    if is_remote(path):
        from ..hub.remote import remote_info

        return remote_info(path, token=token)
    if is_store_url(path):
        return store_info(path)
    check_local(path, role="checkpoint")
    from ..checking.info import info as info_local

    return info_local(path)


def verify(path: str | os.PathLike[str], *, against: CheckpointSource | None = None, token: str | None = None,
           **options: Unpack[VerifyKeywords]) -> VerifyReport:
    """:func:`shardkit.checking.verify.verify`; ``path`` or ``against`` may be ``hf://...``.

    ``verify("hf://...")`` checks the repository's structure without tensor data;
    ``verify(folder, against="hf://...")`` compares by the Hub's sha256s, then tensor by tensor.

    shardkit.verify("out/", against="hf://org/model").ok
    """
    from ..hub.remote_verify import verify_against_remote, verify_remote

    if is_remote(path):
        return verify_remote(path, token=token)
    if is_remote(against):
        return verify_against_remote(os.fspath(path), against, token=token)
    if is_store_url(path):
        return store_verify(path, against=against)
    check_local(path, role="checkpoint")
    check_local(against, role="reference")
    return _verify_local(path, against=against, **options)


def _advertise(wrapper: Any, local: Any, *extra: str) -> None:
    """Give ``wrapper`` (which takes ``**options``) the signature it really accepts: ``local``'s
    parameters, keyword-only after the first ones, plus ``extra`` (``token``, ``cache``), so
    ``help()`` and ``inspect.signature`` list every option."""
    params = list(inspect.signature(local).parameters.values())
    defaults = {"token": None, "cache": True}
    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=defaults[name]) for name in extra
               if name not in {p.name for p in params}]
    wrapper.__signature__ = inspect.signature(wrapper).replace(parameters=params)


_advertise(split, _split_local, "token", "cache")
_advertise(convert, _convert_local, "token", "cache")
_advertise(verify, _verify_local, "token")
