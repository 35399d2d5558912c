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
    "split": "reshard",
    "save_sharded": "reshard",
    "SplitResult": "reshard",
    "plan_shards": "plan",
    "read_header": "format",
    "open_source": "sources",
    "open": "lazy",
    "load_model": "load",
    "plan_device_map": "placement",
    "convert": "conversion",
    "merge": "merging",
    "info": "inspect",
    "verify": "verification",
    "push": "hub",
    "apply_offload": "offload",
    "apply_layerwise_casting": "casting",
    "estimate_memory": "estimate",
    "load_pipeline": "pipeline",
    "fit": "autofit",
}

__all__ = sorted([*_LAZY, "parse_size", "format_size", "ShardkitError", "__version__"])


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shardkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
