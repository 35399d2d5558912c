"""llama.cpp's runtime as the judge: it loads, tokenizes and runs shardkit's GGUF exactly as the converter's own.

node-llama-cpp (npm) ships llama.cpp prebuilt for Linux x64 CPU; one thread. For a language model: the same
prompt tokens (and the same as transformers' tokenizer gives) and the same greedy tokens from shardkit's file
and from ``convert_hf_to_gguf.py``'s. For an embedding model: llama.cpp's embedding of shardkit's file against
sentence-transformers' (cosine ≥ 0.999).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers_llama_cpp import fixture_pre, run_converter, run_llama_cpp, tiny_model_folder

import shardkit
from shardkit.layouts import gguf_pre
from shardkit.layouts.gguf_vocab import probe_hash

TEXT = "Hello world, the quick brown fox jumps over the lazy dog 123"


@pytest.mark.parametrize("arch", ["llama", "qwen3", "llama-spm", "gemma2", "gemma3", "qwen3moe", "phi3", "qwen2moe",
                                  "mixtral", pytest.param("mistral", marks=pytest.mark.slow),
                                  pytest.param("qwen2", marks=pytest.mark.slow)])
def test_llama_cpp_runs_our_file_as_it_runs_the_converters(arch: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    folder = tiny_model_folder(tmp_path / arch, arch)
    spm = arch in ("llama-spm", "gemma2", "gemma3", "phi3")
    if not spm:
        monkeypatch.setitem(gguf_pre.PRE_TOKENIZERS, probe_hash(str(folder / "tokenizer.json")), fixture_pre(arch))
    reference = run_converter(folder, tmp_path / "ref.gguf", outtype="q8_0", pre_fallback=None if spm else fixture_pre(arch))
    ours = tmp_path / "ours.gguf"
    shardkit.convert(folder, ours, to="gguf", quantize="q8_0")
    theirs, got = run_llama_cpp(reference, "generate", TEXT + " <tool>"), run_llama_cpp(ours, "generate", TEXT + " <tool>")
    assert got == theirs
    if arch == "llama-spm":  # SentencePiece's own ids, BOS first (Gemma 2 is written without the space prefix)
        import sentencepiece

        processor = sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
        assert got["prompt"] == [1, *processor.encode(TEXT + " <tool>")]
    elif not spm:
        assert got["prompt"] == transformers.AutoTokenizer.from_pretrained(folder).encode(TEXT + " <tool>")
    assert len(got["generated"]) == 8


def test_llama_cpp_embeds_a_bert_as_sentence_transformers_does(tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    folder = tiny_model_folder(tmp_path / "bert", "bert")
    expected = SentenceTransformer(str(folder), device="cpu").encode([TEXT])[0]
    reference = run_converter(folder, tmp_path / "ref.gguf", outtype="f16")
    for quantize in ("f16", "q8_0"):
        out = tmp_path / f"{quantize}.gguf"
        shardkit.convert(folder, out, to="gguf", quantize=quantize)
        got = run_llama_cpp(out, "embed", TEXT)
        vector = np.array(got["embedding"])
        cosine = float(vector @ expected / np.linalg.norm(vector) / np.linalg.norm(expected))
        assert cosine >= 0.999, (quantize, cosine)
        if quantize == "f16":
            assert got == run_llama_cpp(reference, "embed", TEXT)
