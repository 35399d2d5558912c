"""shardkit: stream large checkpoints into size-bounded safetensors shards, and load them lazily.

``import shardkit`` stays light: torch, diffusers and huggingface_hub are imported only by the
functions that need them.

>>> import shardkit
>>> shardkit.split("model.safetensors", "out/", max_shard_size="5GB")  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import (
    CheckpointIndexError,
    HeaderError,
    HubError,
    InvalidInputError,
    InvalidSizeError,
    KeyMismatchError,
    OutputExistsError,
    ShardkitError,
    ShardkitWarning,
    ShardkitWriteError,
    SourceNotFoundError,
    UnsafePickleError,
    VerificationError,
)
from .units import format_size, parse_size

__version__ = "0.1.0"

# Public name → module that defines it; resolved on first access so imports stay cheap.
_LAZY: dict[str, str] = {
    "split": "hub.api",
    "save_sharded": "distributed.save",
    "load_into": "distributed.rank_load",
    "SplitResult": "sharding.job",
    "WriteOptions": "sharding.options",
    "plan_shards": "sharding.plan",
    "read_header": "formats.header",
    "open_source": "sources",
    "open": "loading.lazy",
    "load_model": "loading.load",
    "plan_device_map": "loading.device_map",
    "convert": "hub.api",
    "merge": "sharding.merge",
    "info": "hub.api",
    "verify": "hub.api",
    "push": "hub.push",
    "apply_offload": "runtime.offload",
    "apply_layerwise_casting": "runtime.casting",
    "estimate_memory": "fitting.estimate",
    "load_pipeline": "fitting.pipeline",
    "fit": "fitting.autofit",
}

__all__ = sorted([*_LAZY, "parse_size", "format_size", "ShardkitError", "__version__"])


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shardkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
