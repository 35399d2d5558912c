"""Special tokens, merges, add_bos/add_eos flags and the chat template of a Hugging Face tokenizer, as GGUF keys.

What llama.cpp's gguf-py ``SpecialVocab`` reads, in its order: ``tokenizer.json`` (merges, the normalizer's
lowercase/strip-accents flags, the post-processor: ``ByteLevel``, ``RobertaProcessing`` or a simple
``TemplateProcessing`` deciding add_bos/add_eos/add_sep and which tokens are bos/eos/eot), then
``tokenizer_config.json`` (``add_*_token``, ``*_token`` looked up among the added tokens, the chat template
or ``chat_template.jinja`` / ``chat_template.json``), then ``config.json`` (``*_token_id`` not yet set).
The first value found for a special token wins.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypedDict

from ..formats.json_types import Config, JsonObject

__all__ = ["ChatFiles", "SpecialVocab", "special_vocab"]

_ID_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "sep": "seperator_token_id",
            "pad": "padding_token_id", "mask": "mask_token_id", "eot": "eot_token_id", "eom": "eom_token_id"}
_ADD_KEYS = ("bos", "eos", "sep")  # the add_*_token flags GGUF has (no cls: gguf-py skips it)


@dataclass
class SpecialVocab:
    """What :func:`special_vocab` found: GGUF ``tokenizer.*`` values by meaning."""

    merges: list[str] = field(default_factory=list)
    ids: dict[str, int] = field(default_factory=dict)          # "bos" → token id, in the order found
    add: dict[str, bool] = field(default_factory=dict)         # "bos" → add_bos_token
    chat_template: str | list[dict[str, str]] | None = None
    lowercase: bool | None = None
    strip_accents: bool | None = None
    types: tuple[str, ...] = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
    n_vocab: int | None = None

    def set_id(self, kind: str, token_id: object) -> None:
        if isinstance(token_id, int) and not isinstance(token_id, bool) and token_id >= 0 and kind not in self.ids:
            if self.n_vocab is None or token_id < self.n_vocab:
                self.ids[kind] = token_id

    def id_keys(self) -> list[tuple[str, int]]:
        """``(tokenizer.ggml.* key, id)`` in the order gguf-py writes them (types without a GGUF key skipped)."""
        return [(f"tokenizer.ggml.{_ID_KEYS[kind]}", value) for kind, value in self.ids.items() if kind in _ID_KEYS]

    def add_keys(self) -> list[tuple[str, bool]]:
        return [(f"tokenizer.ggml.add_{kind}_token", value) for kind, value in self.add.items() if kind in _ADD_KEYS]


class ChatFiles(TypedDict, total=False):
    """A tokenizer folder's chat template files: ``chat_template.jinja`` (with the named
    ``additional_chat_templates/*.jinja``) or ``chat_template.json``'s ``chat_template`` value, unchecked."""

    jinja: str | list[dict[str, str]]
    json: object


def special_vocab(tokenizer: Config | None, tokenizer_config: JsonObject | None,
                  config: Config | None, chat_files: ChatFiles, *, merges: bool,
                  n_vocab: int | None = None) -> SpecialVocab:
    """The special vocabulary of a tokenizer folder's parsed files (``chat_files``: ``jinja``/``json``/``extra``)."""
    out = SpecialVocab(n_vocab=n_vocab)
    tc = dict(tokenizer_config) if tokenizer_config is not None else None
    added: list[Config] = []  # tokenizer.json's added_tokens
    if tokenizer is not None:
        if merges:
            out.merges = _merges(tokenizer.get("model", {}).get("merges"))
        normalizer = tokenizer.get("normalizer")
        if normalizer:
            _normalizer(out, normalizer)
        added = list(tokenizer.get("added_tokens") or [])
        _post_processor(out, tokenizer.get("post_processor"), tc)
    if tc:
        _from_tokenizer_config(out, tc, added, chat_files)
    if config is not None:
        for kind in out.types:
            token_id = config.get(f"{kind}_token_id")
            text = config.get("text_config")
            if token_id is None and isinstance(text, Mapping):
                token_id = text.get(f"{kind}_token_id")
            out.set_id(kind, token_id)
    return out


def _merges(merges: object) -> list[str]:
    if not isinstance(merges, list) or not merges:
        return []
    if isinstance(merges[0], str):
        return list(merges)
    # [["a", "b"], ...] (transformers ≥ 4.45): a space inside a part is written as U+0120 + ... (gguf-py's encoding)
    return [" ".join("".join(chr(ord(c) + 256) if c == " " else c for c in part) for part in pair) for pair in merges]


def _normalizer(out: SpecialVocab, normalizer: Config) -> None:
    kind = normalizer.get("type")
    if kind == "Lowercase":
        out.lowercase = True
    elif kind == "StripAccents":
        out.strip_accents = True
    elif kind == "BertNormalizer":
        if "lowercase" in normalizer:
            out.lowercase = normalizer["lowercase"]
        if "strip_accents" in normalizer:
            out.strip_accents = normalizer["strip_accents"]
    elif kind == "Sequence":
        for inner in normalizer.get("normalizers", []):
            _normalizer(out, inner)


def _post_processor(out: SpecialVocab, post: Config | None, tc: JsonObject | None) -> None:
    bos, cls = (tc or {}).get("bos_token"), (tc or {}).get("cls_token")
    eos, sep = (tc or {}).get("eos_token"), (tc or {}).get("sep_token")
    if not bos and cls and tc:
        tc["bos_token"] = bos = cls
    if not eos and sep and tc:
        tc["eos_token"] = eos = sep
    if not post:
        return
    for proc in post.get("processors", [post]):
        kind = proc.get("type")
        if kind == "ByteLevel":
            out.add.setdefault("bos", False)
            out.add.setdefault("eos", False)
        elif kind == "RobertaProcessing":
            out.add.update(bos=True, eos=True, sep=True)
            if not cls and tc:
                tc["cls_token"] = cls = proc.get("cls", [bos])[0]
            if not sep and tc:
                tc["sep_token"] = sep = proc.get("sep", [eos])[0]
        elif kind == "TemplateProcessing":
            bos, cls, eos, sep = _template(out, proc, tc, bos, cls, eos, sep)


def _special(piece: object) -> object:
    return piece.get("SpecialToken", {}).get("id") if isinstance(piece, Mapping) else None


def _template(out: SpecialVocab, proc: Config, tc: JsonObject | None,
              bos: object, cls: object, eos: object, sep: object) -> tuple[object, object, object, object]:
    """gguf-py's reading of a ``TemplateProcessing`` (simple templates only, as there).

    ``bos``... ``sep``: tokenizer_config's ``*_token`` values (a token's text, an ``AddedToken`` object or
    absent) or a template's special token id, only compared and passed on.
    """
    single, pair = proc.get("single", []), proc.get("pair", [])
    first = last = None
    if len(single) > 1:
        first = _special(single[0])
        if first:
            if not tc:
                bos = first
            elif first not in (bos, cls):
                if not bos:
                    tc["bos_token"] = bos = first
                if not cls:
                    tc["cls_token"] = cls = first
            out.add["bos"] = first in (bos, cls)
        last = _special(single[-1])
        if last:
            if not tc:
                eos = last
            elif last != eos:
                if "eot" not in out.types:
                    out.types, tc["eot_token"] = (*out.types, "eot"), eos
                elif "eom" not in out.types:
                    out.types, tc["eom_token"] = (*out.types, "eom"), eos
                tc["eos_token"] = eos = last
            out.add["eos"] = last == eos
    if pair:
        start = 1 if first and _special(pair[0]) == first else 0
        stop = -1 if last and _special(pair[-1]) == last else None
        middle = pair[start:stop]
        if middle:
            sep = _pair_separator(out, middle, tc, first=first, last=last, eos=eos, sep=sep)
    return bos, cls, eos, sep


def _pair_separator(out: SpecialVocab, middle: list[object], tc: JsonObject | None, *, first: object, last: object,
                    eos: object, sep: object) -> object:
    a = middle[0].get("Sequence", {}).get("id") if isinstance(middle[0], Mapping) else None
    b = middle[-1].get("Sequence", {}).get("id") if isinstance(middle[-1], Mapping) else None
    inner = middle[1:-1]
    if a != "A" or b != "B" or not inner:
        return sep
    add_sep = False
    entry = _special(inner[0])
    if entry and entry in (sep, eos) and not last:
        add_sep = True
    if len(inner) == 2:
        entry = _special(inner[1])
        if entry and entry in (sep, eos):
            add_sep = True
    out.add["sep"] = add_sep
    if add_sep and not sep and tc:
        tc["sep_token"] = sep = eos
    return sep


def _from_tokenizer_config(out: SpecialVocab, tc: Config, added: list[Config], chat_files: ChatFiles) -> None:
    template = tc.get("chat_template", chat_files.get("jinja", chat_files.get("json")))
    if template is None or isinstance(template, (str, list)):
        out.chat_template = template
    for kind in out.types:
        flag = tc.get(f"add_{kind}_token")
        if isinstance(flag, bool) and kind not in out.add:
            out.add[kind] = flag
        entry = tc.get(f"{kind}_token")
        content = entry.get("content") if isinstance(entry, Mapping) else entry
        if not isinstance(content, str):
            continue
        out.set_id(kind, next((a.get("id") for a in added if a.get("content") == content), None))
