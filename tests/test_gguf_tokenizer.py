"""A GGUF converted to a Hugging Face folder keeps its tokenizer: ``AutoTokenizer`` loads the folder and encodes as
the tokenizer the GGUF was made from (and as transformers' own GGUF tokenizer); the model loads with its logits.

Each case: a tiny random model with a real tokenizer (byte-level BPE Llama 3 style and Qwen style, a trained
SentencePiece, all-MiniLM-L6-v2's WordPiece) → ``convert --to gguf`` → ``convert model.gguf out/ --dtype ...``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers_llama_cpp import fixture_pre, tiny_model_folder

import shardkit
from shardkit.layouts import gguf_pre
from shardkit.layouts.gguf_tokenizer import spm_merges, tokenizer_files
from shardkit.layouts.gguf_vocab import probe_hash

transformers = pytest.importorskip("transformers")

TEXT = "Hello world, the quick brown fox jumps over the lazy dog 123 4567 I've <tool> Ünïcödé 🚀 我想在apple工作"
RICH = TEXT + "  two  spaces\n\nnew lines\t<|im_end|>[SEP]<ctl>"  # whitespace runs and special tokens in the text


def _gguf(tmp_path: Path, arch: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    folder = tiny_model_folder(tmp_path / arch, arch)
    if arch not in ("bert", "llama-spm"):  # a tiny BPE hashes to no real model: name its split
        monkeypatch.setitem(gguf_pre.PRE_TOKENIZERS, probe_hash(str(folder / "tokenizer.json")), fixture_pre(arch))
    shardkit.convert(folder, tmp_path / "m.gguf", to="gguf", quantize="f32")
    return folder, tmp_path / "m.gguf"


def _original_ids(folder: Path, arch: str, text: str) -> list[int]:
    if arch == "llama-spm":  # SentencePiece's own ids, BOS first (transformers needs protobuf to read the model)
        import sentencepiece

        return [1, *sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model")).encode(text)]
    ids: list[int] = transformers.AutoTokenizer.from_pretrained(folder).encode(text)
    return ids


@pytest.mark.parametrize("arch", ["llama", "qwen3", "llama-spm", "bert", pytest.param("qwen2", marks=pytest.mark.slow)])
def test_a_gguf_folder_tokenizes_as_the_original(arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, gguf_file = _gguf(tmp_path, arch, monkeypatch)
    out = tmp_path / "back"
    shardkit.convert(gguf_file, out, dtype="bf16")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    ours = transformers.AutoTokenizer.from_pretrained(out)
    # SentencePiece itself folds whitespace runs and does not parse control tokens in text (llama.cpp does neither)
    assert ours.encode(TEXT) == _original_ids(folder, arch, TEXT)
    if arch == "bert":
        assert ours("a", "b")["token_type_ids"] == transformers.AutoTokenizer.from_pretrained(folder)("a", "b")["token_type_ids"]
        assert ours.encode(RICH) == _original_ids(folder, arch, RICH)
    else:  # transformers' own tokenizer of the GGUF file (it has none for BERT)
        theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf_file.name)
        assert ours.encode(RICH) == theirs.encode(RICH)
        if arch != "llama-spm":
            assert ours.encode(RICH) == _original_ids(folder, arch, RICH)
        assert ours.decode(ours.encode(TEXT), skip_special_tokens=True) == theirs.decode(theirs.encode(TEXT),
                                                                                         skip_special_tokens=True)
    config = json.loads((out / "tokenizer_config.json").read_text())
    original = json.loads((folder / "tokenizer_config.json").read_text())
    for key in ("chat_template", "eos_token", "bos_token", "cls_token", "sep_token", "mask_token"):
        if original.get(key) is not None:
            assert config[key] == original[key], key


@pytest.mark.parametrize("arch", ["llama", "qwen3", "llama-spm", "bert"])
def test_the_folder_loads_with_the_same_outputs(arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32: bit-equal logits (hidden states for BERT); bf16: within bf16's rounding of the weights."""
    folder, gguf_file = _gguf(tmp_path, arch, monkeypatch)
    auto = transformers.AutoModel if arch == "bert" else transformers.AutoModelForCausalLM
    original = auto.from_pretrained(folder, dtype=torch.float32)
    for dtype, tolerance in (("fp32", 0.0), ("bf16", 2e-2)):
        out = tmp_path / dtype
        shardkit.convert(gguf_file, out, dtype=dtype)
        ids = transformers.AutoTokenizer.from_pretrained(out)(TEXT, return_tensors="pt")
        model = auto.from_pretrained(out, dtype=torch.float32)
        with torch.no_grad():
            got, want = model(**ids), original(**ids)
        got_t, want_t = (got.last_hidden_state, want.last_hidden_state) if arch == "bert" else (got.logits, want.logits)
        assert (got_t - want_t).abs().max().item() <= tolerance, dtype
        if arch != "bert" and dtype == "fp32":
            generation = json.loads((out / "generation_config.json").read_text())
            assert generation["eos_token_id"] == original.config.eos_token_id
            same = model.generate(**ids, max_new_tokens=6, do_sample=False)
            assert torch.equal(same, original.generate(**ids, max_new_tokens=6, do_sample=False))


def test_a_gguf_without_a_vocabulary_writes_no_tokenizer(tmp_path: Path) -> None:
    assert tokenizer_files({"tokenizer.ggml.model": "no_vocab"}, where="x.gguf") == {}
    assert tokenizer_files({}, where="x.gguf") == {}


def test_an_unknown_vocabulary_type_is_refused_naming_those_supported() -> None:
    with pytest.raises(shardkit.InvalidInputError, match="gpt2 .* llama .* bert"):
        tokenizer_files({"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a"]}, where="x.gguf")


def test_spm_merges_follow_transformers_generate_merges() -> None:
    from transformers.tokenization_utils_base import generate_merges

    tokens = ["<unk>", "a", "b", "c", "ab", "bc", "abc", "ca", "▁", "▁a", "▁ab"]
    scores = [0.0, -1.0, -1.0, -1.0, -2.0, -2.0, -3.0, -2.5, -1.5, -4.0, -3.0]
    expected = generate_merges({t: i for i, t in enumerate(tokens)}, dict(zip(tokens, scores, strict=True)))
    assert [tuple(m) for m in spm_merges(tokens, scores)] == expected


@pytest.mark.parametrize("arch", ["llama", "qwen3", "bert", "llama-spm"])
def test_the_folder_round_trips_through_llama_cpps_converter(arch: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """GGUF → folder → ``convert_hf_to_gguf.py``: every tensor and key of the GGUF again (BERT's pooling included,
    from the sentence-transformers files written beside it; SentencePiece from the tokenizer.model rebuilt)."""
    from helpers_llama_cpp import gguf_fields, gguf_tensors, run_converter

    _, gguf_file = _gguf(tmp_path, arch, monkeypatch)
    shardkit.convert(gguf_file, tmp_path / "back", dtype="fp32")
    again = run_converter(tmp_path / "back", tmp_path / "again.gguf", outtype="f32",
                          pre_fallback=None if arch in ("bert", "llama-spm") else fixture_pre(arch))
    assert gguf_tensors(again) == gguf_tensors(gguf_file)
    assert gguf_fields(again) == gguf_fields(gguf_file)
