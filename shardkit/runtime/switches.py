"""The memory and speed switches of the diffusers guides, as one table of small strategies.

Each switch wraps diffusers' or torch's own method and says what it trades, as the diffusers
"Reduce memory usage" and "Accelerate inference" guides measure it:

=====================  ==========================================  ===========================================
switch                 memory                                      speed / quality
=====================  ==========================================  ===========================================
``dtype`` fp16/bf16    halves weights and activations vs fp32      ~2x faster on tensor cores; fp16 can
                                                                   overflow (SDXL's VAE: NaNs) — prefer bf16
``channels_last``      none                                        a few % faster convolutions (UNet, VAE)
``attention_backend``  "sdpa" (default) and "xformers" never       both memory-efficient kernels; xFormers
                       materialise the attention matrix            only when installed, needs CUDA
``attention_slicing``  only helps with eager attention (scores     ~10% slower; with SDPA/xFormers it is
                       computed half the heads at a time)          slower *and* not smaller — rarely worth it
``vae_slicing``        decodes a batch one image at a time:        no cost for one image; tiny for batches
                       VAE peak / batch size
``vae_tiling``         decodes overlapping tiles: VAE peak         some % slower; tile seams are blended but
                       bounded by one tile, not the image          can show on flat areas
``tf32``               none                                        up to ~3x faster fp32 matmuls on Ampere+;
                                                                   10-bit mantissa for fp32 matmuls
=====================  ==========================================  ===========================================

apply_switches(pipe, {"dtype": "bf16", "vae_tiling": True, "attention_backend": "sdpa"})
['dtype', 'attention_backend', 'vae_tiling']

A switch that cannot apply (tiling on a VAE that lacks it, xFormers not installed, TF32 without an
Ampere GPU) is refused with the reason, before anything is changed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import InvalidInputError
from ..units import normalize_dtype

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Switch:
    """One switch: what it trades, why it may not apply, and how to turn it on."""

    name: str
    memory: str
    speed: str
    unsupported: Callable[[object, object], str | None]
    apply: Callable[[object, object], None]


# ----------------------------------------------------------------------------- component access

def models(obj: object) -> dict[str, torch.nn.Module]:
    """The ``nn.Module`` components of a pipeline by name, or ``{"model": obj}`` for one model."""
    import torch

    components = getattr(obj, "components", None)
    if isinstance(components, dict):
        return {k: v for k, v in components.items() if isinstance(v, torch.nn.Module)}
    return {"model": obj} if isinstance(obj, torch.nn.Module) else {}


def _vae(obj: object) -> object | None:
    vae = getattr(obj, "vae", None)
    if vae is None and type(obj).__name__.startswith(("Autoencoder", "VQModel", "ConsistencyDecoderVAE")):
        vae = obj
    return vae


def _vae_flag(flag: str, what: str) -> Callable[[object, object], str | None]:
    def check(obj: object, value: object) -> str | None:
        vae = _vae(obj)
        if vae is None:
            return "there is no VAE component"
        # diffusers' AutoencoderMixin.enable_* raise NotImplementedError unless the model sets the flag.
        if not hasattr(vae, flag):
            return f"{type(vae).__name__} does not support {what} (diffusers implements it only for some VAEs)"
        return None
    return check


def _enable_vae(method: str) -> Callable[[object, object], None]:
    def apply(obj: object, value: object) -> None:
        vae = _vae(obj)
        getattr(vae, method if value else method.replace("enable", "disable"))()
    return apply


# ----------------------------------------------------------------------------- strategies

def _no_sliceable(obj: object, value: object) -> str | None:
    if any(hasattr(m, "set_attention_slice") for m in models(obj).values()):
        return None
    return "no component supports attention slicing (diffusers implements it for UNet-style models)"


def _slice_attention(obj: object, value: object) -> None:
    size = "auto" if value is True else (None if value is False else value)
    if hasattr(obj, "enable_attention_slicing"):
        obj.enable_attention_slicing(size)
        return
    _call_each(obj, "set_attention_slice", size)


def _call_each(obj: object, method: str, *args: object) -> None:
    """Call diffusers' ``method`` on each model of ``obj`` that has it (typed ``nn.Module``s do not)."""
    for model in models(obj).values():
        bound = getattr(model, method, None)
        if callable(bound):
            bound(*args)


def _conv_models(obj: object) -> list[torch.nn.Module]:
    import torch

    return [m for m in models(obj).values() if any(isinstance(x, torch.nn.Conv2d) for x in m.modules())]


def _no_convs(obj: object, value: object) -> str | None:
    return None if _conv_models(obj) else "no component has 2-D convolutions (channels_last only helps convs)"


def _channels_last(obj: object, value: object) -> None:
    import torch

    fmt = torch.channels_last if value else torch.contiguous_format
    for model in _conv_models(obj):
        model.to(memory_format=fmt)  # type: ignore[call-overload]  # Module.to takes it; torch's stubs omit it


ATTENTION_BACKENDS = ("sdpa", "xformers")


def _backend_unsupported(obj: object, value: object) -> str | None:
    import torch

    if value not in ATTENTION_BACKENDS:
        return f"unknown attention backend {value!r}; use one of {', '.join(ATTENTION_BACKENDS)}"
    if value == "xformers":
        if importlib.util.find_spec("xformers") is None:
            return "xFormers is not installed (pip install xformers); PyTorch SDPA is the default and as frugal"
        if not torch.cuda.is_available():
            return "xFormers kernels need a CUDA GPU"
    return None


def _set_backend(obj: object, value: object) -> None:
    if value == "xformers":
        _call_each(obj, "enable_xformers_memory_efficient_attention")
        return
    # diffusers logs that set_attention_backend is experimental; the library leaves diffusers'
    # logging alone (the CLI quiets it, an application decides for itself).
    # "native" is diffusers' name for torch.nn.functional.scaled_dot_product_attention.
    _call_each(obj, "set_attention_backend", "native")


def _no_ampere(obj: object, value: object) -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "TF32 needs an Ampere-or-newer NVIDIA GPU and none is visible"
    major, _ = torch.cuda.get_device_capability()
    if major < 8:
        return f"TF32 needs an Ampere-or-newer GPU (compute capability 8.0+); this one is {major}.x"
    return None


def _allow_tf32(obj: object, value: object) -> None:
    import torch

    # Process-wide by design in torch: it affects every fp32 matmul and convolution afterwards.
    torch.backends.cuda.matmul.allow_tf32 = bool(value)
    torch.backends.cudnn.allow_tf32 = bool(value)


HALF_DTYPES = ("F16", "BF16")


def _half_code(value: object) -> str | None:
    """``"bf16"``, ``"float16"``, ``torch.float16``... → its code when it is a half type, else None."""
    try:
        code = normalize_dtype(str(value).removeprefix("torch."))
    except InvalidInputError:
        return None
    return code if code in HALF_DTYPES else None


def _bad_dtype(obj: object, value: object) -> str | None:
    return None if _half_code(value) else f"dtype must be fp16 or bf16, got {value!r}"


def _to_dtype(obj: object, value: object) -> None:
    from ..formats.dtypes import to_torch

    dtype = to_torch(normalize_dtype(str(value).removeprefix("torch.")))  # a half type: checked by _bad_dtype
    for model in models(obj).values():
        model.to(dtype=dtype)


SWITCHES: dict[str, Switch] = {s.name: s for s in (
    Switch("dtype", "halves weights and activations vs fp32",
           "~2x faster on tensor cores; fp16 may overflow (NaNs) in some VAEs, bf16 does not",
           _bad_dtype, _to_dtype),
    Switch("channels_last", "none", "a few % faster convolutions", _no_convs, _channels_last),
    Switch("attention_backend", "sdpa/xformers never materialise attention scores",
           "both fast; xformers needs the package and CUDA", _backend_unsupported, _set_backend),
    Switch("attention_slicing", "halves eager attention scores; none with SDPA",
           "~10% slower; slower and no smaller with SDPA", _no_sliceable, _slice_attention),
    Switch("vae_slicing", "VAE decode peak / batch size", "none for one image, tiny for batches",
           _vae_flag("use_slicing", "slicing"), _enable_vae("enable_slicing")),
    Switch("vae_tiling", "VAE decode peak bounded by one tile", "some % slower; faint seams possible",
           _vae_flag("use_tiling", "tiling"), _enable_vae("enable_tiling")),
    Switch("tf32", "none", "up to ~3x faster fp32 matmuls on Ampere+, 10-bit mantissa", _no_ampere, _allow_tf32),
)}


# ----------------------------------------------------------------------------- public API

def normalize_switches(switches: Mapping[str, object] | Iterable[str] | None) -> dict[str, object]:
    """``["vae_tiling", ...]`` or ``{"dtype": "bf16", ...}`` → ordered ``{name: value}``."""
    if switches is None:
        return {}
    items = dict(switches) if isinstance(switches, Mapping) else {name: True for name in switches}
    unknown = sorted(set(items) - set(SWITCHES))
    if unknown:
        raise InvalidInputError(f"unknown switch(es) {', '.join(unknown)}; known: {', '.join(SWITCHES)}")
    return {name: items[name] for name in SWITCHES if name in items and items[name] is not None}


def unsupported_reason(obj: object, name: str, value: object = True) -> str | None:
    """Why switch ``name`` cannot apply to ``obj`` (a pipeline or model), or None when it can.

    unsupported_reason(vq_pipe, "vae_tiling")
    'VQModel does not support tiling (diffusers implements it only for some VAEs)'
    """
    switch = SWITCHES.get(name)
    if switch is None:
        return f"unknown switch {name!r}"
    if value is False:
        return None
    return switch.unsupported(obj, value)


def apply_switches(obj: object, switches: Mapping[str, object] | Iterable[str] | None) -> list[str]:
    """Turn on ``switches`` on a diffusers pipeline or model; refuse them all if one cannot apply.

    Values: ``True``/``False`` for flags, ``"fp16"``/``"bf16"`` for ``dtype``, ``"sdpa"``/``"xformers"``
    for ``attention_backend``, ``"auto"``/``"max"``/an int for ``attention_slicing``. Applied in table
    order (dtype first), before any offload hooks are installed.

    apply_switches(pipe, ["vae_slicing", "vae_tiling"])
    ['vae_slicing', 'vae_tiling']
    """
    wanted = normalize_switches(switches)
    reasons = [f"{name}: {reason}" for name, value in wanted.items()
               if (reason := unsupported_reason(obj, name, value))]
    if reasons:
        raise InvalidInputError(f"cannot apply switch(es) to {type(obj).__name__}: " + "; ".join(reasons))
    for name, value in wanted.items():
        SWITCHES[name].apply(obj, value)
    return list(wanted)
