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

import os
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidInputError, SourceNotFoundError
from .index import DIFFUSERS_PREFIX, TRANSFORMERS_PREFIX, Naming, naming_from_filename
from .links import BOUNDARY_RULE, OutsideFolderError, parse_json, read_inside
from .suffixes import SAVED_WEIGHT_SUFFIXES

MODEL_INDEX = "model_index.json"
MAX_MODEL_INDEX_BYTES = 10_000_000
MAX_CONFIG_BYTES = 10_000_000
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


def read_model_index(folder: str) -> dict:
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


def _is_component_spec(value: object) -> bool:
    return (isinstance(value, list) and len(value) == 2
            and isinstance(value[0], str) and isinstance(value[1], str))


def _check_component_name(name: str, folder: str) -> None:
    # Component names become subfolder paths: refuse anything that could leave the pipeline folder.
    if not name or "/" in name or "\\" in name or name in (".", "..") or any(ord(c) < 32 for c in name):
        raise InvalidInputError(f"{folder}/{MODEL_INDEX}: component name {name!r} is not a plain folder name")


def _naming_for(library: str, weights: list[str], variant: str | None) -> Naming:
    """The prefix the component's files actually use; else the one its library writes."""
    default = _LIBRARY_PREFIX.get(library, TRANSFORMERS_PREFIX)
    found = {naming_from_filename(n).prefix for n in weights
             if os.path.basename(n).split(".")[0].split("-")[0] in (DIFFUSERS_PREFIX, TRANSFORMERS_PREFIX, "pytorch_model")}
    prefix = default if default in found or not found else sorted(found)[0]
    return Naming(prefix, variant)


def read_config(folder: str) -> dict[str, Any] | None:
    """``folder/config.json`` as a dict, or None when there is none (or it is not a JSON object)."""
    path = os.path.join(folder, "config.json")
    try:  # a checked descriptor: a FIFO, /dev/zero or a link leaving the folder is refused unread
        doc = parse_json(read_inside(folder, "config.json", where=folder, max_bytes=MAX_CONFIG_BYTES), path=path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise InvalidInputError(f"{path}: not a readable JSON file ({e.strerror or e}); fix or remove it") from e
    return doc if isinstance(doc, dict) else None
