"""GGUF fixtures written by llama.cpp's own gguf-py (``gguf.GGUFWriter``, ``gguf.quants``), and the judges.

The Llama writer does what llama.cpp's ``convert_hf_to_gguf.py`` does: its tensor names, the q/k row
permutation (``reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2)``, kv heads for k), the
``llama.*`` metadata, and ``gguf.quants.quantize`` of the float32 values for 2-D tensors (1-D stay F32).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

LLAMA_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}
LLAMA_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def tiny_llama_config(**overrides: Any) -> Any:
    import transformers

    fields = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
              "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
    return transformers.LlamaConfig(**{**fields, **overrides})


def tiny_llama_folder(folder: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> Path:
    """A random transformers LlamaForCausalLM saved with ``save_pretrained`` (safetensors + config.json)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(tiny_llama_config(**overrides)).to(dtype)
    model.save_pretrained(folder)
    return folder


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """As transformers' GGUF loader reverses it (``reverse_permute_weights``)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def llama_gguf_name(hf: str) -> str:
    if hf in LLAMA_NAMES:
        return LLAMA_NAMES[hf]
    parts = hf.split(".")
    return f"blk.{parts[2]}.{LLAMA_LAYER['.'.join(parts[3:-1])]}.{parts[-1]}"


def write_llama_gguf(path: Path, state: dict[str, torch.Tensor], config: Any, qtype: str = "Q8_0",
                     *, tokens: list[str] | None = None, extra: dict[str, np.ndarray] | None = None) -> Path:
    """``state`` (HF names) as llama.cpp's converter writes it, 2-D tensors in ``qtype``."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    if tokens is None:
        writer.add_vocab_size(config.vocab_size)
        writer.add_tokenizer_model("no_vocab")
    else:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores([0.0] * len(tokens))
        writer.add_token_types([1] * len(tokens))
    for name, value in state.items():
        value = value.float()
        if ".q_proj." in name:
            value = llama_cpp_permute(value, config.num_attention_heads)
        elif ".k_proj." in name:
            value = llama_cpp_permute(value, config.num_key_value_heads)
        add_tensor(writer, llama_gguf_name(name), value.numpy(), qtype if value.dim() == 2 else "F32")
    for name, array in (extra or {}).items():
        add_tensor(writer, name, array, "F32")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def add_tensor(writer: Any, name: str, array: np.ndarray, qtype: str) -> None:
    import gguf
    from gguf import GGMLQuantizationType as T

    kind = T[qtype]
    if kind == T.F32:
        writer.add_tensor(name, array.astype(np.float32))
    elif kind == T.F16:
        writer.add_tensor(name, array.astype(np.float16))
    else:
        q = gguf.quants.quantize(array.astype(np.float32), kind)
        writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=kind)


def write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, str]]) -> Path:
    """A GGUF of ``arch`` with ``{name: (float32 values, ggml type)}`` (quantized by gguf)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for name, (array, qtype) in tensors.items():
        add_tensor(writer, name, array, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_raw_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, tuple[int, ...], str]]) -> Path:
    """A GGUF with raw block bytes (``(uint8 bytes, torch shape, ggml type)``), for types gguf cannot quantize."""
    import gguf
    from gguf import GGMLQuantizationType as T

    writer = gguf.GGUFWriter(str(path), arch)
    for name, (raw, shape, qtype) in tensors.items():
        block, size = gguf.GGML_QUANT_SIZES[T[qtype]]
        writer.add_tensor(name, raw.reshape(*shape[:-1], shape[-1] // block * size), raw_shape=raw.reshape(
            *shape[:-1], shape[-1] // block * size).shape, raw_dtype=T[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def random_blocks(qtype: str, n_blocks: int, *, seed: int = 0) -> np.ndarray:
    """Random ggml blocks of ``qtype`` whose f16 scale fields are finite (random bytes elsewhere)."""
    import gguf
    from gguf import GGMLQuantizationType as T

    rng = np.random.default_rng(seed)
    _, size = gguf.GGML_QUANT_SIZES[T[qtype]]
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    scale_fields = {"Q8_0": [0], "Q4_0": [0], "Q5_0": [0], "Q4_1": [0, 2], "Q5_1": [0, 2], "Q4_K": [0, 2],
                    "Q5_K": [0, 2], "Q6_K": [208], "Q2_K": [80, 82], "Q3_K": [108]}
    for at in scale_fields.get(qtype, []):
        raw[:, at:at + 2] = np.frombuffer((rng.standard_normal(n_blocks) * 0.01).astype(np.float16).tobytes(),
                                          np.uint8).reshape(n_blocks, 2)
    return raw


def read_gguf_tensors(path: Path) -> dict[str, tuple[Any, np.ndarray]]:
    """name → (ggml type, raw bytes) as gguf's reader sees them."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {t.name: (t.tensor_type, np.asarray(t.data).view(np.uint8).reshape(-1).copy()) for t in reader.tensors}


def gguf_dequantized(path: Path) -> dict[str, np.ndarray]:
    """name → float32 values (torch shape) by ``gguf.quants.dequantize``."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {t.name: gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(
        tuple(int(d) for d in reversed(t.shape))) for t in reader.tensors}


def gguf_metadata(path: Path) -> dict[str, Any]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        values = [field.parts[i] for i in field.data]
        decoded = [bytes(v).decode() if field.types[-1] == gguf.GGUFValueType.STRING else v.tolist() for v in values]
        flat = [v[0] if isinstance(v, list) and len(v) == 1 else v for v in decoded]
        out[key] = flat[0] if len(flat) == 1 and field.types[0] != gguf.GGUFValueType.ARRAY else flat
    return out


def config_of(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
                "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0}


def tiny_gpt_oss_folder(folder: Path, *, mxfp4: bool = True, legacy_config: bool = False) -> Path:
    """A random transformers GptOssForCausalLM (2 layers: one sliding, one full; 4 experts, top 2; hidden 64, experts'
    width 96, so that a transposition shows) saved in bf16 with a byte-level BPE tokenizer; with ``mxfp4``, its experts
    then quantized by shardkit's ``quantize='mxfp4'`` into gpt-oss's MXFP4 layout (``X_blocks`` / ``X_scales``,
    ``quantization_config: {"quant_method": "mxfp4"}``), as the released checkpoints are. ``legacy_config``: config.json
    as openai/gpt-oss-20b's (``rope_scaling`` and a top-level ``rope_theta``, no ``rope_parameters``)."""
    import shutil

    import transformers
    from helpers_llama_cpp import tiny_bpe_tokenizer

    import shardkit

    plain = folder.with_name(folder.name + "-bf16") if mxfp4 else folder
    size = tiny_bpe_tokenizer(plain)
    config = transformers.GptOssConfig(
        vocab_size=size + 4, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=32,
        max_position_embeddings=256, rope_parameters=dict(GPT_OSS_ROPE), bos_token_id=0, eos_token_id=2,
        layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():  # every tensor away from its init (norms 1, sinks and biases 0), so that a swap shows
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * (0.1 if "norm" in name else 0.05) + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(plain)
    if mxfp4:
        shardkit.convert(plain, folder, quantize="mxfp4")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(plain / name, folder / name)
    if legacy_config:
        fields = json.loads((folder / "config.json").read_text())
        rope = fields.pop("rope_parameters")
        fields["rope_theta"] = rope.pop("rope_theta")
        fields.update(rope_scaling=rope, experts_per_token=2, initial_context_length=64)
        (folder / "config.json").write_text(json.dumps(fields, indent=2))
    return folder


def tiny_nomic_bert_folder(folder: Path, *, native_fields: bool = True) -> Path:
    """A random nomic-bert (nomic-embed-text v1.5's config shrunk to 2 layers of 32; remote code, so its state dict is
    built by hand under the checkpoint's names: ``emb_ln``, ``encoder.layers.N.attn.Wqkv``, ``mlp.fc11/fc12/fc2``...)
    with all-MiniLM-L6-v2's real WordPiece tokenizer and mean-pooling files. ``native_fields`` also writes transformers'
    own ``NomicBertConfig`` fields (``hidden_size``...), which llama.cpp's converter reads first (without them it takes
    that class's defaults, nomic-embed-text v1.5's sizes)."""
    import shutil

    from helpers_llama_cpp import minilm_folder
    from safetensors.torch import save_file

    minilm = minilm_folder()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json", "modules.json",
                 "sentence_bert_config.json", "1_Pooling/config.json"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(minilm / name, folder / name)
    hidden, inner, layers, vocab = 32, 64, 2, 30528
    config: dict[str, Any] = {
        "architectures": ["NomicBertModel"], "model_type": "nomic_bert", "activation_function": "swiglu",
        "auto_map": {"AutoConfig": "nomic-ai/nomic-bert-2048--configuration_hf_nomic_bert.NomicBertConfig",
                     "AutoModel": "nomic-ai/nomic-bert-2048--modeling_hf_nomic_bert.NomicBertModel"},
        "causal": False, "layer_norm_epsilon": 1e-12, "max_trained_positions": 2048, "mlp_fc1_bias": False,
        "mlp_fc2_bias": False, "n_embd": hidden, "n_head": 4, "n_inner": inner, "n_layer": layers, "n_positions": 8192,
        "prenorm": False, "qkv_proj_bias": False, "rotary_emb_base": 1000, "rotary_emb_fraction": 1.0,
        "rotary_emb_interleaved": False, "rotary_emb_scale_base": None, "rotary_scaling_factor": None,
        "type_vocab_size": 2, "use_rms_norm": False, "vocab_size": vocab, "torch_dtype": "float32"}
    if native_fields:
        config.update(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=inner)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    shapes = {"embeddings.word_embeddings.weight": (vocab, hidden), "embeddings.token_type_embeddings.weight": (2, hidden),
              "emb_ln.weight": (hidden,), "emb_ln.bias": (hidden,)}
    for i in range(layers):
        p = f"encoder.layers.{i}."
        shapes.update({p + "attn.Wqkv.weight": (3 * hidden, hidden), p + "attn.out_proj.weight": (hidden, hidden),
                       p + "mlp.fc11.weight": (inner, hidden), p + "mlp.fc12.weight": (inner, hidden),
                       p + "mlp.fc2.weight": (hidden, inner), p + "norm1.weight": (hidden,), p + "norm1.bias": (hidden,),
                       p + "norm2.weight": (hidden,), p + "norm2.bias": (hidden,)})
    generator = torch.Generator().manual_seed(0)
    state = {name: torch.randn(shape, generator=generator) * (0.1 if "norm" in name or "emb_ln" in name else 0.05)
             + (1.0 if name.endswith(("norm1.weight", "norm2.weight", "emb_ln.weight")) else 0.0)
             for name, shape in shapes.items()}
    save_file(state, folder / "model.safetensors")
    return folder
