"""A SentencePiece ``tokenizer.model`` as llama.cpp's converter lists it: tokens, scores and token types.

The file is a protobuf ``ModelProto``; only its pieces are read (field 1, each a ``SentencePiece``: piece 1,
score 2, type 3), with a bounded, stdlib-only reader. As ``_create_vocab_sentencepiece`` does: ids up to
config's ``vocab_size`` (``[PADn]``, score -10000, UNUSED where the model has none), types UNKNOWN, CONTROL,
UNUSED and BYTE from the piece's type (user-defined pieces count as NORMAL there), then ``added_tokens.json``
and ``tokenizer_config.json``'s ``added_tokens_decoder`` overriding ids with score -1000 (CONTROL when
special or looking special, else USER_DEFINED with ``▁`` as a space).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable

from ..errors import InvalidInputError
from ..formats.json_types import Config

__all__ = ["sentencepiece_tokens"]

MAX_MODEL_BYTES = 64 * 2**20
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_KEPT_TYPES = {UNKNOWN, CONTROL, UNUSED, BYTE}


def _varint(data: bytes, pos: int, where: str) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise InvalidInputError(f"{where}: a truncated or damaged protobuf varint at byte {pos}; not a "
                                    "SentencePiece model")
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return value, pos


def _fields(data: bytes, where: str) -> list[tuple[int, int, int | bytes]]:
    """``(field number, wire type, value)`` of one protobuf message (value: an int for a varint, else bytes: a
    length-delimited field's, or the 8 or 4 bytes of a fixed64/fixed32 one)."""
    out: list[tuple[int, int, int | bytes]] = []
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos, where)
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == 0:
            value, pos = _varint(data, pos, where)
        elif wire == 2:
            length, pos = _varint(data, pos, where)
            if length > len(data) - pos:
                raise InvalidInputError(f"{where}: a field of {length} bytes runs past the end; not a SentencePiece model")
            value, pos = data[pos:pos + length], pos + length
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            if size > len(data) - pos:
                raise InvalidInputError(f"{where}: truncated at byte {pos}; not a SentencePiece model")
            value, pos = data[pos:pos + size], pos + size
        else:
            raise InvalidInputError(f"{where}: protobuf wire type {wire} at byte {pos}; not a SentencePiece model")
        out.append((number, wire, value))
    return out


def _pieces(data: bytes, where: str) -> list[tuple[str, float, int]]:
    pieces: list[tuple[str, float, int]] = []
    for number, wire, value in _fields(data, where):
        if number != 1 or wire != 2 or not isinstance(value, bytes):  # (wire type 2's value is bytes)
            continue
        piece, score, kind = "", 0.0, NORMAL
        for inner, inner_wire, inner_value in _fields(value, where):
            if inner == 1 and inner_wire == 2 and isinstance(inner_value, bytes):
                try:
                    piece = inner_value.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise InvalidInputError(f"{where}: piece #{len(pieces)} is not UTF-8") from e
            elif inner == 2 and inner_wire == 5 and isinstance(inner_value, bytes):
                score = struct.unpack("<f", inner_value)[0]
            elif inner == 3 and inner_wire == 0 and isinstance(inner_value, int):
                kind = inner_value
        pieces.append((piece, score, kind))
    if not pieces:
        raise InvalidInputError(f"{where}: no pieces; not a SentencePiece model")
    return pieces


def sentencepiece_tokens(folder: str, config: Config, tokenizer_config: Config | None, *,
                         looks_special: Callable[[str], bool]) -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and types of ``folder``'s ``tokenizer.model`` (see the module docstring)."""
    from ..formats.links import parse_json, read_inside

    where = os.path.join(folder, "tokenizer.model")
    pieces = _pieces(read_inside(folder, "tokenizer.model", where=where, max_bytes=MAX_MODEL_BYTES), where)
    size = config.get("vocab_size_per_layer_input", config.get("vocab_size")) or len(pieces)
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise InvalidInputError(f"{folder}: config.json's vocab_size is {size!r}; a positive integer is needed")
    tokens = [f"[PAD{i}]" for i in range(size)]
    scores, types = [-10000.0] * size, [UNUSED] * size
    for i, (piece, score, kind) in enumerate(pieces[:size]):
        tokens[i], scores[i], types[i] = piece, score, kind if kind in _KEPT_TYPES else NORMAL
    added = os.path.join(folder, "added_tokens.json")
    extra = parse_json(read_inside(folder, "added_tokens.json", where=added), path=added) if os.path.isfile(added) else {}
    for token, token_id in (extra.items() if isinstance(extra, dict) else []):
        if isinstance(token_id, int) and 0 <= token_id < size:
            tokens[token_id], scores[token_id], types[token_id] = token, -1000.0, USER_DEFINED
    decoder = (tokenizer_config or {}).get("added_tokens_decoder") or {}
    for key, data in (decoder.items() if isinstance(decoder, dict) else []):
        token_id = int(key) if str(key).isdigit() else -1
        if not 0 <= token_id < size or not isinstance(data, dict) or not isinstance(data.get("content"), str):
            continue
        token = data["content"]
        if data.get("special") or looks_special(token):
            types[token_id] = CONTROL
        else:
            token, types[token_id] = token.replace("\u2581", " "), USER_DEFINED
        tokens[token_id], scores[token_id] = token, -1000.0
    return tokens, scores, types
