"""The Hub's cache as an option of reading ``hf://``: a folder (or one file) downloaded into the Hugging Face cache.

By default ``split``/``convert`` of ``hf://ORG/REPO[@REV][/SUBFOLDER]`` read the repository through
the Hugging Face cache (``snapshot_download``, ``hf_hub_download`` for one file), so a later
``from_pretrained`` reuses the files, and the writers run on the cached folder as on any local
one. Pickle, Flax, TF, ONNX and GGUF weights are never downloaded implicitly: a folder holding
pickle weights only is refused unless the caller asked for pickles (``convert``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

from ..errors import InvalidInputError
from ..formats.suffixes import CHECKPOINT_SUFFIXES, PICKLE_SUFFIXES
from .hf import HfStore, read_call
from .hf_errors import hub_errors
from .hf_spec import RemoteSpec, parse_spec
from .mirror import check_not_pickle_only, renamed_errors

__all__ = ["NOT_DOWNLOADED", "cached_configs", "cached_folder", "names_a_file"]

# Weight formats never mirrored or downloaded implicitly: pickles (safety), Flax, TF, ONNX, GGUF (not torch).
NOT_DOWNLOADED = (*(f"*{suffix}" for suffix in PICKLE_SUFFIXES), "*.msgpack", "*.h5", "*.onnx", "*.gguf", "*.ot")


@contextlib.contextmanager
def cached_folder(path: str, *, token: str | None = None, pickles: bool = False) -> Iterator[str]:
    """``hf://...``'s folder (or file) in the Hugging Face cache, downloaded first.

    The safetensors weights, configs and other files (tokenizers, schedulers) are downloaded with
    ``snapshot_download``; the formats of :data:`NOT_DOWNLOADED` are not. A folder with pickle
    weights only is refused, unless ``pickles``. A spec ending in a checkpoint file name downloads
    that file alone.

    with cached_folder("hf://org/model") as folder:
        shardkit.split(folder, "out/", max_shard_size="2GB")
    """
    spec = parse_spec(path)

    def ignore(store: HfStore) -> list[str]:
        try:
            check_not_pickle_only(store, store.list_objects(), download=store.download_command)
        except InvalidInputError:
            if not pickles:
                raise
            return [p for p in NOT_DOWNLOADED if not p.endswith(PICKLE_SUFFIXES)]
        return list(NOT_DOWNLOADED)

    with _in_cache(spec, token=token, one_file=names_a_file(spec), ignore=ignore) as root:
        yield root


@contextlib.contextmanager
def cached_configs(path: str, *, token: str | None = None) -> Iterator[str]:
    """``hf://...``'s configs, tokenizers and schedulers in the HF cache (never its weights).

    What ``convert(..., to="diffusers", config="hf://...")`` reads; a spec ending in a ``.json``
    file downloads that file alone.
    """
    spec = parse_spec(path)
    with _in_cache(spec, token=token, one_file=spec.subfolder.endswith(".json"),
                   ignore=lambda store: ["*.safetensors", *NOT_DOWNLOADED]) as root:
        yield root


@contextlib.contextmanager
def _in_cache(spec: RemoteSpec, *, token: str | None, one_file: bool,
              ignore: Callable[[HfStore], list[str]]) -> Iterator[str]:
    """``spec``'s file (``one_file``) or folder in the HF cache, downloaded at the commit its revision
    names now; ``ignore(store)`` gives the folder download's ignore patterns. Errors raised inside
    name ``spec``, not the cache."""
    from huggingface_hub import hf_hub_download, snapshot_download

    with hub_errors(read_call(spec)):
        if one_file:
            from huggingface_hub import HfApi

            from .hf import resolve_commit

            commit = resolve_commit(HfApi(token=token), spec)
            root = hf_hub_download(spec.repo_id, spec.subfolder, revision=commit, token=token, repo_type=spec.repo_type)
        else:
            store = HfStore(spec, token=token)
            allow = [f"{spec.subfolder}/*"] if spec.subfolder else None
            snapshot = snapshot_download(spec.repo_id, revision=store.commit, token=token, allow_patterns=allow,
                                         ignore_patterns=ignore(store), repo_type=spec.repo_type)
            root = os.path.join(snapshot, *spec.subfolder.split("/")) if spec.subfolder else snapshot
    with renamed_errors(root, str(spec)):
        yield root


def names_a_file(spec: RemoteSpec | str) -> bool:
    """``hf://org/repo/sd_xl_base_1.0.safetensors``: the path's last part is a checkpoint file name."""
    spec = parse_spec(spec) if isinstance(spec, str) else spec
    return spec.subfolder.endswith(CHECKPOINT_SUFFIXES)
