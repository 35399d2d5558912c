"""Model skeletons on the meta device: a class (or factory) plus a config → an ``nn.Module`` with
no weights, built under ``accelerate.init_empty_weights``.

A skeleton costs no memory for its parameters, so a 12B model plans in seconds on a laptop.
Which library builds it is a table (:data:`_BUILDERS`), not a branch per class name.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, runtime_checkable

from ..errors import InvalidInputError, Option, ShardkitError, SourceNotFoundError
from ..formats.layout import MAX_CONFIG_BYTES, check_config_numbers
from ..formats.links import parse_json, read_regular

if TYPE_CHECKING:
    import torch

# "diffusers:ClassName", "transformers:ClassName", "pkg.module:Name", a class, a factory or a meta skeleton.
ModelSpec: TypeAlias = "str | type[torch.nn.Module] | Callable[..., torch.nn.Module] | torch.nn.Module"
# A config: a dict, a config.json path or the folder holding it. Its values are JSON's (the one boundary
# typed ``Any`` here: each model library reads its own fields).
Config: TypeAlias = "dict[str, Any]"
ConfigSpec: TypeAlias = "Mapping[str, Any] | str | os.PathLike[str]"
# What builds a model: a class or any factory; what it returns is checked (an nn.Module).
Factory: TypeAlias = "Callable[..., object]"


@runtime_checkable
class _FromConfig(Protocol):
    """A diffusers model class, or a transformers Auto* class: ``cls.from_config(config)``."""

    def from_config(self, config: object, /) -> object: ...


@runtime_checkable
class _FromDict(Protocol):
    """A transformers ``PretrainedConfig`` subclass."""

    def from_dict(self, config: Config, /) -> object: ...


@runtime_checkable
class _PrivateFromConfig(Protocol):
    """A transformers model class: ``cls._from_config(config)`` builds it from a config object."""

    def _from_config(self, config: object, /) -> object: ...


def resolve_model_class(spec: ModelSpec) -> Factory:
    """Turn ``"diffusers:UNet2DConditionModel"`` (or any ``"package.module:Name"``) into the object.

    Classes and factories are returned unchanged.

    resolve_model_class("diffusers:UNet2DConditionModel").__name__
    'UNet2DConditionModel'
    """
    if not isinstance(spec, str):
        if callable(spec):
            return spec
        raise InvalidInputError(f"model must be a 'library:ClassName' string, a class or a factory, got {type(spec).__name__}")
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise InvalidInputError(
            f"unknown model class {spec!r}: write it as 'diffusers:ClassName', 'transformers:ClassName' "
            "or 'package.module:ClassName'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise InvalidInputError(f"unknown model class {spec!r}: cannot import {module_name!r} ({e})") from e
    try:
        found: object = getattr(module, attr)
    except (AttributeError, ImportError, RuntimeError) as e:
        raise InvalidInputError(f"unknown model class {spec!r}: {module_name} has no {attr!r}") from e
    if not callable(found):
        raise InvalidInputError(f"unknown model class {spec!r}: {module_name}.{attr} is not a class or factory")
    return found


def load_config(config: ConfigSpec | None) -> Config | None:
    """Read a config given as a dict, a ``config.json`` path or a folder holding ``config.json``."""
    if config is None or isinstance(config, Mapping):
        if config is not None:
            check_config_numbers(config, where="config")
        return dict(config) if config is not None else None
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:  # a checked descriptor with a byte cap: a FIFO or /dev/zero is refused unread
        doc = parse_json(read_regular(path, max_bytes=MAX_CONFIG_BYTES), path=path, what="JSON config")
    except FileNotFoundError as e:
        raise SourceNotFoundError(f"{path}: no such config file (pass config.json or the folder holding it)") from e
    except OSError as e:
        raise InvalidInputError(f"{path}: config cannot be read ({e.strerror or e})") from e
    if not isinstance(doc, dict):
        raise InvalidInputError(f"{path}: config must be a JSON object")
    check_config_numbers(doc, where=path)  # bounded before any model is built from it
    return doc


def _is_diffusers_model(cls: Factory) -> bool:
    return isinstance(cls, type) and hasattr(cls, "from_config") and hasattr(cls, "config_name") \
        and cls.__module__.startswith("diffusers")


def _is_transformers_model(cls: Factory) -> bool:
    return isinstance(cls, type) and cls.__module__.startswith("transformers") and hasattr(cls, "config_class")


def _build_diffusers(cls: Factory, config: Config | None) -> object:
    if config is None:
        raise InvalidInputError(f"{cls.__name__} needs a config: give ", Option("config"),
                                " (a config.json path, its folder or a dict)")
    meant = config.get("_class_name")
    if isinstance(meant, str) and meant != cls.__name__:
        # diffusers fills every missing field with a default, so a VAE's config silently builds a UNet.
        import warnings

        from ..errors import ShardkitWarning

        warnings.warn(ShardkitWarning(f"the config is for {meant}, not {cls.__name__}; check ", Option("model"),
                                      " and ", Option("config")),
                      stacklevel=4)
    assert isinstance(cls, _FromConfig)  # checked by _is_diffusers_model
    return cls.from_config(config)


def _build_transformers(cls: Factory, config: Config | None) -> object:
    if config is None:
        raise InvalidInputError(f"{cls.__name__} needs a config: give ", Option("config"),
                                " (a config.json path, its folder or a dict)")
    from transformers import AutoConfig, PretrainedConfig

    config_class = getattr(cls, "config_class", None)
    cfg: object
    if isinstance(config_class, type) and isinstance(config_class, _FromDict) and config_class is not PretrainedConfig:
        cfg = config_class.from_dict(config)  # a PretrainedConfig subclass
    elif "model_type" in config:
        cfg = AutoConfig.for_model(**config)
    else:
        raise InvalidInputError(f"{_name(cls)}: the config has no 'model_type'; pass a model-specific class")
    if isinstance(cls, _PrivateFromConfig):
        return cls._from_config(cfg)
    assert isinstance(cls, _FromConfig)  # the Auto* classes
    return cls.from_config(cfg)


def _build_plain(factory: Factory, config: Config | None) -> object:
    return factory(**config) if config else factory()


# (test, builder) rows, tried in order; the last one accepts any callable.
Builder: TypeAlias = "Callable[[Factory, Config | None], object]"
_BUILDERS: list[tuple[Callable[[Factory], bool], Builder]] = [
    (_is_diffusers_model, _build_diffusers),
    (_is_transformers_model, _build_transformers),
    (callable, _build_plain),
]


def is_meta_module(module: torch.nn.Module) -> bool:
    """True when every parameter of ``module`` is on the meta device (a skeleton)."""
    params = list(module.parameters())
    return bool(params) and all(p.is_meta for p in params)


@contextlib.contextmanager
def _ties_kept(torch_register: Callable[..., None]) -> Iterator[None]:
    """Inside ``init_empty_weights``: keep ``self.b.weight = self.a.weight`` a tie.

    accelerate re-wraps every registered parameter in a new meta Parameter, which silently unties
    weights tied in ``__init__``. A parameter that is already on meta needs no re-wrapping, so it
    is registered as is (with torch's own ``register_parameter``), which keeps the tie.
    """
    from unittest import mock

    from torch import nn

    accelerate_register = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.is_meta:
            torch_register(module, name, param)
        else:
            accelerate_register(module, name, param)

    with mock.patch.object(nn.Module, "register_parameter", register):  # restored on every path
        yield


def build_skeleton(model: ModelSpec, *, config: ConfigSpec | None = None,
                   dtype: str | torch.dtype | None = None) -> torch.nn.Module:
    """Build ``model`` on the meta device: no parameter memory is allocated.

    ``model`` is a ``"library:ClassName"`` string, a diffusers/transformers class (with ``config``:
    a dict, a ``config.json`` path or its folder), any ``nn.Module`` factory (called with the
    config's keys as keyword arguments, or none), or a module already on the meta device
    (returned as is). ``dtype`` casts floating-point parameters, except the class's
    ``_keep_in_fp32_modules``.

    unet = build_skeleton("diffusers:UNet2DConditionModel", config="unet/config.json", dtype="bf16")
    next(unet.parameters()).device
    device(type='meta')
    """
    import torch
    from accelerate import init_empty_weights

    from ..formats.dtypes import resolve_torch_dtype

    target = resolve_torch_dtype(dtype)
    if isinstance(model, torch.nn.Module):
        if not is_meta_module(model):
            raise InvalidInputError(
                f"{type(model).__name__} already holds weights; pass its class (or a factory), or a skeleton "
                "built under accelerate.init_empty_weights()"
            )
        skeleton: object = model
    else:
        factory = resolve_model_class(model)
        cfg = load_config(config)
        builder = next(build for test, build in _BUILDERS if test(factory))
        torch_register = torch.nn.Module.register_parameter
        with init_empty_weights(), _ties_kept(torch_register):
            skeleton = _call_builder(builder, factory, cfg, config)
        if not isinstance(skeleton, torch.nn.Module):
            raise InvalidInputError(f"{_name(factory)!r} returned {type(skeleton).__name__}, not an nn.Module")
    assert isinstance(skeleton, torch.nn.Module)
    if target is not None:
        cast_floating(skeleton, lambda name: target if not keeps_fp32(skeleton, name) else torch.float32)
    return skeleton


def _call_builder(builder: Builder, factory: Factory, cfg: Config | None, config: ConfigSpec | None) -> object:
    """Build, turning the model library's own complaints about the config into one clear error.

    A config for another class (a VAE's config given to a UNet) makes the constructor raise
    ``ValueError: cross_attention_dim must be specified``; the fix is in the flags, so say which.
    """
    try:
        return builder(factory, cfg)
    except ShardkitError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, AssertionError) as e:
        name = _name(factory)
        meant = (cfg or {}).get("_class_name") or (cfg or {}).get("architectures")
        hint = f"; the config is for {meant}" if meant and meant != name else ""
        where = f" from {config}" if isinstance(config, (str, os.PathLike)) else ""
        raise InvalidInputError(
            f"building {name}{where} failed ({type(e).__name__}: {e}){hint}; check that ", Option("model"),
                                " names the "
            "class this config belongs to and ", Option("config"), " is that model's config.json"
        ) from e


def keeps_fp32(model: torch.nn.Module, name: str) -> bool:
    """Whether ``name`` lies in one of the model class's ``_keep_in_fp32_modules``."""
    keep = getattr(model, "_keep_in_fp32_modules", None) or ()
    parts = name.split(".")
    return any(module in parts for module in keep)


def cast_floating(model: torch.nn.Module, dtype_for: Callable[[str], torch.dtype | None]) -> None:
    """Cast floating-point parameters and buffers in place, keeping tied parameters tied.

    Meta tensors cost nothing to cast; ``param.data`` assignment keeps the Parameter object, so
    ties (two names, one Parameter) survive.
    """
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            target = dtype_for(name)
            if target is not None and param.is_floating_point() and param.dtype != target:
                param.data = param.data.to(target)
        for name, buf in model.named_buffers():
            target = dtype_for(name)
            if target is not None and buf.is_floating_point() and buf.dtype != target:
                module_name, _, attr = name.rpartition(".")
                owner = model.get_submodule(module_name) if module_name else model
                owner._buffers[attr] = buf.to(target)


def default_config(model: ModelSpec, checkpoint: object,
                   config: ConfigSpec | None) -> ConfigSpec | None:
    """``config``, else the ``config.json`` beside a path ``checkpoint`` when ``model`` is a class that needs one.

    Plain ``nn.Module`` factories take no config unless given one (a factory called with a
    diffusers config's keys would fail), so only diffusers/transformers classes get the default.

    Args:
        model: what ``load_model`` / ``plan_device_map`` was given as ``model``.
        checkpoint: a folder, a ``.safetensors`` file or an index JSON (an open checkpoint has no folder).
        config: the config the caller gave, if any.

    Returns:
        ``config`` if given, else ``CHECKPOINT/config.json`` (for a file: the one in its folder) when it
        exists and the model class takes a config, else None.

    default_config("diffusers:UNet2DConditionModel", "sdxl/unet", None)
    'sdxl/unet/config.json'
    """
    if config is not None or not isinstance(checkpoint, (str, os.PathLike)):
        return config
    folder = os.fspath(checkpoint)
    folder = folder if os.path.isdir(folder) else os.path.dirname(folder)
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path) or not _takes_config(model):
        return None
    return path


def _takes_config(model: ModelSpec) -> bool:
    if not isinstance(model, (str, type)):
        return False  # a factory or a skeleton already built
    cls = resolve_model_class(model)
    module = getattr(cls, "__module__", "") or ""
    return isinstance(cls, type) and module.startswith(("diffusers", "transformers")) and (
        hasattr(cls, "from_config") or hasattr(cls, "config_class"))


def _name(factory: Factory) -> str:
    """A class's or function's name, for messages."""
    return str(getattr(factory, "__name__", repr(factory)))
