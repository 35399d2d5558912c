"""``save_sharded`` of a diffusers ``ModelMixin`` or a transformers ``PreTrainedModel``: that library's layout.

A folder that ``from_pretrained`` can load needs the library's file names (diffusers:
``diffusion_pytorch_model*.safetensors``; transformers: ``model*.safetensors``) and its config
files. The configs are written by the library's own code (``save_config``,
``PretrainedConfig.save_pretrained``, ``GenerationConfig.save_pretrained``) into a temporary
folder and travel as side files, so they are published in the same transaction as the shards:
the output never holds weights without their config, or a config without its weights.

Neither library is imported here: a model is recognised by the names of its base classes.
"""

from __future__ import annotations

import copy
import os
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import InvalidInputError
from ..formats.index import DIFFUSERS_PREFIX, TRANSFORMERS_PREFIX, Naming
from .job import SideFile

if TYPE_CHECKING:
    import torch

__all__ = ["NativeModel", "library_of", "native_model", "transformers_state_dict"]

DIFFUSERS = "diffusers"
TRANSFORMERS = "transformers"
_BASES = {(DIFFUSERS, "ModelMixin"): DIFFUSERS, (TRANSFORMERS, "PreTrainedModel"): TRANSFORMERS}


@dataclass
class NativeModel:
    """What ``save_sharded`` writes for a library model besides its tensors.

    Attributes:
        library: ``"diffusers"`` or ``"transformers"``.
        state_dict: the tensors to save, named as the library's ``save_pretrained`` names them.
        naming: the library's file names.
        side_files: the config files the library wrote, to publish with the shards.
        keep: of tied tensors, the names the library reloads (the others become aliases).
    """

    library: str
    state_dict: Mapping[str, torch.Tensor]
    naming: Naming
    side_files: list[SideFile] = field(default_factory=list)
    keep: frozenset[str] = frozenset()


def library_of(obj: object) -> str | None:
    """``"diffusers"`` for a ``ModelMixin``, ``"transformers"`` for a ``PreTrainedModel``, else None.

    >>> library_of({"w": 1}) is None
    True
    """
    for cls in type(obj).__mro__:
        library = _BASES.get((cls.__module__.split(".")[0], cls.__name__))
        if library is not None:
            return library
    return None


@contextmanager
def native_model(obj: Any, *, cast_to: str | None = None) -> Iterator[NativeModel | None]:
    """The library layout of ``obj`` (None for a plain module or state dict); its configs live until exit.

    Args:
        obj: what ``save_sharded`` was given.
        cast_to: the safetensors dtype code the tensors are cast to (recorded as the
            transformers config's ``dtype``, as ``save_pretrained`` does), or None.

    Returns:
        A context manager yielding the :class:`NativeModel`, or None.

    with native_model(unet) as native:
        native.naming.prefix, [name for _, name in native.side_files]
    ('diffusion_pytorch_model', ['config.json'])
    """
    library = library_of(obj)
    if library is None:
        yield None
        return
    _refuse_quantized(obj)
    with tempfile.TemporaryDirectory(prefix="shardkit-config-") as folder:
        if library == DIFFUSERS:
            obj.save_config(folder)
            _unwrap_class_name(obj, os.path.join(folder, "config.json"))
            native = NativeModel(library, obj.state_dict(), Naming(DIFFUSERS_PREFIX))
        else:
            _save_transformers_configs(obj, folder, cast_to=cast_to)
            state, keep = transformers_state_dict(obj)
            native = NativeModel(library, state, Naming(TRANSFORMERS_PREFIX), keep=keep)
        native.side_files = sorted((os.path.join(folder, name), name) for name in os.listdir(folder))
        yield native


def _refuse_quantized(model: object) -> None:
    """A quantized model's state is more than plain tensors; only its library saves it faithfully."""
    if getattr(model, "hf_quantizer", None) is not None or getattr(model, "is_quantized", False):
        raise InvalidInputError(f"{type(model).__name__} is quantized: save it with its own save_pretrained; "
                                "save_sharded writes plain tensors and would lose the quantization state")


def _save_transformers_configs(model: Any, folder: str, *, cast_to: str | None) -> None:
    """config.json (+ generation_config.json) as ``save_pretrained`` writes them, without touching ``model``."""
    config = copy.deepcopy(model.config)
    # save_pretrained records these two on the live config; a copy leaves the caller's model as it was
    config.dtype = _torch_dtype_name(cast_to) if cast_to else str(model.dtype).removeprefix("torch.")
    config.architectures = [_model_class(model).__name__]
    config.save_pretrained(folder)
    generation = getattr(model, "generation_config", None)
    if generation is not None and model.can_generate():
        generation.save_pretrained(folder)


def _model_class(model: object) -> type:
    """The model's own class: FSDP2's ``fully_shard`` swaps in a subclass ``FSDP<Class>(FSDPModule, Class)``."""
    cls = type(model)
    return cls.__bases__[-1] if "FSDPModule" in {b.__name__ for b in cls.__bases__} else cls


def _unwrap_class_name(model: object, path: str) -> None:
    """diffusers records ``type(model).__name__``; under FSDP2 that is the wrapper's ``FSDP<Class>``."""
    cls = _model_class(model)
    if cls is not type(model) and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        old, new = f'"_class_name": "{type(model).__name__}"', f'"_class_name": "{cls.__name__}"'
        with open(path, "w", encoding="utf-8") as f:
            f.write(text.replace(old, new, 1))


def _torch_dtype_name(code: str) -> str:
    from ..formats.dtypes import to_torch

    return str(to_torch(code)).removeprefix("torch.")


def transformers_state_dict(model: Any) -> tuple[Mapping[str, torch.Tensor], frozenset[str]]:
    """The state dict and, of tied tensors, the names transformers keeps when it saves.

    transformers reloads a tied pair from one declared name (``model.embed_tokens.weight``, not
    ``lm_head.weight``); keeping the other one would load random embeddings. A model whose
    weights transformers converts on load (fused experts...) is saved in its checkpoint layout.
    """
    state = model.state_dict()
    try:
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:  # older transformers: ties are recorded as aliases, first name kept
        return state, frozenset()
    kept = remove_tied_weights_from_state_dict(dict(state), model)
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return state, frozenset(kept)
    reverted = revert_weight_conversion(model, kept)
    if reverted is not kept and set(reverted) != set(kept):
        return reverted, frozenset()
    return state, frozenset(kept)
