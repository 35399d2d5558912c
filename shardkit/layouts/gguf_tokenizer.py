"""A GGUF's ``tokenizer.*`` metadata back as the Hugging Face tokenizer files ``AutoTokenizer`` loads.

The inverse of :mod:`shardkit.layouts.gguf_vocab`, built as transformers' own GGUF tokenizer builder
(``transformers.integrations.gguf``) builds it, but written as plain JSON (no transformers or tokenizers
needed to write it):

==================  ==========================================================================================
``ggml.model``      ``tokenizer.json``
==================  ==========================================================================================
``gpt2``            byte-level BPE: the tokens by id (a token outside the byte alphabet respelled in it), the
                    merges, the split regex of ``tokenizer.ggml.pre`` (Llama 3's, Qwen2's, GPT-4o's; GPT-2's
                    byte-level regex for the others, as transformers does)
``llama``           SentencePiece as BPE: byte fallback, ``Metaspace`` (``▁`` prepended to the first piece unless
                    ``add_space_prefix`` is false), merges rebuilt from the scores (transformers'
                    ``generate_merges``)
``bert``            WordPiece: the converter's "phantom space" undone (``▁x`` → ``x``, ``x`` → ``##x``, control
                    tokens kept), BERT's normalizer (lowercase) and pre-tokenizer
==================  ==========================================================================================

Control tokens become special added tokens, user-defined ones plain added tokens (matched whole, as
llama.cpp does); the post-processor adds BOS/EOS (BERT: ``[CLS]``/``[SEP]``) as the ``add_*_token`` flags
say. ``tokenizer_config.json`` names the special tokens, the flags and the chat template.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from ..errors import InvalidInputError
from ..formats.gguf import Value
from ..formats.json_types import JsonObject

__all__ = ["tokenizer_files"]

CONTROL, UNKNOWN, USER_DEFINED, UNUSED = 3, 2, 4, 5  # llama.cpp's token types
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
           r"\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
          r"\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre → the split regex before the byte-level step (transformers' GGUF_PRE_TOKENIZER_SPLITS)
SPLITS = {**dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                           "dbrx", "smaug-bpe"), _LLAMA3),
          **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2),
          **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), _GPT4O)}
_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                "pad_token": "padding_token_id"}
_BERT_IDS = {"cls_token": "bos_token_id", "sep_token": "seperator_token_id", "unk_token": "unknown_token_id",
             "pad_token": "padding_token_id", "mask_token": "mask_token_id"}


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte → printable character table (``bytes_to_unicode``).

    >>> byte_alphabet()[ord(" ")]
    'Ġ'
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b], extra = chr(256 + extra), extra + 1
    return table


def _filler(token: str, index: int, kind: int) -> bool:
    """Whether ``token`` is a ``[PADn]`` the converter made up for an id the tokenizer lacks (left out of the
    rebuilt vocabulary: the converter makes it up again from config.json's vocab_size)."""
    return kind == UNUSED and token == f"[PAD{index}]"


def _list(metadata: Mapping[str, Value], key: str, *, where: str) -> list[Value]:
    value = metadata.get(key)
    if not isinstance(value, list):
        raise InvalidInputError(f"{where}: metadata {key} is missing or not a list; the tokenizer cannot be rebuilt")
    return value


def _id(metadata: Mapping[str, Value], key: str, size: int) -> int | None:
    value = metadata.get(f"tokenizer.ggml.{key}")
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < size
    return value if ok and isinstance(value, int) else None


def tokenizer_files(metadata: Mapping[str, Value], *, where: str) -> dict[str, bytes]:
    """``tokenizer.json`` and ``tokenizer_config.json`` for a GGUF's metadata; empty when it has no vocabulary.

    Raises:
        InvalidInputError: a vocabulary type with no Hugging Face tokenizer here (``tokenizer.ggml.model`` other than
            gpt2, llama, bert), or token lists that disagree.
    """
    model = metadata.get("tokenizer.ggml.model")
    if model in (None, "no_vocab", "none"):
        return {}
    if model not in ("gpt2", "llama", "bert"):
        raise InvalidInputError(f"{where}: tokenizer.ggml.model is {model!r}; a Hugging Face tokenizer is rebuilt from "
                                "gpt2 (byte-level BPE), llama (SentencePiece) and bert (WordPiece) vocabularies")
    tokens = [str(t) for t in _list(metadata, "tokenizer.ggml.tokens", where=where)]
    raw_types = metadata.get("tokenizer.ggml.token_type")
    types = [int(t) if isinstance(t, int) else 1 for t in raw_types] if isinstance(raw_types, list) else [1] * len(tokens)
    if len(types) != len(tokens):
        raise InvalidInputError(f"{where}: {len(tokens)} tokens but {len(types)} token types")
    if model == "bert":
        tokens = [t if k == CONTROL else t[1:] if t.startswith("\u2581") else "##" + t for t, k in zip(tokens, types,
                                                                                                        strict=True)]
    specials = _special_tokens(metadata, tokens, bert=model == "bert")
    body: JsonObject = {"version": "1.0", "truncation": None, "padding": None,
                        "added_tokens": _added(tokens, types, specials), "normalizer": None, "pre_tokenizer": None,
                        "post_processor": _post_processor(metadata, tokens, model=str(model)), "decoder": None}
    if model == "gpt2":
        body.update(_byte_level(metadata, tokens, types, where=where))
    elif model == "llama":
        body.update(_sentencepiece(metadata, tokens, types, where=where))
    else:
        body.update(_wordpiece(metadata, tokens, specials))
    config: JsonObject = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                          **specials}
    if model == "bert":
        config["model_input_names"] = ["input_ids", "token_type_ids", "attention_mask"]
    for flag in ("add_bos_token", "add_eos_token"):
        value = metadata.get(f"tokenizer.ggml.{flag}")
        if isinstance(value, bool) and model != "bert":
            config[flag] = value
    template = metadata.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    files = {"tokenizer.json": (json.dumps(body, ensure_ascii=False) + "\n").encode()}
    if model == "llama":  # the SentencePiece model too: llama.cpp's converter reads it first, as it read the original
        files["tokenizer.model"] = sentencepiece_model(metadata, tokens, types)
        prefix = metadata.get("tokenizer.ggml.add_space_prefix")
        if isinstance(prefix, bool):
            config["add_prefix_space"] = prefix
        config["added_tokens_decoder"] = {str(i): {"content": t, "special": False} for i, (t, k) in
                                          enumerate(zip(tokens, types, strict=True)) if k == USER_DEFINED}
    files["tokenizer_config.json"] = (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode()
    return files


def _field(number: int, wire: int, payload: bytes) -> bytes:
    key, out = number << 3 | wire, bytearray()
    for value in (key, len(payload)) if wire == 2 else (key,):
        while value > 0x7F:
            out.append(value & 0x7F | 0x80)
            value >>= 7
        out.append(value)
    return bytes(out) + payload


def _varint_field(number: int, value: int) -> bytes:
    out = bytearray()
    value &= 2**64 - 1  # negative int32s as protobuf writes them
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return _field(number, 0, bytes(out))


def sentencepiece_model(metadata: Mapping[str, Value], tokens: list[str], types: list[int]) -> bytes:
    """A SentencePiece ``ModelProto`` (BPE, byte fallback, no normalization but the space prefix the GGUF says) with
    the GGUF's pieces, scores and types; the converter's ``[PADn]`` fillers left out."""
    import struct

    raw = metadata.get("tokenizer.ggml.scores")
    scores = [float(v) if isinstance(v, (int, float)) else 0.0 for v in raw] if isinstance(raw, list) else []
    pieces = b"".join(
        _field(1, 2, _field(1, 2, t.encode()) + _field(2, 5, struct.pack("<f", score)) + _varint_field(3, k))
        for i, (t, k, score) in enumerate(zip(tokens, types, scores, strict=True)) if not _filler(t, i, k))
    ids = {40: "unknown_token_id", 41: "bos_token_id", 42: "eos_token_id", 43: "padding_token_id"}
    trainer = _varint_field(3, 2) + _varint_field(4, sum(not _filler(t, i, k) for i, (t, k) in
                                                         enumerate(zip(tokens, types, strict=True))))
    trainer += _varint_field(35, 1) + b"".join(_varint_field(n, value if isinstance(value, int) else -1)
                                              for n, key in ids.items()
                                              for value in [metadata.get(f"tokenizer.ggml.{key}")])
    prefix = metadata.get("tokenizer.ggml.add_space_prefix", True) is not False
    normalizer = (_field(1, 2, b"identity") + _varint_field(3, int(prefix)) + _varint_field(4, 0)
                  + _varint_field(5, 1))
    return pieces + _field(2, 2, trainer) + _field(3, 2, normalizer)


def _special_tokens(metadata: Mapping[str, Value], tokens: list[str], *, bert: bool) -> JsonObject:
    out: JsonObject = {}
    for name, key in (_BERT_IDS if bert else _SPECIAL_IDS).items():
        token_id = _id(metadata, key, len(tokens))
        if token_id is not None:
            out[name] = tokens[token_id]
    return out


def _added(tokens: list[str], types: list[int], specials: JsonObject) -> list[JsonObject]:
    named = set(specials.values())
    return [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
             "special": k != USER_DEFINED} for i, (t, k) in enumerate(zip(tokens, types, strict=True))
            if k in (CONTROL, USER_DEFINED, UNKNOWN) or t in named]


def _post_processor(metadata: Mapping[str, Value], tokens: list[str], *, model: str) -> JsonObject:
    """A ``TemplateProcessing`` adding what the ``add_*_token`` flags say (BERT: CLS and SEP). Its pair template
    is one gguf-py reads as no ``add_sep_token`` for SentencePiece (whose GGUF has none), ``false`` for BPE."""
    bert = model == "bert"
    size = len(tokens)
    first_id = _id(metadata, "bos_token_id", size) if metadata.get("tokenizer.ggml.add_bos_token") is True else None
    last_key = "seperator_token_id" if bert else "eos_token_id"
    last_id = _id(metadata, last_key, size) if metadata.get("tokenizer.ggml.add_eos_token") is True else None

    def piece(token_id: int | None, type_id: int) -> list[JsonObject]:
        return [] if token_id is None else [{"SpecialToken": {"id": tokens[token_id], "type_id": type_id}}]

    def seq(name: str, type_id: int) -> list[JsonObject]:
        return [{"Sequence": {"id": name, "type_id": type_id}}]

    single = piece(first_id, 0) + seq("A", 0) + piece(last_id, 0)
    pair = single + ([] if bert else piece(first_id, 1)) + seq("B", 1) + piece(last_id, 1)
    if model == "llama":
        pair = piece(first_id, 0) + seq("A", 0) + seq("B", 1) + piece(last_id, 1)
    special = {tokens[i]: {"id": tokens[i], "ids": [i], "tokens": [tokens[i]]} for i in (first_id, last_id)
               if i is not None}
    return {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": special}


def _byte_level(metadata: Mapping[str, Value], tokens: list[str], types: list[int], *, where: str) -> JsonObject:
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        if _filler(token, i, kind):
            continue
        if not set(token) <= alphabet:
            if kind in (CONTROL, USER_DEFINED):
                continue  # an added token only (its text is matched whole)
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, i)
    listed = metadata.get("tokenizer.ggml.merges")
    merges = [str(m).split(" ", 1) for m in listed] if isinstance(listed, list) else []
    if any(len(m) != 2 for m in merges):
        raise InvalidInputError(f"{where}: tokenizer.ggml.merges holds an entry that is not two tokens")
    split = SPLITS.get(str(metadata.get("tokenizer.ggml.pre")))
    byte_level: JsonObject = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                              "use_regex": split is None}
    pre: JsonObject = byte_level if split is None else {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False}, byte_level]}
    return {"pre_tokenizer": pre, "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                                              "use_regex": True},
            "model": _bpe(vocab, merges, unk=None, byte_fallback=False)}


def _bpe(vocab: Mapping[str, int], merges: list[list[str]], *, unk: str | None, byte_fallback: bool) -> JsonObject:
    return {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": byte_fallback, "byte_fallback": byte_fallback,
            "ignore_merges": False, "vocab": dict(vocab), "merges": merges}


def spm_merges(tokens: list[str], scores: list[float]) -> list[list[str]]:
    """The merges a SentencePiece vocabulary implies, best first (transformers' ``generate_merges`` with scores).

    >>> spm_merges(["a", "b", "c", "ab", "abc"], [0.0, 0.0, 0.0, -1.0, -2.0])
    [['a', 'b'], ['ab', 'c']]
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[float, int, int, str, str]] = []
    for token, score in dict(zip(tokens, scores, strict=True)).items():
        local = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        found += [(score, len(left), len(right), left, right) for left, right in local]
    found.sort(key=lambda m: (m[0], m[1], m[2]), reverse=True)
    return [[left, right] for _, _, _, left, right in found]


def _sentencepiece(metadata: Mapping[str, Value], tokens: list[str], types: list[int], *, where: str) -> JsonObject:
    raw = metadata.get("tokenizer.ggml.scores")
    scores = [float(s) if isinstance(s, (int, float)) else 0.0 for s in raw] if isinstance(raw, list) else []
    if len(scores) != len(tokens):
        raise InvalidInputError(f"{where}: {len(tokens)} tokens but {len(scores)} scores in a SentencePiece vocabulary")
    prefix = metadata.get("tokenizer.ggml.add_space_prefix", True) is not False
    unk_id = _id(metadata, "unknown_token_id", len(tokens))
    unk = tokens[unk_id] if unk_id is not None else next((t for t, k in zip(tokens, types, strict=True)
                                                          if k == UNKNOWN), None)
    vocab: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        if not _filler(token, i, kind):
            vocab.setdefault(token, i)
    decoders: list[JsonObject] = [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                                  {"type": "ByteFallback"}, {"type": "Fuse"}]
    if prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {"pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first" if prefix else
                              "never", "split": False},
            "decoder": {"type": "Sequence", "decoders": decoders},
            "model": _bpe(vocab, spm_merges(tokens, scores), unk=unk, byte_fallback=True)}


def _wordpiece(metadata: Mapping[str, Value], tokens: list[str], specials: JsonObject) -> JsonObject:
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    lowercase = metadata.get("tokenizer.ggml.normalizer.lowercase", True) is not False
    return {"normalizer": {"type": "BertNormalizer", "clean_text": True, "handle_chinese_chars": True,
                           "strip_accents": None, "lowercase": lowercase},
            "pre_tokenizer": {"type": "BertPreTokenizer"},
            "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": True},
            "model": {"type": "WordPiece", "unk_token": specials.get("unk_token", "[UNK]"),
                      "continuing_subword_prefix": "##", "max_input_chars_per_word": 100, "vocab": vocab}}
