"""What a component folder without ``config.json`` is, guessed from its tensor names and shapes.

The activation formulas (:mod:`shardkit.fitting.activations`) need a config: without one a UNet
priced with defaults looked like a text encoder and its activations dropped from 9.2 GB to 38 MB.
Here the role comes from the tensor names (``down_blocks.*`` + ``time_embedding.*`` is a UNet,
``encoder.*`` + ``decoder.*`` a VAE...) and the fields the formulas read from the shapes, and every
guess is described in words so that :func:`shardkit.fit` can say what it assumed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..formats.json_types import JsonObject

Shapes = dict[str, tuple[int, ...]]


@dataclass(frozen=True)
class Guess:
    """A role and the config fields read from the tensors, and what was assumed, in words."""

    role: str | None
    config: JsonObject = field(default_factory=dict)
    description: str = ""


def read_shapes(folder: str) -> Shapes:
    """Tensor name → shape, from the safetensors headers of a component folder (no weights read)."""
    from ..sources.safetensors import open_safetensors_folder

    with open_safetensors_folder(folder) as source:
        return {e.name: tuple(e.shape) for e in source.entries()}


def _indices(shapes: Shapes, pattern: str) -> list[int]:
    found = {int(m.group(1)) for k in shapes if (m := re.match(pattern, k))}
    return sorted(found)


def _unet(shapes: Shapes) -> JsonObject:
    levels = _indices(shapes, r"down_blocks\.(\d+)\.resnets\.")
    channels = [shapes[k][0] for i in levels if (k := f"down_blocks.{i}.resnets.0.conv1.weight") in shapes]
    if len(channels) != len(levels) or not channels:
        return {}
    attention = ["CrossAttnDownBlock2D" if any(k.startswith(f"down_blocks.{i}.attentions.") for k in shapes)
                 else "DownBlock2D" for i in levels]
    layers = len(_indices(shapes, r"down_blocks\.0\.resnets\.(\d+)\."))
    return {"block_out_channels": channels, "down_block_types": attention, "layers_per_block": layers}


def _vae(shapes: Shapes) -> JsonObject:
    levels = _indices(shapes, r"encoder\.down_blocks\.(\d+)\.resnets\.")
    channels = [shapes[k][0] for i in levels if (k := f"encoder.down_blocks.{i}.resnets.0.conv1.weight") in shapes]
    return {"block_out_channels": channels} if channels and len(channels) == len(levels) else {}


def _transformer(shapes: Shapes) -> JsonObject:
    query = next((s for k, s in sorted(shapes.items()) if re.search(r"transformer_blocks\.0\.attn\.to_q\.weight$", k)),
                 None)
    if not query:
        return {}
    # Only the width matters for SDPA; 64-wide heads (the usual) only shape the eager score term.
    config: JsonObject = {"num_attention_heads": max(1, query[0] // 64), "attention_head_dim": 64}
    if "context_embedder.weight" in shapes:
        config["joint_attention_dim"] = shapes["context_embedder.weight"][-1]
    if len(shapes.get("pos_embed.proj.weight", ())) == 4:
        config["patch_size"] = shapes["pos_embed.proj.weight"][-1]
    return config


def _text_encoder(shapes: Shapes) -> JsonObject:
    config: JsonObject = {}
    # CLIP's names start with "text_model." or not, depending on the transformers version that saved it.
    def get(name: str) -> tuple[int, ...] | None:
        return shapes.get(name) or shapes.get(f"text_model.{name}")

    embed = get("embeddings.token_embedding.weight") or shapes.get("shared.weight") \
        or shapes.get("encoder.embed_tokens.weight")
    if embed:
        config["hidden_size"] = embed[-1]
    positions = get("embeddings.position_embedding.weight")
    if positions:
        config["max_position_embeddings"] = positions[0]
    ff = next((s for k, s in sorted(shapes.items()) if re.search(r"(mlp\.fc1|DenseReluDense\.wi(_0)?)\.weight$", k)),
              None)
    if ff:
        config["intermediate_size"] = ff[0]
    return config


# (role, what it is called, a test on the tensor names, the config reader); first match wins.
_KINDS = (
    ("denoiser", "a UNet", lambda n: any(k.startswith("down_blocks.") for k in n)
     and any(k.startswith("time_embedding.") for k in n), _unet),
    ("vae", "a VAE", lambda n: any(k.startswith("encoder.") for k in n) and any(k.startswith("decoder.") for k in n),
     _vae),
    ("denoiser", "a diffusion transformer", lambda n: any(re.match(r"(single_)?transformer_blocks\.", k) for k in n),
     _transformer),
    ("text_encoder", "a text encoder", lambda n: any(k.startswith(("text_model.", "embeddings.token_embedding.",
                                                                   "encoder.block.", "shared.")) for k in n),
     _text_encoder),
)


def guess_component(shapes: Shapes, *, role: str | None) -> Guess:
    """Guess a config-less component's role (unless ``role`` is known) and config from its tensors.

    Args:
        shapes: tensor name → shape (:func:`read_shapes`).
        role: the role the component's name or class already gives, else None.

    Returns:
        A :class:`Guess`; ``description`` says what was assumed (always non-empty).

    >>> guess_component({"down_blocks.0.resnets.0.conv1.weight": (32, 4, 3, 3),
    ...                  "time_embedding.linear_1.weight": (128, 32)}, role=None).role
    'denoiser'
    """
    names = list(shapes)
    kind = next((k for k in _KINDS if (role is None or k[0] == role) and k[2](names)), None)
    if kind is None:
        what = f"a {role.replace('_', ' ')}" if role else "a text encoder"
        how = f"role {role!r} from its name" if role else "tensor names unlike any known component"
        return Guess(role, {}, f"no config.json and {how}: priced as {what} with default sizes "
                               "(activations may be far off); add the component's config.json")
    role_found, label, _, reader = kind
    config = reader(shapes)
    from_names = "" if role else " (from its tensor names)"
    fields = ", ".join(f"{k} {v}" for k, v in config.items())
    sizes = f"read {fields} from tensor shapes" if config else "default sizes (the shapes did not tell)"
    return Guess(role_found, config, f"no config.json: taken for {label}{from_names}; {sizes}")
