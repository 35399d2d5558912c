"""``convert --to gguf`` for each architecture entry, judged by llama.cpp's own converter on the same folder.

Every tensor (name, ggml type, dims, bytes) and every non-``general.*`` key (value and type) must equal
what ``convert_hf_to_gguf.py --outtype T`` writes for ``--quantize T``. Tiny random models built from their
configs. The BPE decoders (llama, mistral, qwen2, qwen3, qwen3moe, qwen2moe) get a byte-level BPE tokenizer (its pre-tokenizer
hash is no real model's, so both sides are told ``gpt-2``, or ``qwen2`` for Qwen's split); ``llama-spm``, Gemma 2, Gemma 3 and
Phi-3 a trained SentencePiece model (their converters require one); BERT all-MiniLM-L6-v2's real tokenizer and pooling
files.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import assert_one_line_error
from helpers_llama_cpp import fixture_pre, gguf_fields, gguf_tensors, run_converter, tiny_model_folder

import shardkit
from shardkit.layouts import gguf_pre
from shardkit.layouts.gguf_vocab import probe_hash

gguf = pytest.importorskip("gguf")

# Each architecture at q8_0, and every outtype at least once (a bf16 source too); the full matrix is slow.
FAST = [("llama", "q8_0", None), ("mistral", "q8_0", torch.bfloat16), ("qwen2", "q8_0", None), ("qwen3", "q8_0", None),
        ("bert", "q8_0", None), ("llama-spm", "q8_0", None), ("llama", "f16", None), ("qwen2", "bf16", None),
        ("qwen3", "f32", torch.bfloat16), ("bert", "f16", None), ("gemma2", "q8_0", None), ("gemma2", "f16", torch.bfloat16),
        ("qwen3moe", "q8_0", None), ("qwen3moe", "bf16", torch.bfloat16), ("phi3", "q8_0", None),
        ("gemma3", "q8_0", None), ("gemma3", "f16", torch.bfloat16), ("qwen2moe", "q8_0", None),
        ("mixtral", "q8_0", None), ("mixtral", "bf16", torch.bfloat16)]
FULL = [(a, t, None) for a in ("llama", "mistral", "qwen2", "qwen3", "bert", "llama-spm", "gemma2", "qwen3moe", "phi3", "gemma3",
                                        "qwen2moe", "mixtral")
        for t in ("f32", "f16", "bf16", "q8_0")]
CASES = FAST + [pytest.param(*case, marks=pytest.mark.slow) for case in FULL if case not in FAST]


def _converter_hash(folder: Path) -> str:
    from hashlib import sha256

    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return sha256(str(tokenizer.encode(gguf_pre.PROBE_TEXT)).encode()).hexdigest()


def _ids(case: object) -> str:
    return "bf16-source" if case is torch.bfloat16 else "" if case is None else str(case)


@pytest.mark.parametrize(("arch", "outtype", "dtype"), CASES, ids=_ids)
def test_every_tensor_and_key_equals_the_converters(arch: str, outtype: str, dtype: torch.dtype | None,
                                                    tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tiny_model_folder(tmp_path / arch, arch, dtype=dtype)
    fallback = None
    if arch not in ("bert", "llama-spm", "gemma2", "gemma3", "phi3"):  # a tiny BPE hashes to no real model: the same name on both sides
        fallback = fixture_pre(arch)
        digest = probe_hash(str(folder / "tokenizer.json"))
        assert digest == _converter_hash(folder)  # the ids the converter hashes (transformers' AutoTokenizer)
        monkeypatch.setitem(gguf_pre.PRE_TOKENIZERS, digest, fallback)
    reference = run_converter(folder, tmp_path / "ref.gguf", outtype=outtype, pre_fallback=fallback)
    out = tmp_path / "ours.gguf"
    shardkit.convert(folder, out, to="gguf", quantize=outtype)
    ours, theirs = gguf_tensors(out), gguf_tensors(reference)
    assert sorted(ours) == sorted(theirs)
    for name, (kind, dims, data) in theirs.items():
        assert ours[name][:2] == (kind, dims), name
        assert ours[name][2] == data, name
    assert gguf_fields(out) == gguf_fields(reference)
    expected = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "bert": "bert",
                "llama-spm": "llama", "gemma2": "gemma2", "qwen3moe": "qwen3moe", "phi3": "phi3",
                "gemma3": "gemma3", "qwen2moe": "qwen2moe", "mixtral": "llama"}[arch]
    assert shardkit.info(out).quantization["architecture"] == expected


def test_bert_keys_say_how_to_pool(tmp_path: Path) -> None:
    """An embedding model: non-causal attention and sentence-transformers' mean pooling, as llama.cpp reads them."""
    folder = tiny_model_folder(tmp_path / "bert", "bert")
    out = tmp_path / "bert.gguf"
    shardkit.convert(folder, out, to="gguf", quantize="f16")
    fields = gguf_fields(out)
    assert fields["bert.attention.causal"][1] is False and fields["bert.pooling_type"][1] == 1  # mean
    assert fields["tokenizer.ggml.model"][1] == "bert" and fields["tokenizer.ggml.pre"][1] == "jina-v2-en"
    assert gguf_tensors(out)["position_embd.weight"][0] == "F32"


def test_a_qwen3_gguf_reads_back_under_hugging_face_names(tmp_path: Path) -> None:
    folder = tiny_model_folder(tmp_path / "qwen3", "qwen3")
    monkeypatch = pytest.MonkeyPatch()
    with monkeypatch.context() as m:
        m.setitem(gguf_pre.PRE_TOKENIZERS, probe_hash(str(folder / "tokenizer.json")), fixture_pre("qwen3"))
        shardkit.convert(folder, tmp_path / "q.gguf", to="gguf", quantize="f32")
    shardkit.convert(tmp_path / "q.gguf", tmp_path / "back", dtype="fp32")
    from safetensors.torch import load_file

    source, back = load_file(folder / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert source.keys() == back.keys()
    assert all(torch.equal(source[n], back[n]) for n in source)


def test_an_unsupported_architecture_is_one_line_naming_those_supported(tmp_path: Path, run_cli) -> None:
    folder = tiny_model_folder(tmp_path / "m", "llama")
    config = (folder / "config.json").read_text().replace('"model_type": "llama"', '"model_type": "gpt_neox"')
    (folder / "config.json").write_text(config)
    line = assert_one_line_error(run_cli("convert", folder, tmp_path / "x.gguf", "--to", "gguf"),
                                 contains="model_type llama, mistral, qwen2, qwen3, qwen3_moe, qwen2_moe, gemma2, phi3, gemma3_text, bert")
    assert "gpt_neox" in line and not (tmp_path / "x.gguf").exists()


ROPE = {
    "llama3.1": ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 64, "rope_theta": 500000.0}),
    "yarn": ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                       "rope_theta": 1000000.0}),
    "linear": ("llama", {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
}


@pytest.mark.parametrize("case", sorted(ROPE))
def test_rope_scaling_equals_the_converters(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama 3.1's rope_type llama3 becomes the converter's computed rope_freqs.weight; linear and yarn its keys."""
    arch, rope = ROPE[case]
    folder = tiny_model_folder(tmp_path / case, arch, rope_parameters=rope)
    monkeypatch.setitem(gguf_pre.PRE_TOKENIZERS, probe_hash(str(folder / "tokenizer.json")), fixture_pre(arch))
    reference = run_converter(folder, tmp_path / "ref.gguf", outtype="q8_0", pre_fallback=fixture_pre(arch))
    out = tmp_path / "ours.gguf"
    shardkit.convert(folder, out, to="gguf", quantize="q8_0")
    assert gguf_tensors(out) == gguf_tensors(reference)
    assert gguf_fields(out) == gguf_fields(reference)
    if case == "llama3.1":
        assert gguf_tensors(out)["rope_freqs.weight"][0] == "F32"
    else:
        assert gguf_fields(out)[f"{arch}.rope.scaling.type"][1] == rope["rope_type"]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fields_a_config_leaves_out_are_transformers_defaults(arch: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """An older config.json without head_dim, rope_theta or rms_norm_eps: the converter reads transformers' config
    class, which fills them in (Llama: hidden / heads; Qwen3: 128), and writes the keys; so does shardkit."""
    import json

    folder = tiny_model_folder(tmp_path / arch, arch, **({"head_dim": 128} if arch == "qwen3" else {}))
    config = json.loads((folder / "config.json").read_text())
    for key in ("head_dim", "rope_parameters", "rope_theta", "rms_norm_eps"):
        config.pop(key, None)
    (folder / "config.json").write_text(json.dumps(config))
    monkeypatch.setitem(gguf_pre.PRE_TOKENIZERS, probe_hash(str(folder / "tokenizer.json")), fixture_pre(arch))
    reference = run_converter(folder, tmp_path / "ref.gguf", outtype="f16", pre_fallback=fixture_pre(arch))
    shardkit.convert(folder, tmp_path / "ours.gguf", to="gguf", quantize="f16")
    assert gguf_fields(tmp_path / "ours.gguf") == gguf_fields(reference)
    assert f"{arch}.attention.key_length" in gguf_fields(reference)


# nomic-bert (remote code): a state dict built by hand under the checkpoint's names (helpers_gguf), WordPiece tokenizer.
NOMIC_CASES = ["q8_0", "f16", pytest.param("f32", marks=pytest.mark.slow), pytest.param("bf16", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def nomic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from helpers_gguf import tiny_nomic_bert_folder

    return tiny_nomic_bert_folder(tmp_path_factory.mktemp("nomic") / "nomic")


@pytest.mark.parametrize("outtype", NOMIC_CASES)
def test_nomic_bert_equals_the_converters(outtype: str, nomic: Path, tmp_path: Path) -> None:
    reference = run_converter(nomic, tmp_path / "ref.gguf", outtype=outtype)
    out = tmp_path / "ours.gguf"
    shardkit.convert(nomic, out, to="gguf", quantize=outtype)
    assert gguf_tensors(out) == gguf_tensors(reference)
    fields = gguf_fields(out)
    assert fields == gguf_fields(reference)
    assert fields["nomic-bert.attention.causal"][1] is False and fields["nomic-bert.pooling_type"][1] == 1  # mean
    assert fields["nomic-bert.context_length"][1] == 2048 and fields["nomic-bert.rope.freq_base"][1] == 1000.0
    assert "position_embd.weight" not in gguf_tensors(out) and gguf_tensors(out)["blk.0.attn_qkv.weight"][1] == (32, 96)
    if outtype == "q8_0":  # config.json as nomic ships it (remote-code fields only): the same file
        remote = tmp_path / "remote"
        remote.mkdir()
        for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.txt",
                     "special_tokens_map.json", "modules.json", "1_Pooling/config.json"):
            (remote / name).parent.mkdir(parents=True, exist_ok=True)
            (remote / name).write_bytes((nomic / name).read_bytes())
        config = json.loads((nomic / "config.json").read_text())
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
            del config[key]
        (remote / "config.json").write_text(json.dumps(config))
        shardkit.convert(remote, tmp_path / "remote.gguf", to="gguf", quantize="q8_0")
        assert (tmp_path / "remote.gguf").read_bytes() == out.read_bytes()


def test_llama_cpp_embeds_a_nomic_bert_as_transformers_does(nomic: Path, tmp_path: Path) -> None:
    """llama.cpp's embedding of shardkit's file equals its embedding of the converter's, and transformers' own
    NomicBertModel (which reads the remote-code checkpoint) mean-pooled (cosine ≥ 0.999)."""
    import numpy as np
    import transformers
    from helpers_llama_cpp import run_llama_cpp

    text = "Hello world, the quick brown fox jumps over the lazy dog 123"
    reference = run_converter(nomic, tmp_path / "ref.gguf", outtype="f16")
    out = tmp_path / "ours.gguf"
    shardkit.convert(nomic, out, to="gguf", quantize="f16")
    got = run_llama_cpp(out, "embed", text)
    assert got == run_llama_cpp(reference, "embed", text)
    tokenizer = transformers.AutoTokenizer.from_pretrained(nomic)
    model = transformers.AutoModel.from_pretrained(nomic).eval()
    encoded = tokenizer([text], return_tensors="pt")
    with torch.no_grad():
        hidden = model(**encoded).last_hidden_state[0]
    expected = hidden.mean(0).numpy()
    vector = np.array(got["embedding"])
    assert float(expected @ vector / np.linalg.norm(expected) / np.linalg.norm(vector)) >= 0.999


@pytest.mark.parametrize("change", [{"prenorm": True}, {"moe_every_n_layers": 2}, {"n_positions": 4096}])
def test_a_nomic_bert_the_converter_refuses_is_one_line(change: dict[str, object], nomic: Path, tmp_path: Path,
                                                        run_cli) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes((nomic / "model.safetensors").read_bytes())
    (folder / "config.json").write_text(json.dumps({**json.loads((nomic / "config.json").read_text()), **change}))
    line = assert_one_line_error(run_cli("convert", folder, tmp_path / "x.gguf", "--to", "gguf"), contains="nomic-bert")
    assert next(iter(change)) in line and not (tmp_path / "x.gguf").exists()
