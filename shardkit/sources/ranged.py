"""A checkpoint whose tensor bytes are read by range from elsewhere: a :class:`RangedCheckpoint`.

A remote repository (``hf://``; next ``s3://``) is split, converted or verified without a local
copy: a local folder holds what the readers validate (headers, indexes, configs; for ``hf://`` the
header-only mirror), and each safetensors file's tensor bytes come from a
:class:`~shardkit.formats.ranges.RangeFile` over the remote object. :func:`shardkit.sources.open_source`
opens one like any checkpoint path and reads its tensors through the shared readers
(:mod:`shardkit.reading`), so the writer sees an ordinary source that cannot be copied kernel-side.

    with open_mirror(spec) as mirror, MirrorStreams(mirror) as streams:
        ckpt = RangedCheckpoint(mirror.root, streams.open_file, name=str(spec))
        shardkit.split(ckpt, "out/")
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ..errors import InvalidInputError
from ..formats.ranges import RangeFile

if TYPE_CHECKING:
    from .base import Source

__all__ = ["OpenRangeFile", "RangedCheckpoint", "beneath", "shown"]

OpenRangeFile = Callable[[str], RangeFile]  # a local safetensors path → the object holding its real bytes


@dataclass(frozen=True)
class RangedCheckpoint:
    """A checkpoint path whose safetensors files' bytes are read through :class:`RangeFile` objects.

    Attributes:
        path: the local file or folder the readers open and validate (headers, indexes, side files).
        open_file: a safetensors file's local path → its :class:`RangeFile` (raises a one-line
            :class:`~shardkit.errors.ShardkitError` for a file it cannot serve).
        name: what messages and results call ``root`` (``hf://org/repo``), never a temporary folder.
        read_ahead: False where the :class:`RangeFile` reads ahead itself and wants requests one at a
            time, in file order (an ``hf://`` stream hashes each file as it passes).
        root: the folder ``name`` stands for (``path`` itself unless this is a part of it).
    """

    path: str
    open_file: OpenRangeFile
    name: str = ""
    read_ahead: bool = True
    root: str = field(default="")

    def __post_init__(self) -> None:
        if not self.root:
            object.__setattr__(self, "root", self.path)

    def __fspath__(self) -> str:
        return self.path

    def __str__(self) -> str:
        return shown(self)


def beneath(source: str | os.PathLike[str], path: str) -> str | RangedCheckpoint:
    """``path`` (a file or folder inside ``source``) read the way ``source`` is: by range when it is a
    :class:`RangedCheckpoint`, else the path itself.

    >>> beneath("pipe/", "pipe/unet")
    'pipe/unet'
    """
    return replace(source, path=path) if isinstance(source, RangedCheckpoint) else path


def shown(source: object) -> str:
    """What messages call ``source``: a :class:`RangedCheckpoint`'s ``name`` in place of its local root.

    >>> shown("ckpt/")
    'ckpt/'
    """
    if isinstance(source, RangedCheckpoint):
        return source.path.replace(source.root, source.name, 1) if source.name else source.path
    return os.fspath(source) if isinstance(source, (str, os.PathLike)) else f"a {type(source).__name__}"


def read_by_range(source: Source, checkpoint: RangedCheckpoint) -> Source:
    """``source`` (opened on ``checkpoint.path``) reading its tensor bytes through ``checkpoint``'s
    :class:`RangeFile` objects; closed if that fails. Only safetensors weights can be read by range."""
    from .safetensors import SafetensorsSource

    try:
        if not isinstance(source, SafetensorsSource):
            raise InvalidInputError(f"{shown(checkpoint)}: holds {source.description.replace(checkpoint.root, '')}, "
                                    "not safetensors weights; only safetensors files are read by range (read it "
                                    "through a local copy instead)")
        source.read_through(checkpoint.open_file, read_ahead=checkpoint.read_ahead)
        if checkpoint.name:
            source.description = source.description.replace(checkpoint.root, checkpoint.name)
    except BaseException:
        source.close()
        raise
    return source
