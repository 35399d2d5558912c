"""Layerwise casting: store weights in fp8, compute in bf16/fp16, one layer at a time.

A thin layer over diffusers' ``apply_layerwise_casting`` hook: shardkit chooses which layers to
skip (normalisation, embedding and modulation layers are precision-critical), resolves dtypes
given as strings, accepts a diffusers pipeline as well as any ``nn.Module``, and reports what it
did and how many bytes it saved.

report = apply_layerwise_casting(transformer, "float8_e4m3fn", "bfloat16")
report.saved_bytes
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import InvalidInputError, parts_of
from ..units import COMPUTE_DTYPES, STORAGE_DTYPES, TORCH_NAMES

if TYPE_CHECKING:
    import torch
    from diffusers import DiffusionPipeline
    from torch import nn

# diffusers' own defaults plus the modulation / timestep / embedding layers that its per-model
# ``_skip_layerwise_casting_patterns`` lists name for most (not all) architectures: a scale/shift
# computed in fp8 multiplies every activation of a block, so those layers are kept as they are.
EXTRA_SKIP_PATTERNS: tuple[str, ...] = (
    "norm", "embed", "time_emb", "emb_proj", "modulation", "adaln", "ada_ln", "scale_shift",
)
# Pipeline components cast by default: the denoisers hold nearly all the weights; text encoders
# are run once per prompt and are more sensitive.
DEFAULT_PIPELINE_COMPONENTS = ("transformer", "transformer_2", "unet", "prior", "decoder")


@dataclass
class CastingReport:
    """What :func:`apply_layerwise_casting` did: which layers hold ``storage_dtype`` between calls.

    Attributes:
        storage_dtype: the dtype weights are stored in between forwards (``"float8_e4m3fn"``...).
        compute_dtype: the dtype each layer computes in (``"bfloat16"``...).
        cast_modules: names of the layers stored in ``storage_dtype`` (``component.`` prefixed
            for a pipeline).
        skipped_modules: names of the layers kept in ``compute_dtype``.
        before_bytes: bytes of parameters and buffers before casting.
        after_bytes: bytes after casting; ``saved_bytes`` is the difference.
    """

    storage_dtype: str
    compute_dtype: str
    cast_modules: list[str] = field(default_factory=list)
    skipped_modules: list[str] = field(default_factory=list)
    before_bytes: int = 0
    after_bytes: int = 0

    @property
    def saved_bytes(self) -> int:
        """Bytes freed by casting."""
        return self.before_bytes - self.after_bytes

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready summary (``cast_modules`` as a count)."""
        return {
            "storage_dtype": self.storage_dtype, "compute_dtype": self.compute_dtype,
            "cast_modules": len(self.cast_modules), "skipped_modules": self.skipped_modules,
            "before_bytes": self.before_bytes, "after_bytes": self.after_bytes,
            "saved_bytes": self.saved_bytes,
        }


def resolve_casting_dtypes(storage_dtype: str | torch.dtype | None, compute_dtype: str | torch.dtype | None
                           ) -> tuple[torch.dtype, torch.dtype]:
    """``("float8_e4m3fn", "bf16")`` → ``(torch.float8_e4m3fn, torch.bfloat16)``, validated."""
    from ..formats.dtypes import from_torch, resolve_torch_dtype

    pairs = ((storage_dtype, STORAGE_DTYPES, "storage"), (compute_dtype, COMPUTE_DTYPES, "compute"))
    resolved = []
    for value, allowed, role in pairs:
        try:
            dtype = resolve_torch_dtype(value)
        except InvalidInputError as e:
            raise InvalidInputError(f"layerwise casting: bad {role} dtype {value!r}: ", *parts_of(e)) from e
        if dtype is None or from_torch(dtype) not in allowed:
            raise InvalidInputError(f"layerwise casting: {role} dtype must be one of "
                                    f"{', '.join(TORCH_NAMES[code] for code in allowed)}, got {value!r}")
        resolved.append(dtype)
    return resolved[0], resolved[1]


def skip_patterns(module: nn.Module, skip: str | Sequence[str] | None = "default") -> tuple[str, ...]:
    """The regex patterns whose matching module names keep their dtype.

    ``"default"``: diffusers' defaults, the model's own ``_skip_layerwise_casting_patterns`` and
    ``_keep_in_fp32_modules``, and :data:`EXTRA_SKIP_PATTERNS`; ``None``: skip nothing; a list:
    exactly those patterns.
    """
    if skip is None:
        return ()
    if isinstance(skip, str) and skip != "default":
        return (skip,)
    if skip != "default":
        return tuple(skip)
    from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN

    own = tuple(getattr(module, "_skip_layerwise_casting_patterns", None) or ())
    fp32 = tuple(getattr(module, "_keep_in_fp32_modules", None) or ())
    return tuple(dict.fromkeys((*DEFAULT_SKIP_MODULES_PATTERN, *own, *fp32, *EXTRA_SKIP_PATTERNS)))


def default_skip_classes() -> tuple[type, ...]:
    from torch import nn

    return (nn.Embedding, nn.LayerNorm, nn.GroupNorm, getattr(nn, "RMSNorm", nn.LayerNorm))


def casting_targets(
    module: nn.Module, *, skip: str | Sequence[str] | None = "default", skip_classes: tuple[type, ...] | None = None
) -> tuple[list[tuple[str, nn.Module]], list[str]]:
    """``(cast, skipped)``: the layers that would hold the storage dtype, and the names skipped.

    Pure (works on a meta skeleton, installs nothing); follows the same walk as diffusers'
    ``apply_layerwise_casting`` — a skipped name prunes its subtree, supported layers are leaves —
    so :mod:`shardkit.fitting.estimate` can price fp8 storage without touching weights.
    """
    from diffusers.hooks._common import _GO_LC_SUPPORTED_PYTORCH_LAYERS as supported

    patterns = skip_patterns(module, skip)
    classes = default_skip_classes() if skip_classes is None else tuple(skip_classes)
    cast: list[tuple[str, nn.Module]] = []
    skipped: list[str] = []

    def walk(mod: nn.Module, prefix: str) -> None:
        if isinstance(mod, classes) or any(re.search(p, prefix) for p in patterns):
            if any(isinstance(m, supported) for m in mod.modules()):
                skipped.append(prefix)
            return
        if isinstance(mod, supported):
            cast.append((prefix, mod))
            return
        for name, child in mod.named_children():
            walk(child, f"{prefix}.{name}" if prefix else name)

    walk(module, "")
    return cast, skipped


def apply_layerwise_casting(
    obj: nn.Module | DiffusionPipeline | Sequence[nn.Module],
    storage_dtype: str | torch.dtype = "float8_e4m3fn",
    compute_dtype: str | torch.dtype = "bfloat16",
    *,
    skip: str | Sequence[str] | None = "default",
    skip_classes: tuple[type, ...] | None = None,
    components: Sequence[str] | None = None,
    non_blocking: bool = False,
) -> CastingReport:
    """Store the weights of ``obj``'s layers in ``storage_dtype``; upcast each layer for its forward.

    ``obj`` is any ``nn.Module`` (diffusers model, transformers model, plain torch) or a diffusers
    pipeline (then ``components`` are cast, by default the denoiser). Floating tensors that are not
    in ``compute_dtype`` are first converted to it, so skipped layers compute in the same dtype.
    Not reversible: reload the model to undo.

    Args:
        obj: an ``nn.Module`` or a diffusers pipeline, with its weights loaded (not on meta).
        storage_dtype: ``"float8_e4m3fn"`` or ``"float8_e5m2"`` (or the ``torch.dtype``).
        compute_dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"`` (aliases such as
            ``"bf16"`` work too).
        skip: ``"default"`` (diffusers' defaults, the model's own skip patterns and
            :data:`EXTRA_SKIP_PATTERNS`), None to skip nothing, or regex patterns of module
            names to keep in ``compute_dtype``; see :func:`skip_patterns`.
        skip_classes: layer classes to keep; None means embeddings and norm layers.
        components: for a pipeline, the components to cast; None means the denoisers in
            :data:`DEFAULT_PIPELINE_COMPONENTS` that it has.
        non_blocking: passed to diffusers' hook for the per-forward dtype moves.

    Returns:
        A :class:`CastingReport`.

    Raises:
        InvalidInputError: a dtype outside the allowed ones, casting already active, weights
            still on the meta device, an unknown component, or ``components`` for a module.

    r = apply_layerwise_casting(unet, "float8_e4m3fn", "bfloat16")
    print(r.saved_bytes, r.skipped_modules[:3])
    """
    storage, compute = resolve_casting_dtypes(storage_dtype, compute_dtype)
    report = CastingReport(str(storage).removeprefix("torch."), str(compute).removeprefix("torch."))
    for prefix, module in _casting_modules(obj, components):
        _cast_one(module, prefix, storage, compute, report, skip=skip, skip_classes=skip_classes, non_blocking=non_blocking)
    return report


def _casting_modules(obj: object, components: Sequence[str] | None) -> Iterator[tuple[str, nn.Module]]:
    from torch import nn

    if isinstance(obj, nn.Module):
        if components is not None:
            raise InvalidInputError("layerwise casting: components= applies to pipelines, not to a single module")
        yield "", obj
        return
    pipeline_components = getattr(obj, "components", None)
    if not isinstance(pipeline_components, dict):
        raise InvalidInputError(
            f"layerwise casting needs an nn.Module or a diffusers pipeline, got {type(obj).__name__}"
        )
    names = list(components) if components is not None else [n for n in DEFAULT_PIPELINE_COMPONENTS if n in pipeline_components]
    for name in names:
        module = pipeline_components.get(name)
        if not isinstance(module, nn.Module):
            modules = sorted(k for k, v in pipeline_components.items() if isinstance(v, nn.Module))
            raise InvalidInputError(f"layerwise casting: pipeline has no model component {name!r}; it has {', '.join(modules)}")
        yield f"{name}.", module


def _cast_one(module: nn.Module, prefix: str, storage: torch.dtype, compute: torch.dtype,
              report: CastingReport, **options: Any) -> None:
    from diffusers.hooks import apply_layerwise_casting as diffusers_apply

    if _already_cast(module):
        raise InvalidInputError(
            f"layerwise casting is already active on {prefix.rstrip('.') or type(module).__name__}; reload the model to change it"
        )
    _refuse_meta(module, prefix)
    report.before_bytes += module_bytes(module)
    if any(t.is_floating_point() and t.dtype != compute for t in _tensors(module)):
        module.to(dtype=compute)
    cast, skipped = casting_targets(module, skip=options["skip"], skip_classes=options["skip_classes"])
    diffusers_apply(
        module, storage, compute, skip_modules_pattern=skip_patterns(module, options["skip"]),
        skip_modules_classes=default_skip_classes() if options["skip_classes"] is None else tuple(options["skip_classes"]),
        non_blocking=options["non_blocking"],
    )
    report.cast_modules += [prefix + name for name, _ in cast]
    report.skipped_modules += [prefix + name for name in skipped]
    report.after_bytes += module_bytes(module)


def _already_cast(module: nn.Module) -> bool:
    from diffusers.hooks.layerwise_casting import _is_layerwise_casting_active

    return _is_layerwise_casting_active(module)


def _refuse_meta(module: nn.Module, prefix: str) -> None:
    for name, tensor in module.named_parameters():
        if tensor.is_meta:
            raise InvalidInputError(
                f"layerwise casting: parameter {prefix}{name} is on the meta device; load the weights first "
                "(or use shardkit.estimate_memory to price fp8 storage on a skeleton)"
            )


def _tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def module_bytes(module: nn.Module) -> int:
    """Bytes held by the parameters and buffers of ``module`` (shared tensors counted once)."""
    seen: set[int] = set()
    total = 0
    for tensor in _tensors(module):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def is_cast(module: nn.Module) -> bool:
    """True when ``module`` itself carries a layerwise casting hook."""
    registry = getattr(module, "_diffusers_hook", None)
    return registry is not None and registry.get_hook("layerwise_casting") is not None
