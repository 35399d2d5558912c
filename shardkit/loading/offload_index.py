"""Disk offload without a second copy of the weights.

accelerate reads disk-offloaded weights through an ``index.json`` in the offload folder. Its
entries may point into an existing safetensors file (``safetensors_file`` + ``weight_name``)
instead of a ``.dat`` copy, so when the checkpoint already holds a tensor in the dtype the model
needs, the index points at the shard; only tensors that need a dtype change are written out.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

from ..errors import ShardkitWriteError

if TYPE_CHECKING:
    import torch

    from .lazy import LazyCheckpoint

INDEX_NAME = "index.json"
# accelerate's offload index: tensor name → {"safetensors_file", "weight_name", "dtype", "shape"} or
# {"dtype", "shape"} for a tensor accelerate wrote itself (``offload_weight``).
OffloadIndex: TypeAlias = "dict[str, dict[str, object]]"


@dataclass(frozen=True)
class DiskTensor:
    """A model tensor that lives on disk: its checkpoint name (None: not in the checkpoint), dtype, shape."""

    name: str
    source: str | None
    dtype: torch.dtype
    shape: tuple[int, ...]


def write_offload_index(checkpoint: LazyCheckpoint, tensors: list[DiskTensor], folder: str) -> OffloadIndex:
    """Write ``folder/index.json`` for ``tensors`` and return the index accelerate expects.

    index = write_offload_index(ckpt, [DiskTensor("up.0.weight", "up.0.weight", torch.float16, (4, 4))],
                                "offload/")
    index["up.0.weight"]["safetensors_file"]
    '/abs/path/diffusion_pytorch_model-00002-of-00002.safetensors'
    """
    import torch
    from accelerate.utils import offload_weight

    from ..formats.dtypes import to_torch

    os.makedirs(folder, exist_ok=True)
    index: OffloadIndex = {}
    for tensor in tensors:
        entry = checkpoint.entry(tensor.source) if tensor.source is not None else None
        if entry is not None and entry.file is not None and to_torch(entry.dtype) == tensor.dtype \
                and not checkpoint.is_ranged(entry.name):  # a remote object's local file is a header only
            index[tensor.name] = {
                "safetensors_file": os.path.abspath(entry.file),
                "weight_name": tensor.source,
                "dtype": str(tensor.dtype).removeprefix("torch."),
                "shape": list(entry.shape),
            }
            continue
        if tensor.source is not None:
            value = checkpoint.get_tensor(tensor.source, dtype=tensor.dtype, copy=True)
        else:
            value = torch.zeros(tensor.shape, dtype=tensor.dtype)
        try:
            offload_weight(value, tensor.name, folder, index=index)
        except OSError as e:
            raise ShardkitWriteError(f"{folder}: cannot write offloaded tensor {tensor.name!r} ({e})") from e
    _publish_json(os.path.join(folder, INDEX_NAME), index)
    return index


def _publish_json(path: str, doc: OffloadIndex) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise ShardkitWriteError(f"{path}: cannot write the offload index ({e})") from e
