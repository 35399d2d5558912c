"""The ``{arch}.*`` GGUF keys of a transformers config, as llama.cpp's converter writes them for each architecture
entry of :mod:`shardkit.layouts.gguf_arch`: its ``TextModel.set_gguf_parameters`` (plus Llama's, BERT's and the MoE
keys), or an architecture's own (Gemma 2, Gemma 3, Phi-3; gpt-oss adds the sliding window and the experts' width to
TextModel's); rope scaling (Llama 3.1's computed
``rope_freqs.weight``, linear/yarn/longrope keys) and sentence-transformers' pooling type.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..errors import InvalidInputError, Option
from ..formats.gguf import Scalar
from ..formats.json_types import Config
from .gguf_arch import BOOL, F32, STR, U32, GgufArch

__all__ = ["POOLING", "arch_metadata", "llama3_rope_factors", "pooling_type", "rope_parameters", "with_defaults"]


def _first(config: Config, keys: tuple[str, ...]) -> Scalar | None:
    """The converter's ``find_hparam``: the value of the first key present (None included), as config.json gives it
    (``put`` checks the integers, as the converter does)."""
    return next((config[k] for k in keys if k in config), None)


class _Keys:
    """The ``{arch}.*`` rows being written; ``put`` checks integers as the converter's writer does."""

    def __init__(self, arch: GgufArch, where: str) -> None:
        self.arch, self.where, self.rows = arch, where, list[tuple[str, str, Scalar]]()

    def put(self, key: str, kind: str, value: Scalar | None) -> None:
        if value is None:
            return
        if kind == U32 and (not isinstance(value, int) or isinstance(value, bool)):
            raise InvalidInputError(f"{self.where}: config.json gives {value!r} for {self.arch.name}.{key}; an integer "
                                    "is needed")
        self.rows.append((f"{self.arch.name}.{key}", kind, float(value) if kind == F32 else value))


def arch_metadata(arch: GgufArch, config: Config, folder: str, *, where: str) -> list[tuple[str, str, Scalar]]:
    """The ``{arch}.*`` keys llama.cpp's converter writes for ``config``: ``(key, "u32"/"f32"/"bool"/"str", value)``.

    Raises:
        InvalidInputError: a config missing the layer count or a field the architecture's converter requires, or an
            integer field that is not one.
    """
    keys = _Keys(arch, where)
    config = with_defaults(config)
    layers = _first(config, ("n_layers", "num_hidden_layers", "n_layer", "num_layers"))
    if layers is None:
        raise InvalidInputError(f"{where}: config.json has no num_hidden_layers; GGUF's {arch.name}.block_count needs it")
    if arch.keys == "gemma2":
        _gemma2_keys(keys, config, layers)
    elif arch.keys == "gemma3":
        _gemma3_keys(keys, config, layers, folder)
    elif arch.keys == "phi3":
        _phi3_keys(keys, config, layers)
    elif arch.keys == "nomic":  # the converter's NomicBertModel: BertModel's keys
        _text_keys(keys, _nomic_config(config, where=where), layers, folder)
    elif arch.keys == "gpt_oss":  # the converter's GptOssModel: TextModel's, then these two
        _text_keys(keys, config, layers, folder)
        keys.put("attention.sliding_window", U32, _need(config, keys, "sliding_window"))
        keys.put("expert_feed_forward_length", U32, _need(config, keys, "intermediate_size"))
    else:
        _text_keys(keys, config, layers, folder)
    return keys.rows


# What transformers' config classes fill in for a field config.json leaves out (the converter reads
# AutoConfig.from_pretrained(...).to_dict(), so it writes these): model_type → field → value or "hidden/heads".
_DEFAULTS: dict[str, dict[str, object]] = {
    "llama": {"head_dim": "hidden/heads", "rope_theta": 10000.0, "rms_norm_eps": 1e-6},
    "mistral": {"head_dim": "hidden/heads", "rope_theta": 10000.0, "rms_norm_eps": 1e-6},
    "qwen2": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6},
    "qwen3": {"head_dim": 128, "rope_theta": 10000.0, "rms_norm_eps": 1e-6},
    "qwen3_moe": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6},
    "gemma2": {"head_dim": 256},
    "gemma3_text": {"head_dim": 256, "rms_norm_eps": 1e-6},
    "phi3": {"rope_theta": 10000.0},
}


def with_defaults(config: Config) -> Config:
    """``config`` with the fields its transformers config class would fill in (see :data:`_DEFAULTS`); rope_theta
    only where no rope parameters carry one.

    >>> with_defaults({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4})["head_dim"]
    16
    """
    out = dict(config)
    for key, value in _DEFAULTS.get(str(config.get("model_type")), {}).items():
        if key in out or (key == "rope_theta" and _rope_theta(config) is not None):
            continue
        if value == "hidden/heads":
            hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
            if not isinstance(hidden, int) or not isinstance(heads, int) or heads <= 0:
                continue
            value = hidden // heads
        out[key] = value
    return out


def _nomic_config(config: Config, *, where: str) -> Config:
    """A nomic-bert config.json (remote code: ``n_embd``, ``n_layer``, ``n_head``, ``n_inner``, ``rotary_emb_base``...) as
    the converter reads it through transformers' ``NomicBertConfig``: its own fields where config.json has them,
    context 2048 (nomic-embed-text v1/v1.5 are trained for 2048 positions), ``head_dim`` hidden / heads.

    Raises:
        InvalidInputError: what the converter refuses too (MoE, prenorm, biases, partial or interleaved rope...).
    """
    expected = {"activation_function": "swiglu", "causal": False, "qkv_proj_bias": False, "mlp_fc1_bias": False,
                "mlp_fc2_bias": False, "prenorm": False, "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False,
                "rotary_emb_scale_base": None}
    wrong = [f"{k}={config.get(k)!r}" for k, v in expected.items() if config.get(k, v) != v]
    if config.get("moe_every_n_layers"):
        wrong.append(f"moe_every_n_layers={config['moe_every_n_layers']!r}")
    positions = (config.get("n_positions", 8192), config.get("max_trained_positions", 2048))
    if positions != (8192, 2048):
        wrong.append(f"n_positions, max_trained_positions = {positions}")
    if wrong:
        raise InvalidInputError(f"{where}: ", Option("to", "gguf"),
                                " writes nomic-bert as llama.cpp's converter does (nomic-embed-text "
                                f"v1/v1.5: swiglu, post-norm, no biases, full rope, no MoE); this config has "
                                f"{', '.join(wrong)}")
    native = {"hidden_size": config.get("n_embd"), "num_hidden_layers": config.get("n_layer"),
              "num_attention_heads": config.get("n_head"), "intermediate_size": config.get("n_inner"),
              "max_position_embeddings": 2048, "layer_norm_eps": config.get("layer_norm_epsilon"),
              "rope_theta": config.get("rotary_emb_base", 1000.0)}
    out = {**{k: v for k, v in native.items() if v is not None}, **config}
    hidden, heads = out.get("hidden_size"), out.get("num_attention_heads")
    if "head_dim" not in out and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        out["head_dim"] = hidden // heads
    return out


def _need(config: Config, keys: _Keys, key: str) -> Scalar:
    value = config.get(key)
    if not isinstance(value, (int, float, bool, str)):
        raise InvalidInputError(f"{keys.where}: config.json has no {key} (or not a number); llama.cpp's converter needs "
                                f"it for {keys.arch.name}")
    return value


def _text_keys(keys: _Keys, config: Config, layers: Scalar, folder: str) -> None:
    """The converter's ``TextModel.set_gguf_parameters`` (plus Llama's, BERT's and the MoE ones)."""
    put, arch = keys.put, keys.arch
    put("block_count", U32, layers)
    put("context_length", U32, _first(config, ("max_position_embeddings", "n_ctx", "n_positions", "max_length",
                                                "max_sequence_length", "model_max_length")))
    put("embedding_length", U32, _first(config, ("hidden_size", "n_embd", "dim")))
    put("feed_forward_length", U32, _first(config, ("prefix_dense_intermediate_size", "dense_intermediate_size",
                                                    "intermediate_size", "n_inner", "hidden_dim")))
    put("attention.head_count", U32, _first(config, ("num_attention_heads", "n_head", "n_heads")))
    put("attention.head_count_kv", U32, _first(config, ("num_key_value_heads", "n_kv_heads")))
    if config.get("is_causal") is False:
        put("attention.causal", BOOL, False)
    for key, kind, value in _rope_scaling(config):
        put(key, kind, value)
    put("rope.freq_base", F32, _rope_theta(config))
    put("attention.layer_norm_rms_epsilon", F32, _first(config, ("rms_norm_eps", "norm_eps")))
    put("attention.layer_norm_epsilon", F32, _first(config, ("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon")))
    put("expert_count", U32, _first(config, ("num_local_experts", "num_experts", "n_routed_experts")))
    put("expert_used_count", U32, _first(config, ("num_experts_per_tok", "num_experts_per_token", "top_k_experts")))
    put("attention.key_length", U32, config.get("head_dim"))
    put("attention.value_length", U32, config.get("head_dim"))
    if arch.experts:  # the converter's Qwen2MoeModel
        put("expert_feed_forward_length", U32, config.get("moe_intermediate_size"))
        put("expert_shared_feed_forward_length", U32, config.get("shared_expert_intermediate_size"))
    if arch.llama_keys:
        put("vocab_size", U32, config.get("vocab_size"))
        heads = config.get("num_attention_heads")
        rope_dim = config.get("head_dim")
        if rope_dim is None and isinstance(heads, int) and heads > 0 and isinstance(config.get("hidden_size"), int):
            rope_dim = config["hidden_size"] // heads
        put("rope.dimension_count", U32, rope_dim)
    if arch.bert:
        put("attention.causal", BOOL, False)
        put("pooling_type", U32, pooling_type(folder, where=keys.where))


def _gemma2_keys(keys: _Keys, config: Config, layers: Scalar) -> None:
    """The converter's ``Gemma2Model.set_gguf_parameters`` (no rope keys; softcapping and sliding window)."""
    put = keys.put
    put("context_length", U32, _need(config, keys, "max_position_embeddings"))
    put("embedding_length", U32, _need(config, keys, "hidden_size"))
    put("block_count", U32, layers)
    put("feed_forward_length", U32, _need(config, keys, "intermediate_size"))
    put("attention.head_count", U32, _need(config, keys, "num_attention_heads"))
    put("attention.head_count_kv", U32, config.get("num_key_value_heads", config.get("num_attention_heads")))
    put("attention.layer_norm_rms_epsilon", F32, _need(config, keys, "rms_norm_eps"))
    put("attention.key_length", U32, _need(config, keys, "head_dim"))
    put("attention.value_length", U32, _need(config, keys, "head_dim"))
    put("attn_logit_softcapping", F32, _need(config, keys, "attn_logit_softcapping"))
    put("final_logit_softcapping", F32, _need(config, keys, "final_logit_softcapping"))
    put("attention.sliding_window", U32, _need(config, keys, "sliding_window"))


def _gemma3_keys(keys: _Keys, config: Config, layers: Scalar, folder: str) -> None:
    """The converter's ``Gemma3Model.set_gguf_parameters``: TextModel's keys, the sliding layers' rope base, then its
    own (a key written twice keeps its place and takes the later value, as gguf-py's writer does)."""
    _text_keys(keys, config, layers, folder)
    put = keys.put
    params = config.get("rope_parameters", config.get("rope_scaling")) or {}
    sliding = params.get("sliding_attention") if isinstance(params, Mapping) else None
    put("rope.freq_base_swa", F32, sliding.get("rope_theta") if isinstance(sliding, Mapping) else None)
    put("context_length", U32, config.get("max_position_embeddings", 131072))
    put("attention.head_count", U32, config.get("num_attention_heads", 8))
    put("attention.layer_norm_rms_epsilon", F32, config.get("rms_norm_eps", 1e-6))
    put("attention.key_length", U32, config.get("head_dim", 256))
    put("attention.value_length", U32, config.get("head_dim", 256))
    put("rope.freq_base", F32, _rope_theta(config) or 1_000_000.0)
    put("final_logit_softcapping", F32, config.get("final_logit_softcapping") or None)
    if config.get("sliding_window_pattern") != 1:
        put("attention.sliding_window", U32, _need(config, keys, "sliding_window"))
    put("attention.head_count_kv", U32, config.get("num_key_value_heads", 4))
    seen: dict[str, tuple[str, str, Scalar]] = {}
    for row in keys.rows:
        seen[row[0]] = row  # a key already seen keeps its place
    keys.rows = list(seen.values())


def _phi3_keys(keys: _Keys, config: Config, layers: Scalar) -> None:
    """The converter's ``Phi3MiniModel.set_gguf_parameters``."""
    put = keys.put
    hidden, heads = _first(config, ("hidden_size", "n_embd")), _first(config, ("num_attention_heads", "n_head"))
    params = rope_parameters(config)
    original = params.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
    if not isinstance(hidden, int) or not isinstance(heads, int) or heads <= 0 or original is None:
        raise InvalidInputError(f"{keys.where}: phi3 needs hidden_size, num_attention_heads and "
                                "original_max_position_embeddings in config.json (llama.cpp's converter reads them)")
    rotary = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    put("context_length", U32, _first(config, ("n_positions", "max_position_embeddings")))
    put("rope.scaling.original_context_length", U32, original)
    put("embedding_length", U32, hidden)
    put("feed_forward_length", U32, _need(config, keys, "intermediate_size"))
    put("block_count", U32, layers)
    put("attention.head_count", U32, heads)
    put("attention.head_count_kv", U32, _first(config, ("num_key_value_heads", "n_head_kv")))
    put("attention.layer_norm_rms_epsilon", F32, _need(config, keys, "rms_norm_eps"))
    put("rope.dimension_count", U32, int(float(rotary) * hidden) // heads)
    put("rope.freq_base", F32, _rope_theta(config))
    put("attention.sliding_window", U32, config.get("sliding_window") or 0)


def rope_parameters(config: Config) -> Config:
    """The converter's ``rope_parameters`` (``rope_parameters`` or ``rope_scaling``, ``type`` read as ``rope_type``)."""
    params = config.get("rope_parameters", config.get("rope_scaling")) or {}
    params = params.get("full_attention", params) if isinstance(params, Mapping) else {}
    if "rope_type" not in params and "type" in params:
        params = {**params, "rope_type": params["type"]}
    return params if isinstance(params, Mapping) else {}


def _rope_scaling(config: Config) -> list[tuple[str, str, Scalar | None]]:
    """``rope.scaling.*`` as the converter writes them: linear and yarn (llama3's go into ``rope_freqs.weight``)."""
    params = rope_parameters(config)
    kind, factor = params.get("rope_type"), params.get("factor")
    if kind not in ("linear", "yarn", "su", "longrope") or (kind in ("linear", "yarn") and factor is None):
        return []
    if kind in ("su", "longrope"):
        return [("rope.scaling.type", STR, "longrope")]
    out: list[tuple[str, str, Scalar | None]] = [("rope.scaling.type", STR, kind), ("rope.scaling.factor", F32, factor)]
    if kind == "yarn":
        out.append(("rope.scaling.original_context_length", U32, params.get("original_max_position_embeddings")))
        for key, names in (("yarn_ext_factor", ("extrapolation_factor",)),
                           ("yarn_attn_factor", ("attention_factor", "attn_factor")),
                           ("yarn_beta_fast", ("beta_fast",)), ("yarn_beta_slow", ("beta_slow",))):
            out.append((f"rope.scaling.{key}", F32, next((params[n] for n in names if n in params), None)))
    return out


def llama3_rope_factors(config: Config) -> bytes | None:
    """The float32 bytes of ``rope_freqs.weight`` for a Llama 3.1-style ``rope_type: llama3`` config, computed as the
    converter does (torch float32 arithmetic, value by value); None for other configs."""
    import math

    import torch

    params = rope_parameters(config)
    if str(params.get("rope_type", "")).lower() != "llama3":
        return None
    base = params.get("rope_theta", _rope_theta(config) or 10000.0)
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = params.get("factor", 8.0), params.get("low_freq_factor", 1.0), params.get("high_freq_factor", 4.0)
    old = params.get("original_max_position_embeddings", 8192)
    factors: list[float | torch.Tensor] = []  # 0-d tensors where computed from a frequency
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy().tobytes()


def _rope_theta(config: Config) -> float | None:
    params = config.get("rope_parameters", config.get("rope_scaling")) or {}
    if isinstance(params, Mapping):
        params = params.get("full_attention", params)
    theta = params.get("rope_theta") if isinstance(params, Mapping) else None
    theta = config.get("rope_theta") if theta is None else theta
    return float(theta) if isinstance(theta, (int, float)) and not isinstance(theta, bool) else None


POOLING = {"mean": 1, "cls": 2, "lasttoken": 3}  # llama.cpp's LLAMA_POOLING_TYPE_*


def pooling_type(folder: str, *, where: str) -> int | None:
    """sentence-transformers' pooling (``modules.json`` → its Pooling module's ``config.json``), as llama.cpp's id."""
    from ..formats.links import parse_json, read_inside

    if not os.path.isfile(os.path.join(folder, "modules.json")):
        return None
    modules = parse_json(read_inside(folder, "modules.json", where=where), path=os.path.join(folder, "modules.json"))
    path = next((m.get("path") for m in modules if isinstance(m, dict) and str(m.get("type", "")).endswith("Pooling")),
                None) if isinstance(modules, list) else None
    if not isinstance(path, str):
        return None
    name = os.path.join(path, "config.json")
    pooling = parse_json(read_inside(folder, name, where=where), path=os.path.join(folder, name))
    pooling = pooling if isinstance(pooling, dict) else {}
    for key, kind in (("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls"),
                      ("pooling_mode_lasttoken", "lasttoken")):
        if pooling.get(key):
            return POOLING[kind]
    if pooling.get("pooling_mode") in POOLING:
        return POOLING[str(pooling["pooling_mode"])]
    raise InvalidInputError(f"{os.path.join(folder, name)}: a pooling mode llama.cpp lacks; it has mean, cls and "
                            "lasttoken")
