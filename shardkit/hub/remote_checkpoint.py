"""A Hub repository as the input of ``split`` and ``convert``: through the HF cache, or streamed.

:func:`open_checkpoint` turns ``hf://ORG/REPO[@REV][/SUBFOLDER]`` into what the local writers
take, a path or a :class:`~shardkit.sources.ranged.RangedCheckpoint`:

- by default the files are downloaded into the Hugging Face cache (``snapshot_download``,
  ``hf_hub_download`` for one file), so a later ``from_pretrained`` reuses them, and the
  writers run on the cached folder as on any local one;
- with ``cache=False`` nothing goes to the cache: a mirror holds the real headers, indexes and
  side files, and its safetensors files' tensor bytes are read by range requests
  (:class:`~shardkit.hub.remote_stream.MirrorStreams`, one RangeFile per file) straight into the
  shards: the writers see an ordinary source.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import InvalidInputError
from ..formats.layout import MODEL_INDEX
from ..formats.suffixes import CHECKPOINT_SUFFIXES, PICKLE_SUFFIXES
from ..sources.ranged import RangedCheckpoint
from .remote import (
    NOT_DOWNLOADED,
    check_not_pickle_only,
    list_files,
    open_mirror,
    renamed_errors,
    resolve_commit,
)
from .remote_errors import hub_read_errors
from .remote_spec import Mirror, RemoteSpec, is_remote, parse_spec

__all__ = ["cached_checkpoint", "config_source", "open_checkpoint"]


@contextlib.contextmanager
def open_checkpoint(path: Any, *, token: str | None = None, cache: bool = True,
                    pickles: bool = False) -> Iterator[str | RangedCheckpoint]:
    """``path`` for the local writers; for ``hf://...`` its cached copy, or a mirror streamed from the Hub.

    Args:
        path: anything ``split``/``convert`` take (passed through unchanged), or
            ``hf://ORG/REPO[@REVISION][/SUBFOLDER or /FILE]``.
        token: a Hub token; default ``HF_TOKEN`` or the stored login.
        cache: download through the Hugging Face cache (default); False streams the tensor bytes
            by range reads into the output, with bounded memory and no cache copy.
        pickles: download pickle weights of a folder that has no safetensors (``convert``: the
            user asked for that repository); never with ``cache=False``.

    Returns:
        A context manager yielding what ``split``/``convert`` take as their source: a local path,
        or a :class:`~shardkit.sources.ranged.RangedCheckpoint` (the mirror, its bytes streamed);
        errors raised inside name ``path``, not the temporary or cached folder.

    with open_checkpoint("hf://org/model", cache=False) as source:
        shardkit.split(source, "out/", max_shard_size="2GB")
    """
    if not is_remote(path):
        if not cache:
            shown = os.fspath(path) if isinstance(path, (str, os.PathLike)) else f"a {type(path).__name__}"
            raise InvalidInputError(f"cache=False applies to an hf://ORG/REPO source, not to {shown}; "
                                    "drop it")
        yield path
        return
    spec = parse_spec(path)
    if cache:
        with cached_checkpoint(spec, token=token, pickles=pickles) as local:
            yield local
        return
    if _names_a_file(spec):
        raise InvalidInputError(f"{spec}: cache=False streams a repository folder; for one file, drop cache=False "
                                f"(or stream its folder: {str(spec).rpartition('/')[0]})")
    from .remote_stream import MirrorStreams

    with open_mirror(spec, token=token, side_files=True) as mirror, MirrorStreams(mirror, token=token) as streams:
        _drop_loose_weights(mirror)
        yield RangedCheckpoint(mirror.root, streams.open_file, name=str(spec), read_ahead=False)


@contextlib.contextmanager
def cached_checkpoint(path: str | RemoteSpec, *, token: str | None = None, pickles: bool = False) -> Iterator[str]:
    """``path`` itself, or for ``hf://...`` its folder (or file) in the Hugging Face cache, downloaded first.

    The safetensors weights, configs and other files (tokenizers, schedulers) are downloaded with
    ``snapshot_download``, so a later ``from_pretrained`` of the repository reuses them; pickle,
    Flax, TF, ONNX and GGUF weights are not. A folder with pickle weights only is refused, unless
    ``pickles``. A spec ending in a checkpoint file name downloads that file alone.

    with cached_checkpoint("hf://org/model") as folder:
        shardkit.split(folder, "out/", max_shard_size="2GB")
    """
    if isinstance(path, str) and not is_remote(path):
        yield path
        return
    spec = parse_spec(path) if isinstance(path, str) else path

    def ignore(api: Any, commit: str) -> list[str]:
        return _not_downloaded(Mirror(spec, "", commit, list_files(api, spec, commit)), pickles=pickles)

    with _in_cache(spec, token=token, one_file=_names_a_file(spec), ignore=ignore) as root:
        yield root


@contextlib.contextmanager
def config_source(path: str | None, *, token: str | None = None) -> Iterator[str | None]:
    """``path`` itself, or for ``hf://...`` its configs, tokenizers and schedulers in the HF cache.

    What ``convert --to diffusers --config`` reads from a pipeline or model repository: every file
    but the weights (no ``.safetensors``, pickle, Flax... file is downloaded). A spec ending in a
    ``.json`` file downloads that file alone.

    with config_source("hf://stable-diffusion-v1-5/stable-diffusion-v1-5") as config:
        shardkit.convert("v1-5.safetensors", "unet/", to="diffusers", config=config)
    """
    if path is None or not is_remote(path):
        yield path
        return
    spec = parse_spec(path)
    with _in_cache(spec, token=token, one_file=spec.subfolder.endswith(".json"),
                   ignore=lambda api, commit: ["*.safetensors", *NOT_DOWNLOADED]) as root:
        yield root


@contextlib.contextmanager
def _in_cache(spec: RemoteSpec, *, token: str | None, one_file: bool,
              ignore: Callable[[Any, str], list[str]]) -> Iterator[str]:
    """``spec``'s file (``one_file``) or folder in the HF cache, downloaded at the commit its revision
    names now; ``ignore(api, commit)`` gives the folder download's ignore patterns. Errors raised
    inside name ``spec``, not the cache."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    with hub_read_errors(spec):
        api = HfApi(token=token)
        commit = resolve_commit(api, spec)
        if one_file:
            root = hf_hub_download(spec.repo_id, spec.subfolder, revision=commit, token=token, repo_type=spec.repo_type)
        else:
            allow = [f"{spec.subfolder}/*"] if spec.subfolder else None
            snapshot = snapshot_download(spec.repo_id, revision=commit, token=token, allow_patterns=allow,
                                         ignore_patterns=ignore(api, commit), repo_type=spec.repo_type)
            root = os.path.join(snapshot, *spec.subfolder.split("/")) if spec.subfolder else snapshot
    with renamed_errors(root, str(spec)):
        yield root


def _drop_loose_weights(mirror: Mirror) -> None:
    """Remove the mirror's stand-ins for safetensors files outside a pipeline's components.

    A pipeline split copies every file that is not a component's weights (a root
    ``v1-5-pruned.safetensors``, a ``vae_1_0/`` folder); in the mirror those are a header and a
    hole, which must never be copied as if they were the file. They are left out, with a warning.
    """
    if MODEL_INDEX not in mirror.files:
        return
    from ..formats.layout import find_components
    from ..sharding.options import warn

    inside = {os.path.realpath(c.path) for c in find_components(mirror.root)}
    loose = sorted(rel for rel, f in mirror.files.items() if f.path in mirror.prefix_bytes
                   and os.path.realpath(os.path.dirname(os.path.join(mirror.root, rel))) not in inside)
    for rel in loose:
        os.remove(os.path.join(mirror.root, *rel.split("/")))
    if loose:
        warn(f"{mirror.spec}: left out {', '.join(loose)} (weights outside the pipeline's components are not "
             "streamed; without cache=False they are copied through the HF cache)")


def _not_downloaded(listing: Mirror, *, pickles: bool) -> list[str]:
    """The ignore patterns: other weight formats, and pickles unless they are all the folder has."""
    try:
        check_not_pickle_only(listing)
    except InvalidInputError:
        if not pickles:
            raise
        return [p for p in NOT_DOWNLOADED if not p.endswith(PICKLE_SUFFIXES)]
    return list(NOT_DOWNLOADED)


def _names_a_file(spec: RemoteSpec) -> bool:
    """``hf://org/repo/sd_xl_base_1.0.safetensors``: the path's last part is a checkpoint file name."""
    return spec.subfolder.endswith(CHECKPOINT_SUFFIXES)
