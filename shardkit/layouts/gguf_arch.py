"""The language-model architectures ``convert --to gguf`` writes, one layout entry each, as llama.cpp's converter does.

An entry says which ``config.json`` ``model_type`` values it takes, the ``general.architecture`` written,
how Hugging Face tensor names become llama.cpp's (``model.layers.N.<hf>`` → ``blk.N.<gguf>``, plus the
top-level ones), whether the q/k rows are permuted (Llama only), and which per-architecture keys come
from the config (the converter's ``TextModel.set_gguf_parameters``, plus ``vocab_size`` and
``rope.dimension_count`` for its ``LlamaModel``; ``causal_attention``, ``pooling_type`` and the BERT
sizes for BERT).

==========  ================================  =============================================================
written     ``model_type``                    what differs from Llama
==========  ================================  =============================================================
llama       llama, mistral                    (Mistral is written as llama, as llama.cpp's converter does)
qwen2       qwen2                             q/k/v biases, no q/k permutation, no vocab_size/rope keys
qwen3       qwen3                             q/k norms (``attn_q_norm``, ``attn_k_norm``), no biases
bert        bert                              embeddings, position and token-type tables, LayerNorm biases,
                                              no lm_head; pooling type from sentence-transformers' files
qwen3moe    qwen3_moe                         qwen3's, with each layer's experts stacked into one 3-D tensor
                                              (``ffn_gate_exps``, ``ffn_up_exps``, ``ffn_down_exps``, expert
                                              index first), the router ``ffn_gate_inp`` F32, expert keys
gemma2      gemma2                            every ``*norm.weight`` + 1 (float32, or float16 for an F16
                                              source, as the converter adds it), four norms a layer, no
                                              ``lm_head``, softcapping and sliding-window keys, no rope keys,
                                              ``add_space_prefix`` false
gemma3      gemma3_text                       gemma2's, with q/k norms (shifted too), the sliding layers' rope
                                              base, defaults for what its config leaves out
phi3        phi3                              fused ``qkv_proj`` (``attn_qkv``) and ``gate_up_proj``
                                              (``ffn_up``) kept fused; its own keys (rope dimension count
                                              from the partial rotary factor, original context length)
==========  ================================  =============================================================
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import InvalidInputError
from ..formats.gguf import Scalar
from ..formats.json_types import Config

__all__ = ["ARCHITECTURES", "GgufArch", "arch_for_config", "arch_metadata"]

U32, F32, BOOL, STR = "u32", "f32", "bool", "str"

_DECODER_LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_DECODER_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_BERT_LAYER = {
    "attention.self.query": "attn_q", "attention.self.key": "attn_k", "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output", "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up", "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm",
}
_QWEN3_LAYER = {**_DECODER_LAYER, "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
_MOE_LAYER = {**{k: v for k, v in _QWEN3_LAYER.items() if not k.startswith("mlp.")}, "mlp.gate": "ffn_gate_inp",
              "mlp.experts.gate_proj": "ffn_gate_exps", "mlp.experts.up_proj": "ffn_up_exps",
              "mlp.experts.down_proj": "ffn_down_exps"}
_GEMMA2_LAYER = {**_DECODER_LAYER, "post_attention_layernorm": "post_attention_norm",
                 "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
_PHI3_LAYER = {**{k: v for k, v in _DECODER_LAYER.items() if k not in ("mlp.gate_proj", "mlp.up_proj")},
               "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(\w+)$")
_BERT_TOP = {"embeddings.word_embeddings": "token_embd", "embeddings.position_embeddings": "position_embd",
             "embeddings.token_type_embeddings": "token_types", "embeddings.LayerNorm": "token_embd_norm"}


@dataclass(frozen=True)
class GgufArch:
    """One architecture as llama.cpp's converter writes it (see the module docstring)."""

    name: str
    model_types: tuple[str, ...]
    layer: Mapping[str, str]
    top: Mapping[str, str]
    layer_prefix: str = "model.layers."
    permute_qk: bool = False
    llama_keys: bool = False
    bert: bool = False
    dropped: tuple[str, ...] = ("rotary_emb.inv_freq",)  # HF tensors the converter leaves out (suffixes)
    keys: str = "text"           # which key set: the converter's TextModel ("text"), or its own ("gemma2", "phi3")
    norm_shift: float = 0.0      # added to every *norm.weight (Gemma stores norm - 1)
    experts: bool = False        # per-expert tensors stacked into one (MoE)
    space_prefix: bool | None = None  # add_space_prefix written whatever the tokenizer says (Gemma: False)

    def gguf_name(self, hf_name: str) -> str | None:
        """llama.cpp's name of the HF tensor ``hf_name``, or None when it has none (every expert of a layer has the
        name of their stacked tensor).

        >>> ARCHITECTURES["qwen3"].gguf_name("model.layers.1.self_attn.q_norm.weight")
        'blk.1.attn_q_norm.weight'
        >>> ARCHITECTURES["qwen3moe"].gguf_name("model.layers.1.mlp.experts.7.up_proj.weight")
        'blk.1.ffn_up_exps.weight'
        """
        if self.experts and (m := _EXPERT.fullmatch(hf_name.removesuffix(".weight"))):
            hf_name = f"{m.group(1)}.{m.group(3)}.weight"
        stem, _, suffix = hf_name.rpartition(".")
        if stem.startswith(self.layer_prefix):
            index, _, inner = stem[len(self.layer_prefix):].partition(".")
            if index.isdigit() and inner in self.layer:
                return f"blk.{index}.{self.layer[inner]}.{suffix}"
            return None
        return f"{self.top[stem]}.{suffix}" if stem in self.top else None

    def expert_index(self, hf_name: str) -> int | None:
        """The expert number of a per-expert HF tensor (``...mlp.experts.3.up_proj.weight`` → 3), else None."""
        m = _EXPERT.fullmatch(hf_name.removesuffix(".weight")) if self.experts else None
        return int(m.group(2)) if m else None

    def hf_name(self, gguf_name: str) -> str | None:
        """The HF name of llama.cpp's tensor ``gguf_name`` (the inverse of :meth:`gguf_name`)."""
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(\w+)", gguf_name)
        if m:
            inner = next((hf for hf, g in self.layer.items() if g == m.group(2)), None)
            return None if inner is None else f"{self.layer_prefix}{m.group(1)}.{inner}.{m.group(3)}"
        stem, _, suffix = gguf_name.rpartition(".")
        hf = next((h for h, g in self.top.items() if g == stem), None)
        return None if hf is None else f"{hf}.{suffix}"

    def keeps_f32(self, gguf_name: str) -> bool:
        """Whether llama.cpp's converter writes ``gguf_name`` F32 whatever ``--outtype`` (norms, biases, position and
        token-type tables; 1-D tensors are F32 anyway).

        >>> ARCHITECTURES["bert"].keeps_f32("position_embd.weight"), ARCHITECTURES["llama"].keeps_f32("output.weight")
        (True, False)
        """
        return (gguf_name.endswith("_norm.weight") or not gguf_name.endswith(".weight")
                or gguf_name.startswith(("position_embd.", "token_types.")) or ".ffn_gate_inp." in gguf_name)

    def shift(self, hf_name: str) -> float:
        """What the converter adds to ``hf_name``'s values (Gemma's norms: 1), else 0."""
        return self.norm_shift if hf_name.endswith("norm.weight") else 0.0

    def drops(self, hf_name: str) -> bool:
        """Whether llama.cpp's converter leaves ``hf_name`` out (recomputed buffers, BERT's pooler and heads)."""
        return hf_name.endswith(self.dropped) or (self.bert and hf_name.startswith(("pooler.", "cls.")))


ARCHITECTURES: dict[str, GgufArch] = {a.name: a for a in (
    GgufArch("llama", ("llama", "mistral"), _DECODER_LAYER, _DECODER_TOP, permute_qk=True, llama_keys=True),
    GgufArch("qwen2", ("qwen2",), _DECODER_LAYER, _DECODER_TOP),
    GgufArch("qwen3", ("qwen3",), _QWEN3_LAYER, _DECODER_TOP),
    GgufArch("qwen3moe", ("qwen3_moe",), _MOE_LAYER, _DECODER_TOP, experts=True),
    GgufArch("gemma2", ("gemma2",), _GEMMA2_LAYER, _DECODER_TOP, keys="gemma2", norm_shift=1.0, space_prefix=False,
             dropped=("rotary_emb.inv_freq", "lm_head.weight")),
    GgufArch("phi3", ("phi3",), _PHI3_LAYER, _DECODER_TOP, keys="phi3"),
    GgufArch("gemma3", ("gemma3_text",), {**_GEMMA2_LAYER, "self_attn.q_norm": "attn_q_norm",
                                          "self_attn.k_norm": "attn_k_norm"}, _DECODER_TOP, keys="gemma3",
             norm_shift=1.0, space_prefix=False, dropped=("rotary_emb.inv_freq", "lm_head.weight")),
    GgufArch("bert", ("bert",), _BERT_LAYER, _BERT_TOP, layer_prefix="encoder.layer.", bert=True,
             dropped=("embeddings.position_ids",)),
)}


def arch_for_config(config: Config, *, where: str) -> GgufArch:
    """The entry for a transformers ``config.json``.

    Raises:
        InvalidInputError: a ``model_type`` no entry takes; the message names those supported.
    """
    model_type = config.get("model_type")
    for arch in ARCHITECTURES.values():
        if model_type in arch.model_types:
            return arch
    known = ", ".join(t for a in ARCHITECTURES.values() for t in a.model_types)
    raise InvalidInputError(f"{where}: to='gguf' writes language models of model_type {known} (and Flux "
                            f"transformers); this config says {model_type!r}")


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
