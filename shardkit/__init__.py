"""shardkit: stream large checkpoints into size-bounded safetensors shards, and load them lazily.

``import shardkit`` stays light: torch, diffusers and huggingface_hub are imported only by the
functions that need them.

import shardkit
shardkit.split("model.safetensors", "out/", max_shard_size="5GB")
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    CheckpointIndexError,
    CopyRefusedError,
    DistributedError,
    FitError,
    HeaderError,
    HubError,
    InvalidInputError,
    InvalidSizeError,
    JournalError,
    KeyMismatchError,
    ManifestError,
    OffloadError,
    Option,
    OutputExistsError,
    OutsideFolderError,
    ShardkitError,
    ShardkitWarning,
    ShardkitWriteError,
    SourceNotFoundError,
    StoreError,
    UnsafePickleError,
    UntrustedFileError,
    VerificationError,
)
from .units import format_size, parse_size

__version__ = "0.1.0"

# Public name → module that defines it; resolved on first access so imports stay cheap.
_LAZY: dict[str, str] = {
    "split": "api.checkpoints",
    "save_sharded": "api.checkpoints",
    "load_into": "api.loading",
    "SplitResult": "api.checkpoints",
    "WriteOptions": "api.options",
    "plan_shards": "api.checkpoints",
    "read_header": "api.checkpoints",
    "open_source": "api.loading",
    "open": "api.loading",
    "load_model": "api.loading",
    "plan_device_map": "api.loading",
    "convert": "api.checkpoints",
    "merge": "api.maintenance",
    "recover": "api.maintenance",
    "info": "api.checkpoints",
    "verify": "api.checkpoints",
    "push": "api.jobs",
    "PushOptions": "api.jobs",
    "split_and_push": "api.checkpoints",
    "apply_offload": "api.loading",
    "apply_layerwise_casting": "api.loading",
    "estimate_memory": "api.loading",
    "load_pipeline": "api.loading",
    "fit": "api.planning",
    "TensorParallelPlan": "api.loading",
    "SliceRule": "api.loading",
    "tensor_parallel_rules": "api.loading",
    "plan_model": "api.planning",
    "write_plan": "api.plans",
    "run_plan": "api.plans",
}

if TYPE_CHECKING:  # what editors and type checkers see; at run time each name is imported on first use
    from .api.checkpoints import (
        SplitResult,
        convert,
        info,
        plan_shards,
        read_header,
        save_sharded,
        split,
        split_and_push,
        verify,
    )
    from .api.jobs import PushOptions, push
    from .api.loading import (
        SliceRule,
        TensorParallelPlan,
        apply_layerwise_casting,
        apply_offload,
        estimate_memory,
        load_into,
        load_model,
        load_pipeline,
        open,  # noqa: A004 - shardkit.open is the public name
        open_source,
        plan_device_map,
        tensor_parallel_rules,
    )
    from .api.maintenance import merge, recover
    from .api.options import WriteOptions
    from .api.planning import fit, plan_model
    from .api.plans import run_plan, write_plan

__all__ = [
    "CheckpointIndexError", "CopyRefusedError", "DistributedError", "FitError", "HeaderError", "HubError",
    "InvalidInputError", "InvalidSizeError", "JournalError", "KeyMismatchError", "ManifestError", "OffloadError",
    "Option", "OutputExistsError", "OutsideFolderError", "ShardkitError", "ShardkitWarning", "ShardkitWriteError",
    "SourceNotFoundError", "StoreError", "UntrustedFileError",
    "PushOptions", "SliceRule", "SplitResult", "TensorParallelPlan", "UnsafePickleError", "VerificationError", "WriteOptions", "__version__", "apply_layerwise_casting",
    "apply_offload", "convert", "estimate_memory", "fit", "format_size", "info", "load_into", "load_model",
    "load_pipeline", "merge", "open", "open_source", "parse_size", "plan_device_map", "plan_model", "plan_shards", "push",
    "read_header", "recover", "run_plan", "save_sharded", "split", "split_and_push", "tensor_parallel_rules", "verify",
    "write_plan",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shardkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
