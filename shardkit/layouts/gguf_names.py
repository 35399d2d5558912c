"""llama.cpp's GGUF tensor names and layouts ↔ Hugging Face ones, and the metadata ↔ config.json.

Llama (``general.architecture = llama``): llama.cpp renames every tensor (``blk.N.attn_q.weight`` for
``model.layers.N.self_attn.q_proj.weight``) and permutes the rows of the q and k projections head by
head (``reshape(n_head, 2, head_dim // 2, cols).swapaxes(1, 2)``, the kv-head count for k) so that its
rotary embedding pairs adjacent values; :func:`unpermute_rows` undoes that and :func:`permute_rows`
redoes it. Rows move whole, so the permutation works on quantized bytes as well as on values.

Qwen2, Qwen3 and BERT files get their Hugging Face names back from :mod:`shardkit.layouts.gguf_arch`
(nothing permuted). Flux (``general.architecture = flux``, ComfyUI-GGUF / city96): the tensors keep their
BFL names (``double_blocks.N.img_attn.qkv.weight``...), unpermuted. Other architectures keep their names.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import InvalidInputError
from ..formats.header import TensorEntry
from ..formats.json_types import Config, JsonObject
from ..units import tensor_nbytes
from .table import Mapped

if TYPE_CHECKING:
    import torch

__all__ = ["CONFIG_ARCHITECTURES", "LLAMA_KEYS", "GgufNames", "NameMap", "config_from_metadata", "name_map", "permute_rows",
           "unpermute_rows"]

_LAYER = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
_TO_GGUF_LAYER = {v: k for k, v in _LAYER.items()}
_TO_GGUF_TOP = {v: k for k, v in _TOP.items()}

# The llama.* keys transformers' GGUF loader reads (GGUF_CONFIG_MAPPING["llama"]) → LlamaConfig fields.
LLAMA_KEYS = {
    "context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size",
    "rope.dimension_count": "head_dim", "rope.freq_base": "rope_theta", "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_FLOAT_KEYS = frozenset({"rope.freq_base", "attention.layer_norm_rms_epsilon"})


@dataclass(frozen=True)
class NameMap:
    """How one architecture's GGUF tensors are named and laid out on the Hugging Face side.

    Attributes:
        architecture: ``general.architecture``.
        to_hf: GGUF name → HF name (names missing here keep their GGUF name).
        heads: HF name → head count whose rows llama.cpp permuted (q: heads, k: kv heads).
    """

    architecture: str
    to_hf: Mapping[str, str]
    heads: Mapping[str, int]


def _hf_name(name: str) -> str | None:
    m = _GGUF_LAYER.fullmatch(name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"
    stem, _, suffix = name.rpartition(".")
    return f"{_TOP[stem]}.{suffix}" if stem in _TOP else None


def gguf_name(hf_name: str) -> str | None:
    """The llama.cpp name of a Llama HF tensor, or None when llama.cpp has none.

    >>> gguf_name("model.layers.3.self_attn.k_proj.weight"), gguf_name("lm_head.weight")
    ('blk.3.attn_k.weight', 'output.weight')
    """
    m = _HF_LAYER.fullmatch(hf_name)
    if m and m.group(2) in _TO_GGUF_LAYER:
        return f"blk.{m.group(1)}.{_TO_GGUF_LAYER[m.group(2)]}.{m.group(3)}"
    stem, _, suffix = hf_name.rpartition(".")
    return f"{_TO_GGUF_TOP[stem]}.{suffix}" if stem in _TO_GGUF_TOP else None


def _int(metadata: Config, key: str, where: str, default: int | None = None) -> int:
    value = metadata.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidInputError(f"{where}: metadata {key} is {value!r}; this GGUF needs a positive integer there")
    return value


def name_map(architecture: str, names: list[str], metadata: Config, *, where: str) -> NameMap:
    """The :class:`NameMap` of a GGUF file's tensors.

    Raises:
        InvalidInputError: a Llama file whose head counts are missing. Tensors without a Hugging Face
            name (``rope_freqs.weight``) keep their own.
    """
    if architecture != "llama":
        from .gguf_arch import ARCHITECTURES

        arch = ARCHITECTURES.get(architecture)
        if arch is not None and (arch.norm_shift or arch.experts or arch.split):  # values or layout not HF's: names kept
            arch = None
        hf_names = {name: arch.hf_name(name) for name in names} if arch is not None else {}
        return NameMap(architecture, {g: hf for g, hf in hf_names.items() if hf is not None}, {})
    heads = _int(metadata, "llama.attention.head_count", where)
    kv_heads = _int(metadata, "llama.attention.head_count_kv", where, heads)
    to_hf, permuted = {}, {}
    for name in names:
        hf = _hf_name(name)
        if hf is None:  # e.g. rope_freqs.weight (Llama 3.1): kept under its own name, --exclude drops it
            continue
        to_hf[name] = hf
        if hf.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            permuted[hf] = heads if ".q_proj." in hf else kv_heads
    return NameMap(architecture, to_hf, permuted)


def unpermute_rows(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order → Hugging Face's, for ``rows`` (whole heads, any dtype, first dim = rows).

    >>> import torch
    >>> unpermute_rows(permute_rows(torch.arange(8), 2), 2).tolist()
    [0, 1, 2, 3, 4, 5, 6, 7]
    """
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def permute_rows(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Hugging Face's q/k row order → llama.cpp's (as its ``convert_hf_to_gguf.py`` ``permute``)."""
    n = rows.shape[0]
    return rows.reshape(heads, 2, n // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


# general.architecture → (transformers class, hidden_act) of the config.json rebuilt from a GGUF's metadata
CONFIG_ARCHITECTURES = {"llama": ("LlamaForCausalLM", "silu"), "qwen2": ("Qwen2ForCausalLM", "silu"),
                        "qwen3": ("Qwen3ForCausalLM", "silu"), "bert": ("BertModel", "gelu")}
_ARCH_KEYS = {"attention.layer_norm_epsilon": "layer_norm_eps", "attention.key_length": "head_dim"}


def config_from_metadata(metadata: Config, *, has_output: bool, where: str) -> JsonObject:
    """The transformers ``config.json`` of a Llama, Qwen2, Qwen3 or BERT GGUF, from its ``{arch}.*`` and tokenizer
    metadata.

    ``tie_word_embeddings`` comes from a missing ``output.weight``; ``vocab_size`` from ``{arch}.vocab_size``
    or the token list; ``head_dim`` (Llama) from ``rope.dimension_count`` when it differs from hidden / heads,
    (Qwen3) from ``attention.key_length``.
    """
    arch = str(metadata.get("general.architecture", "llama"))
    class_name, act = CONFIG_ARCHITECTURES[arch]
    config: JsonObject = {"architectures": [class_name], "model_type": arch, "hidden_act": act}
    if arch != "bert":
        config["tie_word_embeddings"] = not has_output
    for key, field in {**LLAMA_KEYS, **_ARCH_KEYS}.items():
        value = metadata.get(f"{arch}.{key}")
        if value is not None and not (arch == "bert" and key == "attention.head_count_kv"):
            config[field] = _f32_decimal(float(value)) if key in _FLOAT_KEYS or isinstance(value, float) else int(value)
    for key in ("embedding_length", "block_count", "feed_forward_length", "attention.head_count"):
        _int(metadata, f"{arch}.{key}", where)
    if arch != "bert":
        config.setdefault("num_key_value_heads", config["num_attention_heads"])
    if "vocab_size" not in config:
        tokens = metadata.get("tokenizer.ggml.tokens")
        if isinstance(tokens, list):
            config["vocab_size"] = len(tokens)
    if arch != "qwen3" and config.get("head_dim") == config["hidden_size"] // config["num_attention_heads"]:
        config.pop("head_dim")
    if arch == "bert":
        types = metadata.get("tokenizer.ggml.token_type_count")
        config["type_vocab_size"] = int(types) if isinstance(types, int) else 2
        return config
    for key, field in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                       ("padding_token_id", "pad_token_id")):
        value = metadata.get(f"tokenizer.ggml.{key}")
        if isinstance(value, int):
            config[field] = value
    return config


def _f32_decimal(value: float) -> float:
    """The shortest decimal that is the same float32 (GGUF stores ``1e-5`` as 9.99999974737875e-06).

    >>> _f32_decimal(9.99999974737875e-06)
    1e-05
    """
    import struct

    stored = struct.pack("<f", value)
    for digits in range(1, 10):
        short = float(f"{value:.{digits}g}")
        if struct.pack("<f", short) == stored:
            return short
    return value


@dataclass(frozen=True)
class GgufNames:
    """llama.cpp's names of a Llama as a layout of the registry (:class:`~shardkit.layouts.table.LayoutStrategy`):
    forward is :func:`gguf_name` (names llama.cpp lacks are kept), inverse is :func:`name_map` of the file."""

    heads: int = 4
    kv_heads: int = 2

    def sample(self) -> Mapped:
        """A two-layer Llama (grouped-query attention: k and v of ``kv_heads``), tied nothing."""
        hidden, kv, ffn, vocab = 16, 16 * self.kv_heads // self.heads, 32, 64
        shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
        for i in range(2):
            layer = f"model.layers.{i}."
            shapes += [(layer + "input_layernorm.weight", (hidden,)), (layer + "self_attn.q_proj.weight", (hidden, hidden)),
                       (layer + "self_attn.k_proj.weight", (kv, hidden)), (layer + "self_attn.v_proj.weight", (kv, hidden)),
                       (layer + "self_attn.o_proj.weight", (hidden, hidden)),
                       (layer + "post_attention_layernorm.weight", (hidden,)), (layer + "mlp.gate_proj.weight", (ffn, hidden)),
                       (layer + "mlp.up_proj.weight", (ffn, hidden)), (layer + "mlp.down_proj.weight", (hidden, ffn))]
        shapes += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
        return Mapped(tuple(TensorEntry(n, "F32", s, tensor_nbytes("F32", s)) for n, s in shapes))

    def forward(self, plain: Mapped) -> Mapped:
        """The tensors under llama.cpp's names, and the head counts its q/k permutation needs."""
        return Mapped(tuple(TensorEntry(gguf_name(e.name) or e.name, e.dtype, e.shape, e.nbytes) for e in plain.entries),
                      {"general.architecture": "llama", "llama.attention.head_count": self.heads,
                       "llama.attention.head_count_kv": self.kv_heads})

    def inverse(self, stored: Mapped) -> Mapped:
        """The Hugging Face names a GGUF reader gives them (q/k rows are marked for unpermuting, not renamed)."""
        names = name_map(str(stored.config.get("general.architecture")), [e.name for e in stored.entries],
                         stored.config, where="GGUF layout")
        return Mapped(tuple(TensorEntry(names.to_hf.get(e.name, e.name), e.dtype, e.shape, e.nbytes)
                            for e in stored.entries))
