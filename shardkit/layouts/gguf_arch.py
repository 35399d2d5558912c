"""The language-model architectures ``convert --to gguf`` writes, one layout entry each, as llama.cpp's converter does.

An entry says which ``config.json`` ``model_type`` values it takes, the ``general.architecture`` written,
how Hugging Face tensor names become llama.cpp's (``model.layers.N.<hf>`` → ``blk.N.<gguf>``, plus the
top-level ones), whether the q/k rows are permuted (Llama only), and which per-architecture keys come
from the config (written by :mod:`shardkit.layouts.gguf_keys`: the converter's
``TextModel.set_gguf_parameters``, plus ``vocab_size`` and ``rope.dimension_count`` for its ``LlamaModel``;
``causal_attention``, ``pooling_type`` and the BERT sizes for BERT; an architecture's own set for Gemma and Phi-3).

==========  ================================  =============================================================
written     ``model_type``                    what differs from Llama
==========  ================================  =============================================================
llama       llama, mistral                    (Mistral is written as llama, as llama.cpp's converter does)
llama       mixtral                           llama's, with each layer's experts (``block_sparse_moe.experts.N.w1/w2/w3``)
                                              stacked as qwen3moe's (``ffn_gate_exps``, ``ffn_down_exps``, ``ffn_up_exps``),
                                              the router ``block_sparse_moe.gate`` as ``ffn_gate_inp`` F32 (the
                                              converter's LlamaModel: MixtralForCausalLM shares llama's entry there)
qwen2       qwen2                             q/k/v biases, no q/k permutation, no vocab_size/rope keys
qwen3       qwen3                             q/k norms (``attn_q_norm``, ``attn_k_norm``), no biases
bert        bert                              embeddings, position and token-type tables, LayerNorm biases,
                                              no lm_head; pooling type from sentence-transformers' files
qwen3moe    qwen3_moe                         qwen3's, with each layer's experts stacked into one 3-D tensor
                                              (``ffn_gate_exps``, ``ffn_up_exps``, ``ffn_down_exps``, expert
                                              index first), the router ``ffn_gate_inp`` F32, expert keys
qwen2moe    qwen2_moe                         qwen2's with qwen3moe's experts, plus the shared expert
                                              (``ffn_*_shexp``, its gate ``ffn_gate_inp_shexp`` F32)
gemma2      gemma2                            every ``*norm.weight`` + 1 (float32, or float16 for an F16
                                              source, as the converter adds it), four norms a layer, no
                                              ``lm_head``, softcapping and sliding-window keys, no rope keys,
                                              ``add_space_prefix`` false
gemma3      gemma3_text                       gemma2's, with q/k norms (shifted too), the sliding layers' rope
                                              base, defaults for what its config leaves out
phi3        phi3                              fused ``qkv_proj`` (``attn_qkv``) and ``gate_up_proj``
                                              (``ffn_up``) kept fused; its own keys (rope dimension count
                                              from the partial rotary factor, original context length)
gpt-oss     gpt_oss                           q/k/v/o biases, attention sinks (``attn_sinks``), the router
                                              ``mlp.router`` as ``ffn_gate_inp`` F32, experts already stacked:
                                              MXFP4 ``X_blocks``/``X_scales`` pairs kept as ggml MXFP4 (the
                                              nibbles reordered, the values unchanged), dense ones (E, in, out)
                                              transposed; ``gate_up_proj`` (and its bias) split into gate (even
                                              output rows) and up (odd); sliding-window and yarn keys
nomic-bert  nomic_bert                        BERT's keys and vocabulary; remote-code names (``encoder.layers.N``,
                                              fused ``attn.Wqkv`` as ``attn_qkv``, ``mlp.fc11``/``fc12`` as
                                              ``ffn_up``/``ffn_gate``, ``emb_ln``), no position table (rope)
==========  ================================  =============================================================

A Hugging Face tensor becomes one or more :class:`Piece` s (:meth:`GgufArch.pieces`): usually one GGUF tensor; a share
of one (the output rows ``first::step`` of an interleaved fused tensor); or half of an MXFP4 pair.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import InvalidInputError, Option
from ..formats.json_types import Config

__all__ = ["ARCHITECTURES", "GgufArch", "Piece", "arch_for_config"]

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
_QWEN2_MOE_LAYER = {**{k: v for k, v in _MOE_LAYER.items() if "_norm" not in k},
                    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
                    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
_GEMMA2_LAYER = {**_DECODER_LAYER, "post_attention_layernorm": "post_attention_norm",
                 "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
_PHI3_LAYER = {**{k: v for k, v in _DECODER_LAYER.items() if k not in ("mlp.gate_proj", "mlp.up_proj")},
               "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
_MIXTRAL_LAYER = {**{k: v for k, v in _DECODER_LAYER.items() if not k.startswith("mlp.")},
                  "block_sparse_moe.gate": "ffn_gate_inp", "block_sparse_moe.experts.w1": "ffn_gate_exps",
                  "block_sparse_moe.experts.w2": "ffn_down_exps", "block_sparse_moe.experts.w3": "ffn_up_exps"}
_GPT_OSS_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.sinks": "attn_sinks", "mlp.router": "ffn_gate_inp", "mlp.experts.down_proj": "ffn_down_exps",
}
_NOMIC_LAYER = {"attn.Wqkv": "attn_qkv", "attn.out_proj": "attn_output", "mlp.fc11": "ffn_up", "mlp.fc12": "ffn_gate",
                "mlp.fc2": "ffn_down", "norm1": "attn_output_norm", "norm2": "layer_output_norm"}
_NOMIC_TOP = {"embeddings.word_embeddings": "token_embd", "embeddings.token_type_embeddings": "token_types",
              "emb_ln": "token_embd_norm"}
_GPT_OSS_SPLIT = {"mlp.experts.gate_up_proj": ("ffn_gate_exps", "ffn_up_exps")}  # even output rows, odd ones
_EXPERT = re.compile(r"(.*\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)$")
_BERT_TOP = {"embeddings.word_embeddings": "token_embd", "embeddings.position_embeddings": "position_embd",
             "embeddings.token_type_embeddings": "token_types", "embeddings.LayerNorm": "token_embd_norm"}


@dataclass(frozen=True)
class Piece:
    """What a Hugging Face tensor is in the GGUF file (see :meth:`GgufArch.pieces`).

    Attributes:
        name: the GGUF tensor's name.
        first, step: the output features it takes, ``first::step`` (gpt-oss's ``gate_up_proj`` interleaves gate and
            up: even ones gate, odd ones up); of a bias, its last dimension.
        mxfp4: ``"blocks"`` or ``"scales"``: one half of an MXFP4 pair written as one ggml MXFP4 tensor; "" a float
            tensor.
        transpose: experts stored (E, in, out) (gpt-oss's dense ones), written (E, out, in).
    """

    name: str
    first: int = 0
    step: int = 1
    mxfp4: str = ""
    transpose: bool = False


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
    key: str = ""                # its key in ARCHITECTURES when ``name`` is another entry's (Mixtral is written as llama)
    split: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # fused HF tensor → the GGUF tensors its rows interleave
    bare_names: bool = False     # gpt-oss: ``X_bias`` is X.bias, ``X_blocks``/``X_scales`` an MXFP4 pair, ``X`` X.weight
    experts_in_out: bool = False  # dense ``mlp.experts.*`` weights stored (E, in, out): written transposed

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

    def pieces(self, hf_name: str) -> tuple[Piece, ...]:
        """What ``hf_name`` becomes in the GGUF file: nothing (no llama.cpp name), one tensor, or its interleaved
        output rows as several (a fused tensor of :attr:`split`).

        >>> [p.name for p in ARCHITECTURES["gpt-oss"].pieces("model.layers.0.mlp.experts.gate_up_proj_bias")]
        ['blk.0.ffn_gate_exps.bias', 'blk.0.ffn_up_exps.bias']
        >>> ARCHITECTURES["gpt-oss"].pieces("model.layers.0.mlp.experts.down_proj_scales")
        (Piece(name='blk.0.ffn_down_exps.weight', first=0, step=1, mxfp4='scales', transpose=False),)
        """
        name, mxfp4 = _canonical(hf_name) if self.bare_names else (hf_name, "")
        stem, _, suffix = name.rpartition(".")
        inner = stem[len(self.layer_prefix):].partition(".")[2] if stem.startswith(self.layer_prefix) else ""
        transpose = (self.experts_in_out and not mxfp4 and suffix == "weight" and inner.startswith("mlp.experts."))
        if inner in self.split:
            index = stem[len(self.layer_prefix):].partition(".")[0]
            names = self.split[inner]
            return tuple(Piece(f"blk.{index}.{g}.{suffix}", i, len(names), mxfp4, transpose) for i, g in enumerate(names))
        gguf = self.gguf_name(name)
        return () if gguf is None else (Piece(gguf, mxfp4=mxfp4, transpose=transpose),)

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
                or gguf_name.startswith(("position_embd.", "token_types.")) or ".ffn_gate_inp." in gguf_name or ".ffn_gate_inp_shexp." in gguf_name)

    def shift(self, hf_name: str) -> float:
        """What the converter adds to ``hf_name``'s values (Gemma's norms: 1), else 0."""
        return self.norm_shift if hf_name.endswith("norm.weight") else 0.0

    def drops(self, hf_name: str) -> bool:
        """Whether llama.cpp's converter leaves ``hf_name`` out (recomputed buffers, BERT's pooler and heads)."""
        return hf_name.endswith(self.dropped) or (self.bert and hf_name.startswith(("pooler.", "cls.")))


def _canonical(hf_name: str) -> tuple[str, str]:
    """gpt-oss's names as the converter reads them: ``X_bias`` → ``X.bias``, ``X_blocks``/``X_scales`` → ``X.weight``
    (and which half of the MXFP4 pair), a name without ``.weight``/``.bias`` (``sinks``, dense experts) → ``X.weight``."""
    for end, half in (("_blocks", "blocks"), ("_scales", "scales")):
        if hf_name.endswith(end):
            return hf_name[: -len(end)] + ".weight", half
    if hf_name.endswith("_bias"):
        return hf_name[: -len("_bias")] + ".bias", ""
    return (hf_name if hf_name.endswith((".weight", ".bias")) else hf_name + ".weight"), ""


ARCHITECTURES: dict[str, GgufArch] = {a.key or a.name: a for a in (
    GgufArch("llama", ("llama", "mistral"), _DECODER_LAYER, _DECODER_TOP, permute_qk=True, llama_keys=True),
    GgufArch("qwen2", ("qwen2",), _DECODER_LAYER, _DECODER_TOP),
    GgufArch("qwen3", ("qwen3",), _QWEN3_LAYER, _DECODER_TOP),
    GgufArch("qwen3moe", ("qwen3_moe",), _MOE_LAYER, _DECODER_TOP, experts=True),
    GgufArch("qwen2moe", ("qwen2_moe",), _QWEN2_MOE_LAYER, _DECODER_TOP, experts=True),
    GgufArch("gemma2", ("gemma2",), _GEMMA2_LAYER, _DECODER_TOP, keys="gemma2", norm_shift=1.0, space_prefix=False,
             dropped=("rotary_emb.inv_freq", "lm_head.weight")),
    GgufArch("phi3", ("phi3",), _PHI3_LAYER, _DECODER_TOP, keys="phi3"),
    GgufArch("gemma3", ("gemma3_text",), {**_GEMMA2_LAYER, "self_attn.q_norm": "attn_q_norm",
                                          "self_attn.k_norm": "attn_k_norm"}, _DECODER_TOP, keys="gemma3",
             norm_shift=1.0, space_prefix=False, dropped=("rotary_emb.inv_freq", "lm_head.weight")),
    GgufArch("bert", ("bert",), _BERT_LAYER, _BERT_TOP, layer_prefix="encoder.layer.", bert=True,
             dropped=("embeddings.position_ids",)),
    GgufArch("llama", ("mixtral",), _MIXTRAL_LAYER, _DECODER_TOP, permute_qk=True, llama_keys=True, experts=True,
             key="mixtral"),
    GgufArch("nomic-bert", ("nomic_bert",), _NOMIC_LAYER, _NOMIC_TOP, layer_prefix="encoder.layers.", bert=True,
             keys="nomic", dropped=("embeddings.position_ids",)),
    GgufArch("gpt-oss", ("gpt_oss",), _GPT_OSS_LAYER, _DECODER_TOP, keys="gpt_oss", split=_GPT_OSS_SPLIT,
             bare_names=True, experts_in_out=True),
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
    raise InvalidInputError(f"{where}: ", Option("to", "gguf"),
                            f" writes language models of model_type {known} (and Flux "
                            f"transformers); this config says {model_type!r}")
