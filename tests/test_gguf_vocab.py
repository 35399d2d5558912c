"""The vocabulary ``convert --to gguf`` writes, judged by llama.cpp's own converter on the same folder.

Every ``tokenizer.*`` key (and every other non-``general.*`` key) is compared, value, type and order, with
what ``convert_hf_to_gguf.py`` (llama-cpp-python's vendored copy) writes, read back by gguf-py's reader.
"""

from __future__ import annotations

import json
from hashlib import sha256
from pathlib import Path

import pytest
from conftest import assert_one_line_error
from helpers_gguf import tiny_llama_folder
from helpers_llama_cpp import gguf_fields, minilm_folder, run_converter, tiny_bpe_tokenizer

import shardkit
from shardkit.layouts import gguf_pre
from shardkit.layouts.gguf_vocab import probe_hash, read_vocab

gguf = pytest.importorskip("gguf")


def _llama_with_bpe(folder: Path, **kwargs: object) -> Path:
    size = tiny_bpe_tokenizer(folder, **kwargs)  # type: ignore[arg-type]
    return tiny_llama_folder(folder, vocab_size=size + 4, bos_token_id=0, eos_token_id=2)  # 4 ids without a token


def _converter_hash(folder: Path) -> str:
    """What llama.cpp's converter hashes: transformers' AutoTokenizer encode() of the probe text."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return sha256(str(tokenizer.encode(gguf_pre.PROBE_TEXT)).encode()).hexdigest()


@pytest.mark.parametrize("template_file", [False, True], ids=["chat-template-in-config", "chat_template.jinja"])
def test_a_byte_level_bpe_vocabulary_equals_the_converters(template_file: bool, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _llama_with_bpe(tmp_path / "hf", template_file=template_file)
    digest = probe_hash(str(folder / "tokenizer.json"))
    assert digest == _converter_hash(folder)
    monkeypatch.setitem(gguf_pre.PRE_TOKENIZERS, digest, "gpt-2")  # a tiny tokenizer is no known model's
    reference = run_converter(folder, tmp_path / "ref.gguf", pre_fallback="gpt-2")
    out = tmp_path / "ours.gguf"
    shardkit.convert(folder, out, to="gguf")
    ours, theirs = gguf_fields(out), gguf_fields(reference)
    assert ours == theirs  # every non-general key: value and type
    assert [k for k in ours if k.startswith("tokenizer.")] == [k for k in theirs if k.startswith("tokenizer.")]
    tokens = theirs["tokenizer.ggml.tokens"][1]
    assert tokens[0] == "<|begin_of_text|>" and tokens[-1] == f"[PAD{len(tokens) - 1}]"
    assert theirs["tokenizer.ggml.add_bos_token"][1] is True and "tokenizer.chat_template" in theirs
    assert len(theirs["tokenizer.ggml.merges"][1]) > 10


def test_a_real_bert_tokenizer_equals_the_converters(tmp_path: Path) -> None:
    """all-MiniLM-L6-v2's WordPiece: the pre-tokenizer comes from llama.cpp's table, unpatched."""
    folder = minilm_folder()
    reference = run_converter(folder, tmp_path / "ref.gguf", outtype="f16")
    vocab = read_vocab(str(folder), json.loads((folder / "config.json").read_text()), bert=True)
    ours = {key: value for key, _, value, _ in vocab.rows}
    theirs = {key: value for key, (_, value) in gguf_fields(reference, "tokenizer.").items()}
    assert list(ours) == list(theirs)
    assert ours == theirs
    assert vocab.pre == "jina-v2-en" and vocab.size == 30522 and vocab.model == "bert"
    assert probe_hash(str(folder / "tokenizer.json")) == _converter_hash(folder)


def test_a_known_pre_tokenizer_needs_no_patch(tmp_path: Path) -> None:
    """The table is llama.cpp's: a hash listed there gives its name."""
    assert len(gguf_pre.PRE_TOKENIZERS) > 90
    assert {"llama-bpe", "qwen2", "gpt-2", "jina-v2-en", "smollm"} <= set(gguf_pre.PRE_TOKENIZERS.values())


def test_refusals_are_one_line_exit_2_naming_what_is_supported(tmp_path: Path, run_cli) -> None:
    folder = _llama_with_bpe(tmp_path / "hf")
    result = run_cli("convert", folder, tmp_path / "x.gguf", "--to", "gguf")  # no patch: unknown pre-tokenizer
    assert_one_line_error(result, contains="pre-tokenizer is not one llama.cpp implements")
    assert result.exit_code == 2 and not (tmp_path / "x.gguf").exists()
    (folder / "tokenizer.model").write_bytes(b"\x0a\x05ab")  # a damaged SentencePiece model
    result = run_cli("convert", folder, tmp_path / "x.gguf", "--to", "gguf")
    assert_one_line_error(result, contains="not a SentencePiece model")
    (folder / "tokenizer.model").unlink()
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer["model"]["type"] = "Unigram"
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    result = run_cli("convert", folder, tmp_path / "x.gguf", "--to", "gguf")
    assert_one_line_error(result, contains="a SentencePiece tokenizer.model (Llama 2, Mistral 7B...), a byte-level BPE")
    assert not (tmp_path / "x.gguf").exists()


def test_without_a_tokenizer_convert_writes_no_vocab_and_says_so(tmp_path: Path, run_cli) -> None:
    folder = tiny_llama_folder(tmp_path / "hf")
    out = tmp_path / "x.gguf"
    result = run_cli("convert", folder, out, "--to", "gguf")
    assert result.exit_code == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if "no vocabulary" in line]
    assert len(notes) == 1 and "llama.cpp cannot tokenize" in notes[0]
    assert gguf_fields(out)["tokenizer.ggml.model"][1] == "no_vocab"


def test_info_shows_the_vocabulary_and_verify_warns_when_there_is_none(tmp_path: Path, run_cli,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _llama_with_bpe(tmp_path / "hf")
    monkeypatch.setitem(gguf_pre.PRE_TOKENIZERS, probe_hash(str(folder / "tokenizer.json")), "gpt-2")
    with_vocab = tmp_path / "v.gguf"
    shardkit.convert(folder, with_vocab, to="gguf", quantize="q8_0")
    result = run_cli("info", with_vocab)
    assert result.exit_code == 0, result.stderr
    assert "vocabulary" in result.stdout and "gpt2, 304 tokens, pre-tokenizer gpt-2, chat template" in result.stdout
    vocab = shardkit.info(with_vocab).quantization["vocabulary"]
    assert vocab == {"model": "gpt2", "size": 304, "pre": "gpt-2", "chat_template": True, "missing": False,
                     "text": "gpt2, 304 tokens, pre-tokenizer gpt-2, chat template"}
    result = run_cli("verify", with_vocab)
    assert result.exit_code == 0 and "warning" not in result.stderr, result.stderr

    bare = tiny_llama_folder(tmp_path / "bare")
    no_vocab = tmp_path / "n.gguf"
    with pytest.warns(shardkit.ShardkitWarning, match="no vocabulary"):
        shardkit.convert(bare, no_vocab, to="gguf")
    assert "none (tokenizer.ggml.model = no_vocab)" in run_cli("info", no_vocab).stdout
    result = run_cli("verify", no_vocab)
    assert result.exit_code == 0 and "ok:" in result.stdout, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "no vocabulary" in warnings[0] and "llama.cpp cannot tokenize" in warnings[0]
    report = shardkit.verify(no_vocab)
    assert report.ok and len(report.warnings) == 1


def test_a_flux_gguf_needs_no_vocabulary(tmp_path: Path, run_cli) -> None:
    from helpers_quant import flux_bfl_state_dict, flux_config
    from safetensors.torch import save_file

    save_file(flux_bfl_state_dict(flux_config()), tmp_path / "flux.safetensors")
    out = tmp_path / "flux.gguf"
    result = run_cli("convert", tmp_path / "flux.safetensors", out, "--to", "gguf")
    assert result.exit_code == 0 and "warning" not in result.stderr, result.stderr
    assert "vocabulary" not in run_cli("info", out).stdout
    result = run_cli("verify", out)
    assert result.exit_code == 0 and "warning" not in result.stderr
