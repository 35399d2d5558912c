"""diffusers pipeline folders: ``model_index.json`` plus one subfolder per component.

A pipeline folder looks like::

    model_index.json        {"unet": ["diffusers", "UNet2DConditionModel"],
                             "text_encoder": ["transformers", "CLIPTextModel"],
                             "scheduler": ["diffusers", "PNDMScheduler"], ...}
    unet/                   config.json + diffusion_pytorch_model*.safetensors
    text_encoder/           config.json + model*.safetensors
    scheduler/, tokenizer/  configuration files only

Weight-bearing components are those whose subfolder holds ``.safetensors`` or ``.bin`` weights.
Standard library only: no torch, no diffusers.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeGuard

from ..errors import InvalidInputError, Part, SourceNotFoundError
from .json_types import Config, JsonObject
from .links import BOUNDARY_RULE, OutsideFolderError, parse_json, read_inside
from .names import (
    DIFFUSERS_PREFIX,
    MODEL_INDEX,
    SAVED_WEIGHT_SUFFIXES,
    TRANSFORMERS_PREFIX,
    Naming,
    library_naming,
)

MAX_MODEL_INDEX_BYTES = 10_000_000
MAX_CONFIG_BYTES = 10_000_000
__all__ = ["MAX_CONFIG_BYTES", "MAX_MODEL_INDEX_BYTES", "MODEL_INDEX", "Component", "check_config_numbers",
           "find_components", "is_pipeline_folder", "read_config", "read_model_index", "weight_files"]
# Library named in model_index.json → file prefix its save_pretrained writes.
_LIBRARY_PREFIX = {"diffusers": DIFFUSERS_PREFIX, "transformers": TRANSFORMERS_PREFIX}


@dataclass(frozen=True)
class Component:
    """One entry of ``model_index.json``.

    ``library`` is ``"diffusers"``, ``"transformers"`` or whatever the index names (e.g. a
    pipeline module such as ``"stable_diffusion"``); ``naming`` is the weight-file convention the
    component's folder uses (taken from its files when it has any, else from the library).
    """

    name: str
    path: str
    library: str
    naming: Naming
    has_weights: bool
    class_name: str


def is_pipeline_folder(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a folder with a ``model_index.json`` (a diffusers pipeline)."""
    path = os.fspath(path)
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, MODEL_INDEX))


def find_components(folder: str | os.PathLike[str], *, variant: str | None = None) -> list[Component]:
    """List the components of a diffusers pipeline folder, in ``model_index.json`` order.

    Entries whose value is not a ``[library, class]`` pair (``_class_name``, flags such as
    ``requires_safety_checker``) and disabled components (``[null, null]``) are skipped.

    [(c.name, c.naming.prefix) for c in find_components("sd-pipeline/") if c.has_weights]
    [('text_encoder', 'model'), ('unet', 'diffusion_pytorch_model'), ('vae', 'diffusion_pytorch_model')]
    """
    folder = os.fspath(folder)
    doc = read_model_index(folder)
    components = []
    for name, value in doc.items():
        if name.startswith("_") or not _is_component_spec(value):
            continue
        _check_component_name(name, folder)
        library, class_name = value
        path = os.path.join(folder, name)
        if os.path.islink(path):
            raise OutsideFolderError(f"{folder}: component {name!r} is a symlink (to {os.path.realpath(path)}); "
                                     f"{BOUNDARY_RULE}; copy the component folder in")
        weights = weight_files(path)
        naming = _naming_for(library, weights, variant)
        components.append(Component(name, path, library, naming, bool(weights), class_name))
    return components


def read_model_index(folder: str) -> dict[str, object]:
    """Parse ``folder/model_index.json``; one-line errors for a missing or malformed file."""
    path = os.path.join(folder, MODEL_INDEX)
    try:
        doc = parse_json(read_inside(folder, MODEL_INDEX, where=folder, max_bytes=MAX_MODEL_INDEX_BYTES), path=path)
    except FileNotFoundError as e:
        raise SourceNotFoundError(f"{folder}: no {MODEL_INDEX}; not a diffusers pipeline folder") from e
    if not isinstance(doc, dict):
        raise InvalidInputError(f"{path}: must be a JSON object mapping component names to [library, class]")
    return doc


def weight_files(path: str) -> list[str]:
    """Names of the ``.safetensors``/``.bin`` files directly inside ``path`` (sorted)."""
    if not os.path.isdir(path):
        return []
    return sorted(
        n for n in os.listdir(path)
        if n.endswith(SAVED_WEIGHT_SUFFIXES) and not n.startswith(".") and os.path.isfile(os.path.join(path, n))
    )


def _is_component_spec(value: object) -> TypeGuard[list[str]]:
    return (isinstance(value, list) and len(value) == 2
            and isinstance(value[0], str) and isinstance(value[1], str))


def _check_component_name(name: str, folder: str) -> None:
    # Component names become subfolder paths: refuse anything that could leave the pipeline folder.
    if not name or "/" in name or "\\" in name or name in (".", "..") or any(ord(c) < 32 for c in name):
        raise InvalidInputError(f"{folder}/{MODEL_INDEX}: component name {name!r} is not a plain folder name")


def _naming_for(library: str, weights: list[str], variant: str | None) -> Naming:
    """The prefix the component's files actually use; else the one its library writes."""
    default = _LIBRARY_PREFIX.get(library, TRANSFORMERS_PREFIX)
    found = {naming.prefix for n in weights if (naming := library_naming(n)) is not None}
    prefix = default if default in found or not found else sorted(found)[0]
    return Naming(prefix, variant)


def read_config(folder: str) -> JsonObject | None:
    """``folder/config.json`` as a dict, or None when there is none (or it is not a JSON object)."""
    path = os.path.join(folder, "config.json")
    try:  # a checked descriptor: a FIFO, /dev/zero or a link leaving the folder is refused unread
        doc = parse_json(read_inside(folder, "config.json", where=folder, max_bytes=MAX_CONFIG_BYTES), path=path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise InvalidInputError(f"{path}: not a readable JSON file ({e.strerror or e}); fix or remove it") from e
    if not isinstance(doc, dict):
        return None
    check_config_numbers(doc, where=path)
    return doc


MAX_CONFIG_COUNT = 1024  # layers, blocks, depth: no released model comes near it (the largest have ~200)
MAX_CONFIG_LIST = 1 << 18  # entries of one list or object (label maps of classifiers reach ~22k)
MAX_CONFIG_BLOCKS = 256  # a UNet's block types × layers per block: SDXL has 3 × 10
MAX_CONFIG_INT = 1 << 40  # any other integer (hidden sizes, vocabularies, positions)
MAX_CONFIG_DEPTH = 16
_COUNT_KEY = re.compile(r"(^|_)(layers?|depths?|n_layer|num_blocks|num_res_blocks|n_blocks)(_|$)", re.IGNORECASE)


def check_config_numbers(config: Config, *, where: Part) -> None:
    """Bound every number a model would be built from, before anything is built or allocated.

    Layer and block counts (``layers_per_block``, ``num_hidden_layers``, ``depth``...) stay under
    :data:`MAX_CONFIG_COUNT`, lists under :data:`MAX_CONFIG_LIST` entries, other integers under
    2^40, floats finite; one line names the field. A hostile ``layers_per_block: 10**7`` would
    otherwise build ten million modules before any check ran.

    >>> check_config_numbers({"layers_per_block": 2, "block_out_channels": [320, 640]}, where="unet/config.json")
    """
    _check_value(config, where=where, field="", count=False, depth=0)
    blocks = max((len(v) for k, v in config.items() if str(k).endswith("block_types") and isinstance(v, list)), default=1)
    counts = [_largest_int(v) for k, v in config.items() if _COUNT_KEY.search(str(k))]
    if blocks * max(counts, default=1) > MAX_CONFIG_BLOCKS:
        raise InvalidInputError(where, f": fields *_block_types ({blocks} blocks) and the layer counts "
                                f"({max(counts)} per block) describe more than {MAX_CONFIG_BLOCKS} blocks; the config "
                                "is corrupt or hostile")


def _largest_int(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, list):
        return max((_largest_int(v) for v in value), default=1)
    return 1


def _check_value(value: object, *, where: Part, field: str, count: bool, depth: int) -> None:
    if depth > MAX_CONFIG_DEPTH:
        raise InvalidInputError(where, f": field {field or '(top)'} is nested more than {MAX_CONFIG_DEPTH} deep")
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return
    if isinstance(value, int):
        limit = MAX_CONFIG_COUNT if count else MAX_CONFIG_INT
        if not -limit <= value <= limit:
            raise InvalidInputError(where, f": field {field} is {str(value)[:40]}, beyond the bound {limit} shardkit "
                                    "builds models from; the config is corrupt or hostile")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidInputError(where, f": field {field} is {value}, not a finite number")
    elif isinstance(value, list):
        if len(value) > MAX_CONFIG_LIST:
            raise InvalidInputError(where, f": field {field} has {len(value)} entries, more than the {MAX_CONFIG_LIST} "
                                    "shardkit builds models from")
        for i, item in enumerate(value):
            _check_value(item, where=where, field=f"{field}[{i}]", count=count, depth=depth + 1)
    elif isinstance(value, Mapping):
        if len(value) > MAX_CONFIG_LIST:
            raise InvalidInputError(where, f": field {field or '(top)'} has {len(value)} keys; too many for a config")
        for key, item in value.items():
            part = str(key) if str(key).isprintable() and len(str(key)) <= 60 else repr(str(key)[:60])
            name = f"{field}.{part}" if field else part
            _check_value(item, where=where, field=name, count=count or bool(_COUNT_KEY.search(str(key))),
                         depth=depth + 1)

