"""``split``/``convert`` into ``s3://BUCKET/PREFIX``, and ``recover`` of such a prefix.

The job is handed a placeholder path in a local staging folder, bound to the store
(:func:`~shardkit.sharding.outputs.bind_output`): a job that writes through
:func:`~shardkit.sharding.job.run_jobs` (split, convert, save_sharded, pipeline folders,
``--to diffusers``) streams every shard straight into the store
(:mod:`shardkit.sharding.store_output`), with no local copy. A job that writes its file itself
(``--to gguf``, an output naming one ``.safetensors`` file) writes it into the staging folder,
and its files are then streamed into a
:class:`~shardkit.stores.transaction.StoreTransaction` (8 MiB reads, multipart parts of 16 MiB, at
most 3 in flight), indexes last. The staging folder is removed on every path.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import TypeVar

from .. import _faults
from ..atomic.journal import Recovery
from ..errors import Option, OutputExistsError
from ..sharding.job import SplitResult
from ..sharding.merge import MergeResult
from ..sharding.options import ProgressCallback
from ..sharding.outputs import BoundOutput, bind_output
from ..sharding.store_output import file_chunks, store_output
from ..stores import ObjectStore, StoreUrl, is_store_url, open_store, parse_store_url
from ..stores.transaction import StoreTransaction, recover_store

__all__ = ["recover_prefix", "shown_path", "write_to_store"]



def _split_url(output: str) -> tuple[StoreUrl, str]:
    """The store folder and the local name of the output: ``s3://b/p/model.safetensors`` (or ``.gguf``) is a file in
    ``s3://b/p``."""
    url = parse_store_url(output)
    if url.prefix.endswith((".safetensors", ".gguf")):
        folder, _, name = url.prefix.rpartition("/")
        return dataclasses.replace(url, prefix=folder), name
    return url, "out"


Written = TypeVar("Written", SplitResult, MergeResult)  # what a job returns; its ``output`` is replaced


def write_to_store(output: str, job: Callable[[str, ProgressCallback | None], Written], *,
                   overwrite: bool = False, dry_run: bool = False,
                   progress: ProgressCallback | None = None) -> Written:
    """Run ``job(path, progress)`` with ``path`` bound to ``output`` (``s3://...``): streamed, or staged then uploaded.

    The prefix is checked first (bucket, credentials, and ``overwrite`` when it holds objects), so
    a refusal costs no split. ``progress`` sees one bar over the bytes written; a staged job's
    shows the job as the first half and the upload as the second. The result names ``output``.
    """
    url, local_name = _split_url(output)
    staging = tempfile.mkdtemp(prefix="shardkit-s3-out-")
    try:
        with open_store(url) as store:
            if not overwrite and store.list_objects():
                raise OutputExistsError(f"{url}: the prefix already holds objects; pass ", Option("overwrite", True),
                                        " to "
                                        "replace the checkpoint there")
            local = os.path.join(staging, local_name)
            with bind_output(local, store_output(store, overwrite=overwrite), target=str(url)) as bound:
                phases = _Phases(progress, bound)
                result = job(local, phases.job if progress else None)
            if not dry_run and not bound.used:  # a split GGUF's files are beside the name given: all of staging
                _upload(store, local if os.path.exists(local) else staging, overwrite=overwrite, progress=phases.upload)
        shown = {os.path.abspath(local): output, os.path.abspath(staging): str(url)}  # a file's folder: the store's
        return dataclasses.replace(result, output=shown.get(os.path.abspath(result.output), output))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


class _Phases:
    """One ``(done, total)`` bar: a streamed job's own; a staged job's as two halves (the job, then the upload)."""

    def __init__(self, progress: ProgressCallback | None, bound: BoundOutput) -> None:
        self._progress = progress or (lambda done, total: None)
        self._bound = bound
        self._total = 0

    def job(self, done: int, total: int) -> None:
        self._total = total
        self._progress(done if self._bound.used else done // 2, total)

    def upload(self, done: int, total: int) -> None:
        if self._total:
            self._progress(self._total // 2 + done * (self._total - self._total // 2) // max(total, 1), self._total)


def _upload(store: ObjectStore, local: str, *, overwrite: bool, progress: ProgressCallback) -> None:
    files = _local_files(local)
    total_bytes, sent_bytes = sum(os.path.getsize(p) for p in files.values()), 0

    def tick(nbytes: int) -> None:
        nonlocal sent_bytes
        sent_bytes += nbytes
        progress(sent_bytes, total_bytes)

    with StoreTransaction(store, list(files), overwrite=overwrite) as tx:
        for name, path in files.items():
            tx.stream(name, _chunks(path, tick, label=f"store:sent:{name}:"))
        tx.commit()


def _local_files(local: str) -> dict[str, str]:
    """Every file the job wrote: name relative to the output folder ('/'-separated) → local path."""
    if os.path.isfile(local):
        return {os.path.basename(local): local}
    found: dict[str, str] = {}
    for root, _dirs, names in os.walk(local):
        for name in names:
            path = os.path.join(root, name)
            found[os.path.relpath(path, local).replace(os.sep, "/")] = path
    return found


def _chunks(path: str, tick: Callable[[int], None], *, label: str) -> Iterator[bytes]:
    """The file's bytes, 8 MiB at a time, the count checked against its size."""
    done = 0
    for chunk in file_chunks(path):
        done += len(chunk)
        yield chunk
        _faults.point(f"{label}{done}")  # the chunk is in the writer (a part sent at each 16 MiB)
        tick(len(chunk))


def shown_path(path: str) -> str:
    """A path as messages show it: an ``s3://`` URL as given, a local one absolute."""
    return path if is_store_url(path) else os.path.abspath(path)


def recover_prefix(output: str) -> Recovery:
    """Abort the multipart uploads and delete the unpublished objects of killed writes in a store's folder
    (``s3://...``; a read-only store such as ``hf://`` has none, and is reported consistent)."""
    url = _split_url(output)[0] if is_store_url(output) else output
    with open_store(url) as store:
        return Recovery(str(store.url), removed=recover_store(store))
