"""File-name suffixes of checkpoint files: kept as a name for :mod:`shardkit.formats.names`, which holds the rules.

>>> is_weight_file("model-00001-of-00002.safetensors"), is_weight_file("config.json")
(True, False)
>>> is_index_file("diffusion_pytorch_model.fp16.safetensors.index.json")
True
>>> is_manifest_file("shardkit.manifest.json"), is_weight_file("shardkit.manifest.json")
(True, False)
"""

from __future__ import annotations

from .names import (
    CHECKPOINT_SUFFIXES,
    DCP_DATA_SUFFIX,
    DCP_METADATA,
    MANIFEST_FILE,
    PICKLE_SUFFIXES,
    SAFETENSORS_SUFFIX,
    SAVED_WEIGHT_SUFFIXES,
    is_index_file,
    is_manifest_file,
    is_saved_weight_file,
    is_weight_file,
)

__all__ = ["CHECKPOINT_SUFFIXES", "DCP_DATA_SUFFIX", "DCP_METADATA", "MANIFEST_FILE", "PICKLE_SUFFIXES",
           "SAFETENSORS_SUFFIX", "SAVED_WEIGHT_SUFFIXES", "is_index_file", "is_manifest_file",
           "is_saved_weight_file", "is_weight_file"]
