"""File-name suffixes of checkpoint files, written once: which names hold weights, and of what kind.

>>> is_weight_file("model-00001-of-00002.safetensors"), is_weight_file("config.json")
(True, False)
>>> is_index_file("diffusion_pytorch_model.fp16.safetensors.index.json")
True
>>> is_manifest_file("shardkit.manifest.json"), is_weight_file("shardkit.manifest.json")
(True, False)
"""

from __future__ import annotations

SAFETENSORS_SUFFIX = ".safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
DCP_DATA_SUFFIX = ".distcp"
DCP_METADATA = ".metadata"
# What transformers' and diffusers' save_pretrained write (and so what a component folder may hold).
SAVED_WEIGHT_SUFFIXES = (SAFETENSORS_SUFFIX, ".bin")
# Every file shardkit can read tensors from.
CHECKPOINT_SUFFIXES = (SAFETENSORS_SUFFIX, *PICKLE_SUFFIXES, DCP_DATA_SUFFIX)
# The integrity record shardkit writes beside a checkpoint (formats/manifest.py): neither a weight
# file nor an index, never copied as a side file (each output gets its own).
MANIFEST_FILE = "shardkit.manifest.json"


def is_index_file(name: str) -> bool:
    """``model.safetensors.index.json``, ``pytorch_model.bin.index.json``, with or without a variant.

    Args:
        name: a file name (no folder needed).

    Returns:
        Whether the name is a sharded checkpoint's index file.
    """
    return name.endswith(".json") and ".index" in name and any(s in name for s in SAVED_WEIGHT_SUFFIXES)


def is_weight_file(name: str) -> bool:
    """A file holding tensors (any kind shardkit reads) or the index of a sharded checkpoint.

    Args:
        name: a file name.

    Returns:
        ``True`` for ``.safetensors``, pickles, DCP data files and index files.
    """
    return name.endswith(CHECKPOINT_SUFFIXES) or is_index_file(name)


def is_saved_weight_file(name: str) -> bool:
    """A file ``save_pretrained`` writes for weights: ``.safetensors``, ``.bin`` or their index."""
    return name.endswith(SAVED_WEIGHT_SUFFIXES) or is_index_file(name)


def is_manifest_file(name: str) -> bool:
    """shardkit's integrity manifest (``shardkit.manifest.json``), which no loader reads.

    Args:
        name: a file name (no folder).

    Returns:
        Whether it is the manifest; such a file is never a weight, index or side file.
    """
    return name == MANIFEST_FILE
