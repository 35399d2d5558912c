"""The public ``shardkit.split`` / ``convert`` / ``info`` / ``verify``: local paths and remote locations alike.

Each takes its write options once, as ``options=WriteOptions(...)`` or as the keyword shorthands
of :class:`~shardkit.sharding.options.WriteKeywords` (both: the shorthands win), resolves a remote
source (``hf://``, ``s3://``) through :mod:`shardkit.api.sources` and calls the stage's function
with the built options. A local path goes straight to the stage.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..checking.info import CheckpointInfo
from ..checking.verify import VerifyReport
from ..distributed.save import save_sharded
from ..errors import Option
from ..formats.header import read_header
from ..sharding.job import SplitResult
from ..sharding.options import ProgressCallback, WriteOptions
from ..sharding.plan import plan_shards
from ..sources.base import CheckpointSource
from ..stores.urls import check_local, is_store_url
from .options import ConvertTo
from .sources import is_remote, lists_digests
from .store_copy import copy_split
from .store_writes import write_to_store
from .stores import store_checkpoint, store_info

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ..hub.push import PushResult
    from ..sharding.options import WriteKeywords

__all__ = ["CheckpointInfo", "ConvertTo", "SplitAndPush", "SplitResult", "VerifyReport", "convert", "describe_remote_report",
           "info", "is_remote", "plan_shards", "read_header", "save_sharded", "split", "split_and_push", "verify"]

def split(source: CheckpointSource, output: str | os.PathLike[str], *, options: WriteOptions | None = None,
          key: str | None = None, token: str | None = None, cache: bool = True,
          **shorthands: Unpack[WriteKeywords]) -> SplitResult:
    """Stream a checkpoint into size-bounded safetensors shards with an index.

    Args:
        source: a path (safetensors file, index or sharded folder, ``.bin``/``.pt``/``.ckpt``
            pickle, diffusers pipeline folder), an in-memory state dict or module, an open source,
            or ``hf://ORG/REPO[@REVISION][/SUBFOLDER]``.
        output: the output folder (or ``.safetensors`` file); with ``overwrite`` it may be the source's own folder.
        options: the :class:`~shardkit.sharding.options.WriteOptions` of the write (default: the defaults).
        key: for pickles, the dict key holding the state dict (default: auto).
        token: a Hub token for ``hf://`` sources (default ``HF_TOKEN`` or the stored login).
        cache: download through the Hugging Face cache (default); False streams the tensor bytes
            by range reads into the output (bounded memory, each byte fetched once, no cache copy).
        **shorthands: any :class:`~shardkit.sharding.options.WriteOptions` field by name
            (``max_shard_size="5GB"``, ``"2GiB"`` or an int for ``max_shard_bytes``), applied over ``options``.
            A source with fp8 weights and scales is copied as is without ``dtype`` and dequantized
            (weight × scale) with bf16/fp16/fp32.

    Returns:
        A :class:`~shardkit.sharding.job.SplitResult` (a ``PipelineResult`` for a pipeline folder) with the plan.

    import shardkit
    result = shardkit.split("model.safetensors", "out/", max_shard_size="5GB")
    shardkit.split("hf://org/model", "out/", options=shardkit.WriteOptions(max_shard_bytes=2 * 10**9), cache=False)
    """
    from ..sharding.split import split_with
    from .sources import opened

    built = WriteOptions.build(options, shorthands, where="split()")
    with opened(source, token=token, cache=cache) as readable:
        if is_store_url(output) and (copied := copy_split(source, readable, output, options=built, key=key)):
            return copied  # S3 to S3, bytes kept: composed by copies inside the store (api/store_copy.py)
        if is_store_url(output):  # streamed into the store, or staged for one file (api/store_writes.py)
            return write_to_store(output, lambda out, tick: split_with(
                readable, out, options=dataclasses.replace(built, overwrite=False, progress=tick), key=key),
                overwrite=built.overwrite, dry_run=built.dry_run, progress=built.progress)
        return split_with(readable, output, options=built, key=key)


def convert(source: CheckpointSource, output: str | os.PathLike[str], *, options: WriteOptions | None = None,
            key: str | None = None, include: Iterable[str] = (), exclude: Iterable[str] = (),
            strip_prefix: str | None = None, add_prefix: str | None = None,
            rename: Iterable[str] | Mapping[str, str] = (), to: ConvertTo | None = None,
            config: str | os.PathLike[str] | None = None, component: str | None = None, token: str | None = None,
            cache: bool = True, collective: bool = False, lora: str | os.PathLike[str] | Iterable[str | os.PathLike[str]] = (),
            lora_scale: float = 1.0, **shorthands: Unpack[WriteKeywords]) -> SplitResult:
    """Convert a checkpoint of any supported kind into size-bounded safetensors shards.

    Args:
        source: anything :func:`split` reads, plus sharded pickles, DCP folders, pipeline folders and
            GGUF files; ``hf://ORG/REPO[@REVISION][/SUBFOLDER or /FILE]`` too (a folder holding pickle
            weights only is downloaded through the cache; ``cache=False`` streams safetensors only).
        output: the output folder (or file).
        options, token, cache, **shorthands: as for :func:`split`.
        key: the nested dict holding the state dict (``"state_dict"``, ``"a/b"``; default: auto).
        include, exclude: globs on the source's tensor names (as stored, after ``key``).
        strip_prefix: keep only the names that start with it, and remove it.
        add_prefix: prepended last.
        rename: a leading ``OLD`` becomes ``NEW`` (``["OLD=NEW"]`` or ``{"OLD": "NEW"}``).
        to: ``"diffusers"`` (a single-file SD/SDXL/SD3/Flux... checkpoint → a diffusers model folder,
            with diffusers' own key mapping; the key options do not apply), ``"single-file"`` (the
            reverse: a diffusers model or pipeline folder → one original-layout checkpoint) or
            ``"gguf"`` (a Llama or Flux model → one ``.gguf`` file; ``quantize`` sets the ggml type).
        config: with ``to="diffusers"``, the diffusers config (a ``config.json``, a model folder, or a
            pipeline folder), local or ``hf://`` (its configs are downloaded, never its weights).
        component: with a pipeline folder as ``config`` (or as ``source`` with ``to="single-file"``),
            the component to write; ``"all"`` for the whole pipeline.
        collective: every rank of a torchrun group calls this and writes its share of the shards
            (see :func:`shardkit.api.jobs.torchrun_group`); ``source`` is then a local or ``s3://``
            checkpoint (each rank reads only its shards' byte ranges), ``output`` a folder every rank
            sees or an ``s3://`` prefix (each rank uploads its own shards).
        lora: PEFT LoRA adapter folders, or diffusers/kohya LoRA files for a UNet or transformer (SD, SDXL,
            Flux), local, ``s3://`` or ``hf://`` (one, or several merged in order): each weight they target
            becomes ``W + scale · (B @ A)``, computed in float32 from the base's band and written in
            the output dtype; ``modules_to_save`` tensors replace the base's (see docs/lora.md).
        lora_scale: multiplies every adapter's own scale (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA).

    Returns:
        A ``ConvertResult`` (a ``PipelineResult`` for a pipeline).

    shardkit.convert("v1-5-pruned.ckpt", "unet/", key="state_dict", strip_prefix="model.diffusion_model.", dtype="fp16")
    shardkit.convert("hf://org/old-model", "out/", strip_prefix="model.")
    shardkit.convert("sdxl-pipeline/", "sdxl.safetensors", to="single-file", component="all")
    shardkit.convert("llama/", "llama-merged/", lora="my-adapter/", dtype="bf16")
    """
    from ..sharding.convert import build_keymap, convert_with
    from .sources import check_collective, configs, opened

    built = WriteOptions.build(options, shorthands, where="convert()")
    keymap = build_keymap(include=include, exclude=exclude, strip_prefix=strip_prefix, add_prefix=add_prefix,
                          rename=dict(rename) if isinstance(rename, Mapping) else rename)
    adapters = [lora] if isinstance(lora, (str, os.PathLike)) else list(lora)
    if collective:
        from ..distributed.convert import convert_collective
        from ..errors import InvalidInputError

        if adapters:
            raise InvalidInputError(Option("lora"), " is not supported in a collective convert; merge in one process")

        check_collective(source)
        with opened(source, cache=cache) as readable:  # s3://: each rank reads its shards' byte ranges
            return convert_collective(readable, output, options=built, key=key, keymap=keymap, to=to)
    with opened(source, token=token, cache=cache, pickles=True) as readable, \
            configs(config, token=token) as local_config, contextlib.ExitStack() as held:
        adapters = [_opened_adapter(held, a, token=token) for a in adapters]
        if is_store_url(output):  # streamed into the store, or staged for one file (api/store_writes.py)
            return write_to_store(output, lambda out, tick: convert_with(
                readable, out, options=dataclasses.replace(built, overwrite=False, progress=tick), key=key,
                keymap=keymap, to=to, config=local_config, component=component, lora=adapters, lora_scale=lora_scale),
                overwrite=built.overwrite, dry_run=built.dry_run, progress=built.progress)
        return convert_with(readable, output, options=built, key=key, keymap=keymap, to=to, config=local_config,
                            component=component, lora=adapters, lora_scale=lora_scale)


def _opened_adapter(held: contextlib.ExitStack, adapter: str | os.PathLike[str], *,
                    token: str | None) -> str | os.PathLike[str]:
    """A LoRA adapter to read: itself, or one in a store opened for the convert (the Hub's through its cache, a
    bucket's files mirrored with its weights read by range)."""
    from .sources import opened

    if not is_remote(adapter):
        return adapter
    got = held.enter_context(opened(adapter, token=token))
    if not isinstance(got, (str, os.PathLike)):
        raise TypeError(f"{adapter}: opened as a {type(got).__name__}, not a path")
    return got


@dataclass(frozen=True)
class SplitAndPush:
    """What :func:`split_and_push` did: the split, and the push (None without a repository or on a dry run)."""

    split: SplitResult
    push: PushResult | None = None

    def to_dict(self) -> dict[str, Any]:
        data = self.split.to_dict()
        return {**data, "push": self.push.to_dict()} if self.push else data


def split_and_push(source: CheckpointSource, output: str | os.PathLike[str], repo_id: str | None = None, *,
                   options: WriteOptions | None = None, key: str | None = None, token: str | None = None,
                   cache: bool = True, create_pr: bool = False, push_progress: ProgressCallback | None = None,
                   after_split: Callable[[SplitResult], None] | None = None,
                   **shorthands: Unpack[WriteKeywords]) -> SplitAndPush:
    """Split ``source`` into ``output``, then push ``output`` to ``repo_id`` (when given and not a dry run).

    A bad repository id, a missing or rejected token, or a symlink in ``output`` leading outside it
    (which the push would refuse) is found before the split, not after.

    Args:
        source: anything :func:`shardkit.split` takes, ``hf://ORG/REPO`` included.
        output: the output folder.
        repo_id: the Hub repository to push to; None splits only.
        options, key, token, cache, **shorthands: as for :func:`shardkit.split`.
        create_pr: open a pull request instead of committing to main.
        push_progress: ``(done_bytes, total_bytes)`` of the upload.
        after_split: called with the split's result before the push starts.

    shardkit.split_and_push("model.safetensors", "out/", "org/model", options=WriteOptions(max_shard_bytes=2 * 10**9))
    """
    from ..sharding.split import split_with
    from .sources import opened

    options = WriteOptions.build(options, shorthands, where="split_and_push()")
    if repo_id:  # only a push imports hub/
        from ..hub.preflight import check_folder_links, check_push_target, check_repo_id

        check_repo_id(repo_id) if options.dry_run else check_push_target(repo_id, token=token)
        if not is_store_url(output):
            check_folder_links(output)
    with opened(source, token=token, cache=cache) as readable:
        if is_store_url(output) and (copied := copy_split(source, readable, output, options=options, key=key)):
            result = copied  # S3 to S3, bytes kept: composed by copies inside the store (api/store_copy.py)
        elif is_store_url(output):  # streamed into the store, or staged for one file (api/store_writes.py)
            result = write_to_store(output, lambda out, tick: split_with(
                readable, out, options=dataclasses.replace(options, overwrite=False, progress=tick), key=key),
                overwrite=options.overwrite, dry_run=options.dry_run, progress=options.progress)
        else:
            result = split_with(readable, output, options=options, key=key)
    if after_split is not None:
        after_split(result)
    if not repo_id or options.dry_run:
        return SplitAndPush(result)
    from .jobs import push  # an s3:// output is pushed from the bucket, streamed

    return SplitAndPush(result, push(output, repo_id, token=token, create_pr=create_pr, progress=push_progress))


def info(path: str | os.PathLike[str], *, token: str | None = None) -> CheckpointInfo:
    """:func:`shardkit.checking.info.info`; for a remote location (``hf://``, ``s3://``) from headers, indexes
    and configs only.

    shardkit.info("hf://black-forest-labs/FLUX.1-dev").parameter_count
    """
    from ..checking.info import info as info_local

    if is_remote(path) and path.endswith(".gguf"):  # its header (a split: each part's) fetched, the data a hole
        from ..stores.gguf_fetch import fetched_gguf

        with fetched_gguf(path, token=token, headers_only=True) as local:
            summary = info_local(local)
        summary.path = path
        for shard in summary.shards:
            shard.shared_bytes = None
        summary.shared_bytes = None
        return summary
    if is_remote(path):
        return store_info(path, token=token)
    check_local(path, role="checkpoint")

    return info_local(path)


def _verify_remote_gguf(path: str, *, token: str | None, progress: ProgressCallback | None,
                        read_data: bool) -> VerifyReport:
    """A GGUF in a store, checked as a local one: every part's header, bytes and values (see checking.gguf_verify);
    fetched whole (each file's sha256, the Hub's listed one checked), or with ``read_data=False`` its headers only."""
    from ..checking.verify import verify as verify_local
    from ..stores.gguf_fetch import fetched_gguf

    with fetched_gguf(path, token=token, headers_only=not read_data) as local:
        report = verify_local(local, progress=progress, read_data=read_data)
    report.path = path
    return report


def verify(path: str | os.PathLike[str], *, against: CheckpointSource | None = None, token: str | None = None,
           progress: ProgressCallback | None = None, read_data: bool = True) -> VerifyReport:
    """Check a checkpoint: structure, every byte, and with ``against`` every tensor; either may be remote.

    ``verify("hf://...")`` or ``verify("s3://...")`` checks the folder's structure without tensor data (a ``.gguf``
    file there is fetched whole and checked as a local one, a split's every part);
    ``verify(folder, against="hf://...")`` compares by the digests the Hub lists, then tensor by
    tensor; any other remote side is read whole by ranged reads and compared tensor by tensor.
    ``progress`` and ``read_data`` are as for :func:`shardkit.checking.verify.verify`.

    shardkit.verify("out/", against="hf://org/model").ok
    """
    from .store_verify import verify_against_listing, verify_structure

    if is_remote(path) and path.endswith(".gguf") and against is None:  # fetched whole (a split: every part)
        return _verify_remote_gguf(path, token=token, progress=progress, read_data=read_data)
    if is_remote(path) and against is None:
        return verify_structure(path, token=token)
    if not is_remote(path) and lists_digests(against):
        return verify_against_listing(os.fspath(path), against, token=token)
    from ..checking.verify import verify as verify_local

    if is_remote(path) or is_remote(against):  # every byte of a remote side read by ranged reads
        from .sources import opened

        with opened(against, token=token, cache=False) if is_remote(against) else nullcontext(against) as reference, \
                store_checkpoint(path, side_files=True, token=token) if is_remote(path) else nullcontext(path) as checked:
            report = verify_local(checked, against=reference, progress=progress)
        report.path = os.fspath(path)
        if is_remote(against):
            report.against = against
        return report
    check_local(path, role="checkpoint")
    check_local(against, role="reference")
    return verify_local(path, against=against, progress=progress, read_data=read_data)


def describe_remote_report(report: VerifyReport) -> str | None:
    """The one-line summary of a check decided from a listing (what ``shardkit verify`` prints), else None."""
    from .store_verify import describe

    return describe(report)
