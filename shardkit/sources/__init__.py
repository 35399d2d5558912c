"""Input kinds. Each opener returns a :class:`Source`; :func:`open_source` picks one by a table.

To add a kind, write ``sources/<kind>.py`` with an opener and add a row to ``_PATH_OPENERS``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ..errors import InvalidInputError, SourceNotFoundError
from ..stores.urls import check_local
from .base import CheckpointSource, Source
from .ranged import RangedCheckpoint

__all__ = ["RangedCheckpoint", "Source", "is_dcp_folder", "is_pickle_index_folder", "open_source"]


def _is_safetensors_file(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".safetensors")


def _is_safetensors_index(path: str) -> bool:
    return os.path.isfile(path) and ".safetensors.index" in os.path.basename(path) and path.endswith(".json")


def _is_pickle_file(path: str) -> bool:
    from ..formats.suffixes import PICKLE_SUFFIXES

    return os.path.isfile(path) and path.endswith(PICKLE_SUFFIXES)


def _is_safetensors_folder(path: str) -> bool:
    from .safetensors import has_safetensors

    return os.path.isdir(path) and has_safetensors(path)


def _open_safetensors_file(path: str, **_: object) -> Source:
    from .safetensors import open_safetensors_file

    return open_safetensors_file(path)


def _open_safetensors_index(path: str, **_: object) -> Source:
    from .safetensors import open_safetensors_index

    return open_safetensors_index(path)


def _open_safetensors_folder(path: str, *, variant: str | None = None, **_: object) -> Source:
    from .safetensors import open_safetensors_folder

    return open_safetensors_folder(path, variant=variant)


def _open_pickle(path: str, *, key: str | None = None, **_: object) -> Source:
    from .pickle import open_pickle

    return open_pickle(path, key=key)


def _is_pickle_index(path: str) -> bool:
    from .pickle_index import is_pickle_index

    return is_pickle_index(path)


def _open_pickle_index(path: str, *, key: str | None = None, **_: object) -> Source:
    from .pickle_index import open_pickle_index

    return open_pickle_index(path, key=key)


def is_dcp_folder(path: str) -> bool:
    from .dcp import is_dcp_folder

    return is_dcp_folder(path)


def _open_dcp(path: str, *, key: str | None = None, **_: object) -> Source:
    from .dcp import open_dcp

    return open_dcp(path, key=key)


def is_pickle_index_folder(path: str) -> bool:
    from .pickle_index import find_pickle_index

    return os.path.isdir(path) and find_pickle_index(path) is not None


def _open_pickle_index_folder(path: str, *, key: str | None = None, **_: object) -> Source:
    from .pickle_index import find_pickle_index, open_pickle_index

    index = find_pickle_index(path)
    if index is None:
        raise SourceNotFoundError(f"{path}: no pytorch_model.bin.index.json in this folder")
    return open_pickle_index(index, key=key, inside=path)  # found in the folder: its boundary applies


def _is_single_pickle_folder(path: str) -> bool:
    from .pickle_index import find_single_pickle

    return find_single_pickle(path) is not None


def _open_single_pickle_folder(path: str, *, key: str | None = None, **_: object) -> Source:
    from .pickle import open_pickle
    from .pickle_index import find_single_pickle

    single = find_single_pickle(path)
    if single is None:
        raise SourceNotFoundError(f"{path}: no pytorch_model.bin in this folder")
    return open_pickle(single, key=key, inside=path)  # found in the folder: its boundary applies


def _is_gguf_file(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def _open_gguf(path: str, **_: object) -> Source:
    from .gguf import open_gguf

    return open_gguf(path)


# (test, opener, description) rows, tried in order.
_PATH_OPENERS: list[tuple[Callable[[str], bool], Callable[..., Source], str]] = [
    (_is_safetensors_file, _open_safetensors_file, "a .safetensors file"),
    (_is_safetensors_index, _open_safetensors_index, "a .safetensors.index.json file"),
    (_is_pickle_index, _open_pickle_index, "a pytorch_model.bin.index.json file"),
    (_is_pickle_file, _open_pickle, "a .bin/.pt/.pth/.ckpt pickle"),
    (_is_gguf_file, _open_gguf, "a .gguf file (llama.cpp, ComfyUI-GGUF)"),
    (is_dcp_folder, _open_dcp, "a torch.distributed.checkpoint folder"),
    (_is_safetensors_folder, _open_safetensors_folder, "a folder with safetensors weights"),
    (is_pickle_index_folder, _open_pickle_index_folder, "a folder with pytorch_model.bin.index.json"),
    (_is_single_pickle_folder, _open_single_pickle_folder, "a folder with one pytorch_model.bin"),
]


def open_source(obj: CheckpointSource, *, key: str | None = None, variant: str | None = None) -> Source:
    """Open any supported input: a path (file, index, folder), a state dict or an ``nn.Module``.

    Paths are recognised by the first matching row of ``_PATH_OPENERS``: a ``.safetensors``
    file or index, a ``pytorch_model.bin`` index, a pickle (``.bin``/``.pt``/``.pth``/``.ckpt``,
    loaded with ``weights_only=True``), a ``torch.distributed.checkpoint`` folder, or a folder
    holding one of these. The files are opened as one consistent snapshot even while another
    process rewrites the folder. The one interrupted-write policy of every reader: a folder
    another shardkit process is committing into is waited for; one a crashed shardkit write left
    pending is refused with one line naming ``shardkit recover`` and never modified (only that
    command, or a write into that same folder, rolls it forward). A :class:`Source` passed in is
    returned as is.

    Args:
        obj: a path, a :class:`Source`, a state dict (``name → tensor``), an ``nn.Module``, or a
            :class:`~shardkit.sources.ranged.RangedCheckpoint` (a local folder of headers whose
            tensor bytes are read by range, e.g. from ``hf://``).
        key: for pickles and DCP folders, the entry of the loaded dict that holds the state
            dict (``"/"`` reaches nested dicts, e.g. ``"model/ema"``); None unwraps a top-level
            ``state_dict`` / ``model`` / ``module`` / ``model_state_dict`` dict when there is one.
        variant: for safetensors folders, the weight variant (``"fp16"`` for
            ``model.fp16.safetensors``).

    Returns:
        An open :class:`Source`; use it as a context manager, or call ``close()``.

    Raises:
        SourceNotFoundError: the path does not exist, or the folder holds no checkpoint.
        InvalidInputError: the file is of an unsupported kind, or its contents are unusable
            (``HeaderError``, ``CheckpointIndexError``, ``UnsafePickleError`` are subclasses).

    with open_source("model.safetensors") as src:
        print(len(src.entries()))
    """
    if isinstance(obj, Source):
        return obj
    from .ranged import read_by_range

    if isinstance(obj, RangedCheckpoint):  # headers here, tensor bytes by range from elsewhere (hf://)
        return read_by_range(open_source(obj.path, key=key, variant=variant), obj)
    if not isinstance(obj, (str, os.PathLike)):
        from .memory import MemorySource, module_state_dict

        return MemorySource(module_state_dict(obj))
    path = os.fspath(obj)
    check_local(path, role="source")  # a scheme:// here is no local path (hf:// is opened by shardkit.api)
    if not os.path.exists(path):
        raise SourceNotFoundError(f"{path}: no such file or folder")
    from ..atomic.snapshot import read_consistently

    # A consistent snapshot even while another process rewrites the folder (see shardkit.atomic.commit).
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    only = None if os.path.isdir(path) or path.endswith(".json") else os.path.basename(path)  # one file: watch it alone
    return read_consistently(folder, lambda: _open_path(path, key=key, variant=variant), only=only)


def _open_path(path: str, *, key: str | None, variant: str | None) -> Source:
    for test, opener, _ in _PATH_OPENERS:
        if test(path):
            return opener(path, key=key, variant=variant)
    kinds = "; ".join(desc for _, _, desc in _PATH_OPENERS)
    if os.path.isdir(path):
        raise SourceNotFoundError(f"{path}: no checkpoint found in this folder (expected {kinds})")
    raise InvalidInputError(f"{path}: unsupported checkpoint file (expected {kinds})")
