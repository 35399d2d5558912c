"""A Hugging Face tokenizer folder's vocabulary as the ``tokenizer.*`` keys llama.cpp's converter writes.

Which vocabulary (as ``convert_hf_to_gguf.py`` chooses for the architectures shardkit writes):

============================================  ===========================================================
folder                                        ``tokenizer.ggml.model``
============================================  ===========================================================
``tokenizer.json`` with a byte-level BPE      ``gpt2``: tokens by id (added tokens CONTROL when special or
                                              looking special, else USER_DEFINED; missing ids ``[PADn]``
                                              UNUSED up to config's ``vocab_size``), merges, and
                                              ``tokenizer.ggml.pre`` from the hash of a probe text's ids
                                              (:mod:`shardkit.layouts.gguf_pre`)
``tokenizer.json`` WordPiece (BERT)           ``bert``: the same token list in "phantom space" form (``##x``
                                              → ``x``, others ``▁x``, CONTROL tokens as they are)
``tokenizer.model`` (SentencePiece; first,    ``llama``, pre ``default``: pieces with their scores and types
for Llama, Mistral and Qwen)                  (:mod:`shardkit.layouts.gguf_spm`), no merges
============================================  ===========================================================

Then the special vocabulary (:mod:`shardkit.layouts.gguf_special`): special token ids, add_bos/add_eos,
the chat template, normalizer flags. A SentencePiece-style BPE ``tokenizer.json`` (byte fallback) without
its ``tokenizer.model`` is refused, naming what is supported; so is a BPE whose pre-tokenizer llama.cpp does
not know (its converter refuses it too).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypedDict

from ..errors import InvalidInputError, Option
from ..formats.gguf import ARRAY, BOOL, FLOAT32, INT32, STRING, UINT32, Value
from ..formats.json_types import Config, JsonObject
from .gguf_pre import PRE_TOKENIZERS, PROBE_TEXT
from .gguf_special import ChatFiles, SpecialVocab, special_vocab

__all__ = ["NORMAL", "Vocab", "VocabSummary", "describe_vocab", "has_tokenizer", "probe_hash", "read_vocab"]

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # llama.cpp's token types
Row = tuple[str, int, Value, int | None]
SUPPORTED = ("a SentencePiece tokenizer.model (Llama 2, Mistral 7B...), a byte-level BPE tokenizer.json (GPT-2 style: "
             "Llama 3, Qwen, Mistral Nemo...) or a WordPiece one (BERT)")


@dataclass
class Vocab:
    """The ``tokenizer.*`` GGUF keys of a folder, in the order llama.cpp's converter writes them."""

    model: str
    pre: str | None
    size: int
    rows: list[Row]


class VocabSummary(TypedDict):
    """What :func:`describe_vocab` says of a GGUF's vocabulary (``info``'s ``vocabulary``)."""

    model: Value | None  # tokenizer.ggml.model as stored
    size: int
    pre: str | None
    chat_template: bool
    missing: bool
    text: str


def has_tokenizer(folder: str) -> bool:
    """Whether ``folder`` holds a tokenizer llama.cpp's converter would read."""
    return any(os.path.isfile(os.path.join(folder, name)) for name in ("tokenizer.json", "tokenizer.model"))


def _read_json(folder: str, name: str) -> object:
    from ..formats.links import parse_json, read_inside

    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return None
    return parse_json(read_inside(folder, name, where=path), path=path)


def _read_text(folder: str, name: str) -> str:
    from ..formats.links import read_inside

    path = os.path.join(folder, name)
    try:
        return read_inside(folder, name, where=path).decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidInputError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); fix or remove it") from e


def read_vocab(folder: str, config: Config, *, bert: bool = False, space_prefix: bool = False) -> Vocab:
    """The vocabulary of the tokenizer in ``folder`` (``bert``: the WordPiece form BERT models get;
    ``space_prefix``: write ``tokenizer_config.json``'s ``add_prefix_space``, as the converter does for Llama).

    Raises:
        InvalidInputError: no tokenizer, or one llama.cpp's converter would not write this way (the
            message names what is supported).
    """
    path = os.path.join(folder, "tokenizer.json")
    tc = _read_json(folder, "tokenizer_config.json")
    tc = tc if isinstance(tc, dict) else None
    rows: list[Row] = []
    if space_prefix and tc is not None and isinstance(tc.get("add_prefix_space"), bool):
        rows.append(("tokenizer.ggml.add_space_prefix", BOOL, tc["add_prefix_space"], None))
    tokenizer = _read_json(folder, "tokenizer.json")
    if not bert and os.path.isfile(os.path.join(folder, "tokenizer.model")):
        return _sentencepiece(folder, config, tc, tokenizer if isinstance(tokenizer, dict) else None, rows)
    if not isinstance(tokenizer, dict) or not isinstance(tokenizer.get("model"), dict):
        raise InvalidInputError(f"{folder}: no tokenizer.json; ", Option("to", "gguf"),
                                f" writes the vocabulary of {SUPPORTED}")
    kind = tokenizer["model"].get("type")
    if bert != (kind == "WordPiece") or (kind == "BPE" and _sentencepiece_style(tokenizer)) or kind not in (
            "BPE", "WordPiece"):
        raise InvalidInputError(f"{path}: a {kind} tokenizer{' for a BERT model' if bert else ''} (SentencePiece style "
                                "without its tokenizer.model, or unsupported here); ", Option("to", "gguf"),
                                " writes the vocabulary "
                                f"of {SUPPORTED}")
    tokens, types = _tokens(tokenizer, tc, config, where=path)
    pre = _pre_tokenizer(path, tokenizer)
    if bert:
        rows.append(("tokenizer.ggml.token_type_count", UINT32, int(config.get("type_vocab_size", 1)), None))
        tokens = [t if kind_ == CONTROL else t[2:] if t.startswith("##") else "\u2581" + t
                  for t, kind_ in zip(tokens, types, strict=True)]
    token_list: list[Value] = list(tokens)
    type_list: list[Value] = list(types)
    rows += [("tokenizer.ggml.model", STRING, "bert" if bert else "gpt2", None),
             ("tokenizer.ggml.pre", STRING, pre, None), ("tokenizer.ggml.tokens", ARRAY, token_list, STRING),
             ("tokenizer.ggml.token_type", ARRAY, type_list, INT32)]
    chat = _chat_files(folder)
    special = special_vocab(tokenizer, tc, config, chat, merges=not bert, n_vocab=len(tokens) if bert else None)
    rows += _special_rows(special)
    return Vocab("bert" if bert else "gpt2", pre, len(tokens), rows)


def _sentencepiece(folder: str, config: Config, tc: JsonObject | None, tokenizer: Config | None,
                   rows: list[Row]) -> Vocab:
    """``tokenizer.model`` (llama.cpp's ``llama`` vocabulary: scores and types, no merges)."""
    from .gguf_spm import sentencepiece_tokens

    tokens, scores, types = sentencepiece_tokens(folder, config, tc, looks_special=_looks_special)
    token_list: list[Value] = list(tokens)
    score_list: list[Value] = list(scores)
    type_list: list[Value] = list(types)
    rows = rows + [("tokenizer.ggml.model", STRING, "llama", None), ("tokenizer.ggml.pre", STRING, "default", None),
                   ("tokenizer.ggml.tokens", ARRAY, token_list, STRING),
                   ("tokenizer.ggml.scores", ARRAY, score_list, FLOAT32),
                   ("tokenizer.ggml.token_type", ARRAY, type_list, INT32)]
    special = special_vocab(tokenizer, tc, config, _chat_files(folder), merges=False, n_vocab=len(tokens))
    return Vocab("llama", "default", len(tokens), rows + _special_rows(special))


def _sentencepiece_style(tokenizer: Config) -> bool:
    """llama.cpp's test for a Llama-2-style BPE (``LlamaHfVocab``): byte fallback and a Sequence decoder."""
    model = tokenizer["model"]
    llama3 = model.get("ignore_merges", False) and not model.get("byte_fallback", True)
    decoder = tokenizer.get("decoder") or {}
    return not llama3 and bool(model.get("byte_fallback", False)) and decoder.get("type") == "Sequence"


def _looks_special(token: str) -> bool:
    """llama.cpp's ``does_token_look_special``: added tokens that are control tokens though not marked special."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
            or (token.startswith("<unused") and token.endswith(">")))


def _tokens(tokenizer: Config, tc: Config | None, config: Config, *, where: str) -> tuple[list[str], list[int]]:
    vocab: dict[str, int] = dict(tokenizer["model"].get("vocab") or {})
    added = {int(a["id"]): a for a in tokenizer.get("added_tokens") or [] if isinstance(a, Mapping)}
    for token_id, a in added.items():
        vocab[str(a["content"])] = token_id
    by_id = {token_id: token for token, token_id in vocab.items()}
    size = config.get("vocab_size", len(vocab))
    if not isinstance(size, int) or not by_id or max(by_id) >= size:
        raise InvalidInputError(f"{where}: token ids reach {max(by_id, default=-1)} but config.json's vocab_size is "
                                f"{size!r}; the embedding must have a row per token")
    added_contents = {str(a["content"]) for a in added.values()}
    tokens, types = [], []
    for i in range(size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif token in added_contents:
            a = added.get(i, {})
            if a.get("special") or _looks_special(token):
                types.append(CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(USER_DEFINED)
            tokens.append(token)
        else:
            tokens.append(token)
            types.append(NORMAL)
    return tokens, types


def probe_hash(tokenizer_file: str) -> str:
    """The SHA-256 llama.cpp's converter takes of ``str()`` of the probe text's token ids (special tokens added)."""
    from hashlib import sha256

    try:
        from tokenizers import Tokenizer
    except ImportError as e:  # pragma: no cover - tokenizers comes with transformers
        raise InvalidInputError(Option("to", "gguf"), " with a tokenizer needs the tokenizers package: pip install "
                                "'shardkit[transformers]'") from e
    tokenizer = Tokenizer.from_file(tokenizer_file)
    tokenizer.no_truncation()  # as transformers' encode() (a tokenizer.json may keep a training-time max_length)
    tokenizer.no_padding()
    ids = tokenizer.encode(PROBE_TEXT).ids
    return sha256(str(list(ids)).encode()).hexdigest()


def _pre_tokenizer(path: str, tokenizer: Config) -> str:
    digest = probe_hash(path)
    name = PRE_TOKENIZERS.get(digest)
    if name is None:
        raise InvalidInputError(f"{path}: its pre-tokenizer is not one llama.cpp implements (probe hash {digest[:16]}..., "
                                f"{len(PRE_TOKENIZERS)} known, e.g. llama-bpe, qwen2, gpt-2, bert-bge); llama.cpp's own "
                                "converter refuses it too")
    return name


def _chat_files(folder: str) -> ChatFiles:
    """``chat_template.jinja`` (with ``additional_chat_templates/*.jinja`` as a named list) or ``chat_template.json``."""
    if os.path.isfile(os.path.join(folder, "chat_template.jinja")):
        template = _read_text(folder, "chat_template.jinja")
        extra = os.path.join(folder, "additional_chat_templates")
        names = sorted(n for n in os.listdir(extra) if n.endswith(".jinja")) if os.path.isdir(extra) else []
        if names:
            named = [{"name": "default", "template": template}]
            named += [{"name": name[: -len(".jinja")], "template": _read_text(extra, name)} for name in names]
            return {"jinja": named}
        return {"jinja": template}
    data = _read_json(folder, "chat_template.json")
    return {"json": data.get("chat_template")} if isinstance(data, dict) else {}


def _special_rows(special: SpecialVocab) -> list[Row]:
    rows: list[Row] = []
    if special.merges:
        merges: list[Value] = list(special.merges)
        rows.append(("tokenizer.ggml.merges", ARRAY, merges, STRING))
    rows += [(key, UINT32, value, None) for key, value in special.id_keys()]
    rows += [(key, BOOL, value, None) for key, value in special.add_keys()]
    rows += _chat_rows(special.chat_template)
    if special.lowercase is not None:
        rows.append(("tokenizer.ggml.normalizer.lowercase", BOOL, special.lowercase, None))
    if special.strip_accents is not None:
        rows.append(("tokenizer.ggml.normalizer.strip_accents", BOOL, special.strip_accents, None))
    return rows


def _chat_rows(template: str | list[dict[str, str]] | None) -> list[Row]:
    if template is None:
        return []
    if isinstance(template, str):
        return [("tokenizer.chat_template", STRING, template, None)]
    rows: list[Row] = []
    default, names = None, list[Value]()
    for choice in template:
        name = "".join(c if c.isascii() and c.isalnum() else "_" for c in str(choice.get("name", "")))
        text = choice.get("template")
        if name and text is not None:
            if name == "default":
                default = text
            else:
                names.append(name)
                rows.append((f"tokenizer.chat_template.{name}", STRING, text, None))
    if names:
        rows.append(("tokenizer.chat_templates", ARRAY, names, STRING))
    if default is not None:
        rows.append(("tokenizer.chat_template", STRING, default, None))
    return rows


def describe_vocab(metadata: Mapping[str, Value], architecture: str) -> VocabSummary | None:
    """What a GGUF's metadata says of its vocabulary, for ``info`` and ``verify``; None for a file that needs none.

    A language model (llama.cpp's ``{arch}.block_count`` key) without tokens gets ``"missing": True``: llama.cpp
    cannot tokenize text with it. Diffusion models (Flux...) have no vocabulary and need none.

    >>> describe_vocab({"llama.block_count": 2, "tokenizer.ggml.model": "no_vocab"}, "llama")["missing"]
    True
    """
    model = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    size = len(tokens) if isinstance(tokens, list) else 0
    if model is None and f"{architecture}.block_count" not in metadata:
        return None
    pre = metadata.get("tokenizer.ggml.pre")
    chat = isinstance(metadata.get("tokenizer.chat_template"), str)
    missing = not size or model in (None, "none", "no_vocab")
    if missing:
        text = (f"none (tokenizer.ggml.model = {model or 'absent'}): llama.cpp cannot tokenize text with this file; "
                "convert it from a folder with the model's tokenizer.json")
    else:
        text = f"{model}, {size:,} tokens" + (f", pre-tokenizer {pre}" if isinstance(pre, str) else "")
        text += ", chat template" if chat else ", no chat template"
    return {"model": model, "size": size, "pre": pre if isinstance(pre, str) else None, "chat_template": chat,
            "missing": missing, "text": text}
