"""diffusers and kohya LoRA files read as the PEFT adapters diffusers itself would build from them.

A diffusion LoRA is one ``.safetensors`` file without ``adapter_config.json``: diffusers' own format
(``unet.M.lora_A.weight``, ``transformer.M.lora_B.weight``, the config in the header's
``lora_adapter_metadata``) or kohya's (``lora_unet_M.lora_down.weight``, ``.lora_up.weight``,
``.alpha``; SDXL's ``input_blocks`` numbering mapped with the base's UNet config; Flux's
``lora_unet_double_blocks_*``/``lora_unet_single_blocks_*``, whose fused ``qkv``/``linear1`` pairs diffusers
splits). They are read by diffusers' own functions, the ones ``load_lora_weights`` runs: ``lora_state_dict``
(kohya → diffusers names and alphas; ``FluxLoraLoaderMixin``'s for Flux keys or a Flux base, else
``StableDiffusionLoraLoaderMixin``'s), ``convert_unet_state_dict_to_peft`` and ``get_peft_kwargs`` (rank, alpha, their
patterns); the result is a PEFT config and keys, held as an :class:`~shardkit.sharding.lora_adapter.Adapter`
and merged like any PEFT one,
so ``pipe.load_lora_weights(...); pipe.fuse_lora()`` and the merge agree. ``component`` picks the keys:
``unet``/``transformer`` (the default: whichever the file has), or ``text_encoder``/``text_encoder_2`` in a
pipeline merge (diffusers' text-encoder conversion, ``text_model.`` dropped where the base has no such
names). Keys of other components are left out of a single-folder merge, with a warning.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from ..errors import InvalidInputError, first_line
from ..formats.json_types import Config, JsonObject
from ..formats.links import parse_json
from ..layouts.adapters import PEFT_PREFIX, SUPPORTED, AdapterKeys, peft_keys
from .options import warn

if TYPE_CHECKING:
    import torch

__all__ = ["METADATA_KEY", "diffusers_adapter", "is_flux"]

METADATA_KEY = "lora_adapter_metadata"  # diffusers' save_lora_weights: the LoraConfig, keys under the prefix
PREFIXES = ("unet", "transformer")
_COMPONENTS = ("unet", "transformer", "text_encoder", "text_encoder_2", "text_encoder_3")
_FLUX_MARKERS = ("double_blocks", "single_blocks", "single_transformer_blocks", "lora_transformer_")


def diffusers_adapter(path: str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str], *,
                      base_config: Config | None, component: str | None = None,
                      base_names: frozenset[str] = frozenset()) -> tuple[Config, dict[str, torch.Tensor], AdapterKeys]:
    """The PEFT adapter diffusers builds from a diffusers or kohya LoRA file (see the module docstring):
    its LoraConfig fields, its tensors under PEFT's names, and those names sorted.

    Raises:
        InvalidInputError: no UNet or transformer keys in the file (the message names what is supported).
    """
    state, alphas = _diffusers_state(path, tensors, base_config, base_names)
    prefix = component or next((p for p in PREFIXES if any(k.startswith(p + ".") for k in state)), None)
    if prefix is None:
        raise InvalidInputError(f"adapter {path}: no UNet or transformer LoRA keys (first key {next(iter(tensors), '')!r});"
                                f" supported: {SUPPORTED}")
    left_out = sorted({k.split(".", 1)[0] for k in state if not k.startswith(prefix + ".")})
    stray = [name for name in left_out if name not in _COMPONENTS]
    if stray and component in (None, *PREFIXES):  # diffusers' kohya Flux conversion leaves the top-level layers (x_embedder...) without a prefix
        warn(f"adapter {path}: its {', '.join(stray)} keys are left out, as diffusers' load_lora_weights leaves them "
             "out (its conversion gives them no component prefix)")
    if len(left_out) > len(stray) and component is None:
        warn(f"adapter {path}: its {', '.join(n for n in left_out if n in _COMPONENTS)} keys are left out (this merge "
             f"is into the {prefix}); merge them into that component's folder with a PEFT adapter")
    sd = {k[len(prefix) + 1:]: v for k, v in state.items() if k.startswith(prefix + ".")}
    if not sd and component is not None:  # nothing for this pipeline component: it is written as it is
        return {"peft_type": "LORA"}, {}, AdapterKeys(())
    alphas = {k[len(prefix) + 1:]: v for k, v in alphas.items() if k.startswith(prefix + ".")}
    if prefix in PREFIXES:
        config = _config(sd, alphas, _metadata(metadata, prefix, where=path))
    else:
        sd, config = _text_encoder(sd, alphas, _metadata(metadata, prefix, where=path), base_names)
    peft = {PEFT_PREFIX + k: v for k, v in sd.items()}
    return config, peft, peft_keys(peft, where=f"adapter {path}")


def is_flux(names: Iterable[str], base_config: Config | None = None) -> bool:
    """Whether LoRA keys or base names are Flux's (kohya's ``lora_unet_double_blocks_*``, BFL's ``double_blocks.``,
    diffusers' ``single_transformer_blocks``), or the base's config is a ``FluxTransformer2DModel``'s."""
    if base_config and base_config.get("_class_name") == "FluxTransformer2DModel":
        return True
    return any(marker in name for name in names for marker in _FLUX_MARKERS)


def _diffusers_state(path: str, tensors: Mapping[str, torch.Tensor], base_config: Config | None,
                     base_names: frozenset[str]) -> tuple[dict[str, torch.Tensor], Mapping[str, float]]:
    """The file's keys in diffusers' names (``unet.M.lora_A.weight``...) and its alphas, by the loader diffusers'
    pipeline uses for it: Flux's (kohya's fused ``qkv``/``linear1`` split as diffusers splits them) or SD's."""
    from diffusers.loaders.lora_pipeline import FluxLoraLoaderMixin, StableDiffusionLoraLoaderMixin

    if is_flux(tensors, base_config) or is_flux(base_names):
        try:
            state, alphas = FluxLoraLoaderMixin.lora_state_dict(dict(tensors), return_alphas=True)
        except (ValueError, AssertionError, RuntimeError, KeyError, IndexError) as e:  # its checks: assert, raise
            raise InvalidInputError(f"adapter {path}: diffusers' Flux LoRA conversion refuses it ({type(e).__name__}: "
                                    f"{first_line(e)}); supported: {SUPPORTED}") from e
        return dict(state), alphas or {}
    unet_config = dict(base_config) if base_config and "down_block_types" in base_config else None
    loaded = StableDiffusionLoraLoaderMixin.lora_state_dict(dict(tensors), unet_config=unet_config)
    return loaded[0], loaded[1] or {}


def _config(sd: dict[str, torch.Tensor], alphas: Mapping[str, float], metadata: Config | None) -> Config:
    """The LoraConfig fields diffusers would use: the file's metadata, or ranks and alphas read off the tensors."""
    from diffusers.utils.peft_utils import get_peft_kwargs
    from diffusers.utils.state_dict_utils import convert_unet_state_dict_to_peft

    if sd and "lora_A" not in next(iter(sd)):
        converted = convert_unet_state_dict_to_peft(sd)  # type: ignore[no-untyped-call]
        sd.clear()
        sd.update(converted)
    if metadata is not None:
        return {**metadata, "peft_type": "LORA"}
    rank = {f"^{k}": v.shape[1] for k, v in sd.items() if "lora_B" in k and v.ndim > 1}
    if not rank:
        raise InvalidInputError(f"no lora_B tensors in the LoRA file; supported: {SUPPORTED}")
    kwargs: JsonObject = get_peft_kwargs(rank, alphas or None, sd, is_unet=True)  # type: ignore[no-untyped-call]
    return {**kwargs, "peft_type": "LORA"}


def _text_encoder(sd: dict[str, torch.Tensor], alphas: Mapping[str, float], metadata: Config | None,
                  base_names: frozenset[str]) -> tuple[dict[str, torch.Tensor], Config]:
    """A text encoder's keys and LoraConfig fields as diffusers' ``_load_lora_into_text_encoder`` makes them."""
    from diffusers.utils.peft_utils import get_peft_kwargs
    from diffusers.utils.state_dict_utils import convert_state_dict_to_diffusers, convert_state_dict_to_peft

    sd = convert_state_dict_to_peft(convert_state_dict_to_diffusers(sd))  # type: ignore[no-untyped-call]
    if not any(n.startswith("text_model.") for n in base_names):  # transformers' flattened CLIPTextModel
        sd = {k.removeprefix("text_model."): v for k, v in sd.items()}
    if metadata is not None:
        return sd, {**metadata, "peft_type": "LORA"}
    rank = {k: v.shape[1] for k, v in sd.items() if k.endswith(".lora_B.weight") and v.ndim > 1}
    kwargs: JsonObject = get_peft_kwargs(rank, alphas or None, sd, is_unet=False)  # type: ignore[no-untyped-call]
    return sd, {**kwargs, "peft_type": "LORA"}


def _metadata(metadata: Mapping[str, str], prefix: str, *, where: str) -> Config | None:
    raw = metadata.get(METADATA_KEY)
    if raw is None:
        return None
    doc = parse_json(raw.encode(), path=f"adapter {where}", what=f"{METADATA_KEY} header field")
    if not isinstance(doc, dict):
        return None
    picked = {k[len(prefix) + 1:]: v for k, v in doc.items() if k.startswith(prefix + ".")}
    return picked or None
