"""``info`` and ``verify`` of an ``s3://BUCKET/PREFIX`` checkpoint, from its headers, indexes and configs only.

A header-only mirror (:func:`shardkit.stores.mirror.build_header_mirror`) in a temporary folder
gives the local ``info``/``verify`` everything they check: every header, the index, the manifest,
the configs and each object's true size. Tensor bytes are never fetched: a sharded checkpoint costs
one 64 KiB ranged GET per shard plus its small JSON files. Errors name the URL, not the
temporary folder.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator

from ..checking.info import CheckpointInfo
from ..checking.verify import VerifyReport
from ..errors import InvalidInputError
from ..formats.names import is_config_file
from ..formats.suffixes import MANIFEST_FILE
from ..stores import list_folder, open_store, parse_store_url
from ..stores.mirror import HeaderMirror, build_header_mirror

__all__ = ["store_info", "store_mirror", "store_verify"]

logger = logging.getLogger("shardkit")


def _is_small_side_file(name: str) -> bool:
    """Configs, indexes and the integrity manifest: what the checks read besides the headers."""
    return is_config_file(name) or name.rpartition("/")[2] == MANIFEST_FILE


@contextlib.contextmanager
def store_mirror(path: str) -> Iterator[HeaderMirror]:
    """The header-only mirror of ``s3://BUCKET/PREFIX`` in a temporary folder, removed on exit."""
    from ..hub.remote import renamed_errors

    url = parse_store_url(path)
    tmp = tempfile.mkdtemp(prefix="shardkit-s3-")
    root = os.path.join(tmp, url.bucket)
    try:
        os.mkdir(root)
        with open_store(url) as store:
            mirror = build_header_mirror(store, root, list_folder(store), whole=_is_small_side_file)
        logger.debug("%s: header-only mirror, %d bytes fetched", url, mirror.fetched_bytes)
        with renamed_errors(root, str(url)):
            yield mirror
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def store_info(path: str) -> CheckpointInfo:
    """:func:`shardkit.info` of ``s3://BUCKET/PREFIX`` from its headers; ``shared_bytes`` are None."""
    from ..checking.info import info

    with store_mirror(path) as mirror:
        summary = info(mirror.root)
        summary.path = str(parse_store_url(path))
        for part in [summary, *summary.components.values()]:
            part.shared_bytes = None
            for shard in part.shards:
                shard.shared_bytes = None
        return summary


def store_verify(path: str, *, against: object = None) -> VerifyReport:
    """The structure of ``s3://BUCKET/PREFIX`` checked without tensor data (index against headers and sizes)."""
    from ..checking.verify import verify

    if against is not None:
        raise InvalidInputError(f"{path}: against= with an s3:// checkpoint is not supported yet; "
                                "verify it alone, or a local copy against the reference")
    with store_mirror(path) as mirror:
        report = verify(mirror.root, read_data=False)
        report.path = str(parse_store_url(path))
        return report
