"""diffusers' single-file mapping, original key names → a diffusers model's: which model, which function, checked.

The key mapping is diffusers' own: the ``checkpoint_mapping_fn`` that ``from_single_file``
uses for the model class (``convert_ldm_unet_checkpoint``, ``convert_ldm_vae_checkpoint``,
``convert_flux_transformer_checkpoint_to_diffusers``... from ``SINGLE_FILE_LOADABLE_CLASSES``),
never a copy of it. What differs from ``from_single_file``: the config is always local (``config=``: a
``config.json``, a model folder, or a pipeline folder and a component; diffusers would fetch it from the
Hub, which shardkit never does), and the result is checked against the model the config describes
(built on the meta device: no memory). Writing it is :mod:`shardkit.sharding.to_diffusers_pipeline`'s.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidInputError, Option, first_line
from ..formats.layout import MAX_CONFIG_BYTES, check_config_numbers
from ..formats.links import parse_json, read_regular

__all__ = ["DiffusersMapping", "DiffusersTarget", "find_target", "has_single_file_mapping", "is_known_checkpoint",
           "map_to_diffusers", "missing_config_error", "unknown_checkpoint_error"]

DENOISERS = ("transformer", "unet", "prior", "decoder")
SHOWN = 3


@dataclass(frozen=True)
class DiffusersTarget:
    """The diffusers model a checkpoint is converted into: its class and the ``config.json`` that shapes it."""

    class_name: str
    config_file: str


def find_target(config: str | os.PathLike[str], *, component: str | None = None) -> DiffusersTarget:
    """Which diffusers model ``config`` describes.

    Args:
        config: a ``config.json``, a diffusers model folder holding one, or a pipeline folder
            (``model_index.json``), whose ``component`` is used.
        component: the pipeline component (``unet``, ``vae``, ``transformer``...); default: the
            pipeline's denoiser. Only for a pipeline folder.

    Returns:
        The :class:`DiffusersTarget`.

    Raises:
        InvalidInputError: no config there, or the component is missing or not a diffusers model.

    find_target("sd15/", component="vae")
    DiffusersTarget(class_name='AutoencoderKL', config_file='sd15/vae/config.json')
    """
    path = os.fspath(config)
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "model_index.json")):
        return _pipeline_target(path, component)
    if component is not None:
        raise InvalidInputError(Option("component", component), " applies to a pipeline folder (with model_index.json) "
                                "given as ", Option("config"), f"; {path} is one model's config: drop ",
                                Option("component"))
    config_file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(config_file):
        raise InvalidInputError(Option("config", path),
                                ": no config.json there; give a diffusers config.json, a model folder "
                                "holding one (e.g. a pipeline's unet/), or a pipeline folder with model_index.json")
    class_name = _read_json(config_file).get("_class_name")
    if not isinstance(class_name, str):
        raise InvalidInputError(Option("config", config_file),
                                ": no \"_class_name\"; it is not a diffusers model config "
                                "(diffusers writes one with save_pretrained)")
    return DiffusersTarget(class_name, config_file)


def _pipeline_target(folder: str, component: str | None) -> DiffusersTarget:
    index = _read_json(os.path.join(folder, "model_index.json"))
    models = {name: v for name, v in index.items() if isinstance(v, list) and len(v) == 2 and v[1] is not None}
    if component is None:
        component = next((name for name in DENOISERS if name in models), None)
        if component is None:
            raise InvalidInputError(Option("config", folder),
                                    f": no denoiser ({', '.join(DENOISERS)}) in its model_index.json; "
                                    "name the component with ", Option("component"), f" ({', '.join(sorted(models))})")
    if component not in models:
        raise InvalidInputError(Option("config", folder), f": no component {component!r}; its model_index.json lists "
                                f"{', '.join(sorted(models)) or 'none'}")
    library, class_name = models[component]
    if library != "diffusers":
        raise InvalidInputError(Option("component", component), f" is a {library} {class_name}; ", Option("to",
                                                                                                          "diffusers"),
                                " converts diffusers "
                                "models (unet, transformer, vae...)")
    config_file = os.path.join(folder, component, "config.json")
    if not os.path.isfile(config_file):
        raise InvalidInputError(Option("config", folder), f": {component}/config.json is missing")
    return DiffusersTarget(class_name, config_file)


def _read_json(path: str) -> dict[str, Any]:
    try:  # a checked descriptor with a byte cap: a FIFO or /dev/zero is refused unread
        doc = parse_json(read_regular(path, max_bytes=MAX_CONFIG_BYTES), path=Option("config", path))
    except OSError as e:
        raise InvalidInputError(Option("config", path), f": not a readable JSON file ({e.strerror or e})") from e
    if not isinstance(doc, dict):
        raise InvalidInputError(Option("config", path), ": not a JSON object")
    return doc


def missing_config_error(path: str, checkpoint: Mapping[str, Any]) -> InvalidInputError:
    """The error for a conversion without a config: what the checkpoint is and which config it needs."""
    from diffusers.loaders import single_file_utils

    if not is_known_checkpoint(checkpoint):
        return unknown_checkpoint_error(path)
    sfu: Any = single_file_utils  # untyped
    model_type = sfu.infer_diffusers_model_type(checkpoint)
    repo = sfu.DIFFUSERS_DEFAULT_PIPELINE_PATHS.get(model_type, {}).get("pretrained_model_name_or_path", "?")
    return InvalidInputError(
        f"{path}: ", Option("to", "diffusers"),
                             " needs the diffusers config of the model, and shardkit never downloads one; "
        f"this is a '{model_type}' checkpoint (diffusers takes its config from the Hub repo {repo}): pass ",
                             Option("config"), " "
        "with a local copy of that pipeline folder, of one of its component folders (unet/, transformer/, vae/), "
        "or of a component's config.json"
    )


def is_known_checkpoint(checkpoint: Mapping[str, Any]) -> bool:
    """Whether any key that diffusers uses to recognise a single-file format is in ``checkpoint``.

    ``infer_diffusers_model_type`` answers ``v1`` for anything it does not recognise; this does not.
    """
    from diffusers.loaders.single_file_utils import CHECKPOINT_KEY_NAMES

    for names in CHECKPOINT_KEY_NAMES.values():
        if any(name in checkpoint for name in ([names] if isinstance(names, str) else names)):
            return True
    return False


def unknown_checkpoint_error(path: str) -> InvalidInputError:
    return InvalidInputError(
        f"{path}: not a single-file checkpoint diffusers can convert (none of the key names of the formats it knows, "
        "SD 1/2/XL/3, Flux, ..., are in it); a checkpoint already in diffusers names needs no ", Option("to",
                                                                                                        "diffusers")
    )


@dataclass(frozen=True)
class DiffusersMapping:
    """A checkpoint mapped to a diffusers model's names.

    Attributes:
        tensors: ``{name: tensor}``, only the model's parameters (in the model's order).
        model: the model, on the meta device.
        unused: converted names that are not parameters of the model (left out; the caller says so).
    """

    tensors: dict[str, Any]
    model: Any
    unused: tuple[str, ...] = ()


def map_to_diffusers(checkpoint: Mapping[str, Any], target: DiffusersTarget, *, where: str) -> DiffusersMapping:
    """Map ``checkpoint`` to ``target``'s parameter names with diffusers' function; check it against the model.

    Raises:
        InvalidInputError: a checkpoint diffusers cannot convert, or one that does not give exactly the model.
    """
    cls, mapping_fn = _model_class(target)
    config = dict(cls.load_config(target.config_file))
    model = _empty_model(cls, config, target)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if set(expected) == set(checkpoint):  # already diffusers names, as from_single_file accepts
        converted = dict(checkpoint)
    else:
        try:
            converted = dict(mapping_fn(config=config, checkpoint=dict(checkpoint)))
        except Exception as e:  # diffusers raises KeyError/IndexError/... on a checkpoint of another model
            raise _mismatch_error(where, target, checkpoint, f"diffusers' conversion failed ({type(e).__name__}: "
                                  f"{first_line(e, limit=160)})") from e
    _check_against_model(converted, expected, where=where, target=target, checkpoint=checkpoint)
    return DiffusersMapping({name: converted[name] for name in expected}, model,
                            tuple(n for n in converted if n not in expected))


def _model_class(target: DiffusersTarget) -> tuple[Any, Any]:
    """The diffusers class and the ``checkpoint_mapping_fn`` that ``from_single_file`` uses for it."""
    import diffusers
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    cls = getattr(diffusers, target.class_name, None)
    if not isinstance(cls, type):
        raise InvalidInputError(Option("config", target.config_file),
                                f": diffusers {diffusers.__version__} has no model class "
                                f"{target.class_name}")
    mapping_fn = _mapping_fn(cls)
    if mapping_fn is not None:
        return cls, mapping_fn
    raise InvalidInputError(f"diffusers has no single-file conversion for {target.class_name} (from ",
                            Option("config"), " "
                            f"{target.config_file}); it converts {', '.join(sorted(SINGLE_FILE_LOADABLE_CLASSES))}")


def _mapping_fn(cls: type) -> Any:
    """``from_single_file``'s ``checkpoint_mapping_fn`` for ``cls`` (looked up as diffusers does), or None."""
    import diffusers
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    for name, mapping in SINGLE_FILE_LOADABLE_CLASSES.items():
        base = getattr(diffusers, name, None)
        if isinstance(base, type) and issubclass(cls, base) and isinstance(mapping, dict):
            return mapping["checkpoint_mapping_fn"]
    return None


def has_single_file_mapping(class_name: str) -> bool:
    """Whether diffusers converts single-file checkpoints of its class ``class_name``.

    has_single_file_mapping("UNet2DConditionModel"), has_single_file_mapping("CLIPTextModel")
    (True, False)
    """
    import diffusers

    cls = getattr(diffusers, class_name, None)
    return isinstance(cls, type) and _mapping_fn(cls) is not None


def _empty_model(cls: Any, config: dict[str, Any], target: DiffusersTarget) -> Any:
    """The model ``config`` describes, with every tensor on the meta device (no memory)."""
    import torch

    check_config_numbers(config, where=Option("config", target.config_file))  # bounded before the model is built
    try:
        with torch.device("meta"):
            return cls.from_config(config)
    except Exception as e:  # a config the class refuses (ValueError, TypeError...) is the user's --config
        raise InvalidInputError(Option("config", target.config_file), f": {target.class_name} refuses it "
                                f"({type(e).__name__}: {first_line(e)})") from e


def _check_against_model(converted: Mapping[str, Any], expected: Mapping[str, tuple[int, ...]], *, where: str,
                         target: DiffusersTarget, checkpoint: Mapping[str, Any]) -> None:
    missing = [n for n in expected if n not in converted]
    if missing:
        shown = ", ".join(missing[:SHOWN]) + (" ..." if len(missing) > SHOWN else "")
        raise _mismatch_error(where, target, checkpoint, f"{len(missing)} of its {len(expected)} parameters are not "
                              f"in the converted checkpoint ({shown})")
    wrong = [(n, tuple(converted[n].shape), shape) for n, shape in expected.items()
             if tuple(converted[n].shape) != shape]
    if wrong:
        name, got, want = wrong[0]
        raise _mismatch_error(where, target, checkpoint, f"{len(wrong)} parameter(s) have another shape, e.g. "
                              f"{name}: {list(got)} in the checkpoint, {list(want)} in the config's model")


def _mismatch_error(where: str, target: DiffusersTarget, checkpoint: Mapping[str, Any], what: str) -> InvalidInputError:
    if not is_known_checkpoint(checkpoint):
        return unknown_checkpoint_error(where)
    return InvalidInputError(f"{where} does not convert into the {target.class_name} of ", Option("config",
                                                                                                  target.config_file),
                             ": "
                             f"{what}; check that ", Option("config"), " (and ", Option("component"),
                             ") describe this checkpoint's model")
