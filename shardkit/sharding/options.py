"""The options every writing job shares (split, convert, save_sharded, pipeline folders).

Public functions keep their wide keyword signatures for callers; they parse sizes once, at
that edge, into one :class:`WriteOptions`, and everything below them takes that object.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypedDict, TypeVar, get_args

from ..errors import InvalidInputError, InvalidSizeError, Option, Part, ShardkitWarning, join_parts
from ..units import LOSSLESS_TARGETS, ProgressCallback, normalize_dtype, parse_size

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "DTYPE_CHOICES", "ProgressCallback", "Quantize", "SaveKeywords", "WriteKeywords",
           "WriteOptions", "option_field", "option_keyword", "resolve_cast", "warn", "warn_if_many_shards", "warn_if_output_taken"]

DEFAULT_MAX_SHARD_SIZE = "5GB"
DEFAULT_MAX_SHARD_BYTES = parse_size(DEFAULT_MAX_SHARD_SIZE)
Quantize = Literal["fp8-block", "fp8-channel", "fp8-tensor", "nvfp4", "mxfp4", "f16", "bf16", "q8_0", "q4_0", "q4_1",
                   "q5_0", "q5_1", "f32"]
DTYPE_CHOICES = ("bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2")  # what the CLI offers; Python takes torch dtypes too


T = TypeVar("T")


def option_field(default: T, help: str | tuple[Part, ...], *, keyword: str | None = None, choices: tuple[str, ...] = (),
                 cli: bool = True, negatable: bool = False, short: str | None = None,
                 repeatable: str | None = None) -> T:
    """An options field (:class:`WriteOptions`, ``PushOptions``) and everything the front ends derive from
    it: its one-line help (the CLI's ``--help`` and the docs' table), its Python keyword when it is not the
    field's name, its closed choices, whether the CLI has a flag for it (``--no-NAME`` too when
    ``negatable``; a flag defaulting to True that is not negatable is typed ``--no-NAME`` alone), its
    short flag (``"-m"``), and for a tuple of values the metavar of its repeatable flag. ``help`` is text, or
    its parts when it names options (:class:`~shardkit.errors.Option`: flags in the CLI's help)."""
    help_parts = (help,) if isinstance(help, str) else help
    metadata = {"help": join_parts(help_parts), "help_parts": help_parts, "keyword": keyword, "choices": choices,
                "cli": cli, "negatable": negatable, "short": short, "repeatable": repeatable}
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class WriteOptions:
    """How a writing job shapes and publishes its output: the one definition of the write options.

    ``shardkit.split``, ``convert`` and ``save_sharded`` take them as ``options=WriteOptions(...)`` or as
    keyword shorthands (:class:`WriteKeywords`: the same names, ``max_shard_size="5GB"`` for
    ``max_shard_bytes``); the CLI's flags and the table in ``docs/options.md`` are made from these
    fields, and ``tests/test_options_drift.py`` fails when any of them drifts.

    Args:
        max_shard_bytes: the largest shard, in tensor bytes (a bigger tensor gets its own shard).
        dtype: cast floating-point tensors to this (``"bf16"``, ``"fp16"``, ``torch.float32``...).
        allow_lossy: permit casts that lose range or precision (fp8).
        quantize: ``"fp8-block"`` (transformers FineGrainedFP8), ``"fp8-channel"`` or ``"fp8-tensor"``
            (compressed-tensors): weights to e4m3fn with scales (see :mod:`shardkit.sharding.quant`);
            ``"nvfp4"`` (compressed-tensors nvfp4-pack-quantized) or ``"mxfp4"`` (gpt-oss MoE experts);
            ``"f16"``, ``"bf16"``, ``"q8_0"``, ``"q4_0"``, ``"q4_1"``, ``"q5_0"``, ``"q5_1"``, ``"f32"``: ggml types, for ``convert(..., to="gguf")``.
        name: output file prefix (``"model"``); None keeps the source's convention.
        variant: inserted before the extension (``"fp16"``); None keeps the source's.
        overwrite: replace the checkpoint in an existing, non-empty output folder.
        dry_run: plan only; write nothing.
        manifest: write ``shardkit.manifest.json`` (crc32 of every tensor, for ``verify``); off
            saves reading back the tensors of a source that has none.
        metadata: extra safetensors header metadata for every shard.
        progress: called as ``progress(done_bytes, total_bytes)`` while bytes are written.

    Invalid values (a non-positive size, a lossy cast without ``allow_lossy``) are refused when
    the object is made, before any source is opened.

    >>> options = WriteOptions(max_shard_bytes=2 * 10**9, dtype="bf16")
    >>> options.cast_to
    'BF16'
    >>> WriteOptions.parse(max_shard_size="2GB", dry_run=True).max_shard_bytes
    2000000000
    """

    max_shard_bytes: int = option_field(
        DEFAULT_MAX_SHARD_BYTES, "Largest shard, in tensor bytes: 5GB = 5×10^9 bytes, 5GiB = 5×2^30 bytes; a bare "
        "number is bytes.", keyword="max_shard_size")
    dtype: str | None = option_field(None, "Cast floating-point tensors (F64/F32/F16/BF16) in bounded chunks.",
                                choices=DTYPE_CHOICES)
    allow_lossy: bool = option_field(False, "Permit casts that lose range or precision (fp8).")
    quantize: Quantize | None = option_field(
        None, ("Weights to fp8 with absmax scales: fp8-block = 128x128 blocks (transformers FineGrainedFP8), "
               "fp8-channel/fp8-tensor = compressed-tensors; norms, embeddings, lm_head and modulation layers kept. "
               "nvfp4 = compressed-tensors nvfp4-pack-quantized; mxfp4 = gpt-oss MoE experts (original layout). "
               "f16/bf16/q8_0/q4_0/q4_1/q5_0/q5_1/f32: ggml types, for a convert with ", Option("to", "gguf"),
               " (1-D tensors stay F32)."), choices=get_args(Quantize))
    name: str | None = option_field(None, "Output file prefix, e.g. 'model' or 'diffusion_pytorch_model'.")
    variant: str | None = option_field(None, "Variant inserted before the extension, e.g. 'fp16'.")
    overwrite: bool = option_field(False, "Replace the checkpoint in an existing output folder.")
    dry_run: bool = option_field(False, "Print the plan and write nothing.")
    manifest: bool = option_field(
        True, ("Write shardkit.manifest.json (crc32 of every tensor) so `verify` catches a changed byte; ",
               Option("manifest", False), " skips reading back a source that has none (instant copy-on-write "
               "reshards of foreign checkpoints)."), negatable=True)
    metadata: Mapping[str, str] | None = option_field(None, "Extra safetensors header metadata for every shard.",
                                                 cli=False)
    progress: ProgressCallback | None = option_field(
        None, "Called as progress(done_bytes, total_bytes) while bytes are written.", cli=False)

    def __post_init__(self) -> None:
        if isinstance(self.max_shard_bytes, bool) or not isinstance(self.max_shard_bytes, int):
            raise InvalidSizeError(f"max_shard_bytes must be a byte count (int), got {self.max_shard_bytes!r}; "
                                    "parse sizes such as '5GB' with WriteOptions.parse")
        if self.max_shard_bytes <= 0:
            raise InvalidSizeError(f"max shard size must be positive, got {self.max_shard_bytes}")
        code = resolve_cast(self.dtype, allow_lossy=self.allow_lossy)
        if self.quantize is not None:
            if self.quantize not in get_args(Quantize):
                raise InvalidInputError(Option("quantize", self.quantize), ": expected one of "
                                        f"{', '.join(get_args(Quantize))}")
            if code is not None and code not in LOSSLESS_TARGETS:
                raise InvalidInputError(Option("quantize", self.quantize), " with ", Option("dtype", self.dtype), ": ",
                                        Option("dtype"), " casts the tensors ", Option("quantize"),
                                        " keeps (norms, embeddings...); give bf16, fp16 or fp32")

    @classmethod
    def parse(cls, **fields: Unpack[WriteKeywords]) -> WriteOptions:
        """Build from a user-facing size (``max_shard_size="5GB"``, ``"2GiB"``, or bytes) and the other fields.

        Args:
            **fields: :class:`WriteKeywords`: ``max_shard_size`` as the user wrote it, any other
                :class:`WriteOptions` field by name.

        Returns:
            The validated options.
        """
        return cls.build(None, fields, where="WriteOptions.parse")

    @classmethod
    def build(cls, options: WriteOptions | None = None, shorthands: Mapping[str, object] | None = None, *,
              where: str = "a writing job", save: bool = False) -> WriteOptions:
        """The options of one call: ``options`` (default: the defaults) with the keyword shorthands applied.

        ``shorthands`` are :class:`WriteKeywords` (:class:`SaveKeywords` with ``save``):
        ``max_shard_size`` as the user wrote it, the rest by field name; a name that is not one of
        them is a ``TypeError`` naming ``where``, as Python's own would be.

        >>> WriteOptions.build(WriteOptions(dtype="bf16"), {"max_shard_size": "2GB"}).max_shard_bytes
        2000000000
        """
        if not shorthands:
            return options if options is not None else cls()
        fields: dict[str, Any] = dict(shorthands)  # checked by name below, by value in __post_init__
        keywords = SaveKeywords if save else WriteKeywords
        unknown = sorted(set(fields) - keywords.__required_keys__ - keywords.__optional_keys__)
        if unknown:
            raise TypeError(f"{where} got an unexpected keyword argument {unknown[0]!r}")
        if "max_shard_size" in fields:
            fields["max_shard_bytes"] = parse_size(fields.pop("max_shard_size"), name="max shard size")
        if options is None:
            return cls(**fields)
        return dataclasses.replace(options, **fields)

    @property
    def cast_to(self) -> str | None:
        """The safetensors dtype code floating-point tensors are cast to, or None."""
        return resolve_cast(self.dtype, allow_lossy=self.allow_lossy)


def option_keyword(option: dataclasses.Field[object]) -> str:
    """The Python keyword of a :class:`WriteOptions` field (``max_shard_bytes`` → ``max_shard_size``)."""
    keyword = option.metadata.get("keyword")
    return keyword if isinstance(keyword, str) else option.name


class SaveKeywords(TypedDict, total=False):
    """The keyword shorthands of :class:`WriteOptions` that ``save_sharded`` takes (an in-memory write
    is never a dry run and never quantizes); each is the field of that name, ``max_shard_size`` the
    size as written (``"5GB"``, ``"2GiB"``, an int). Checked against the fields by a test."""

    max_shard_size: str | int
    dtype: str | None
    allow_lossy: bool
    name: str | None
    variant: str | None
    overwrite: bool
    manifest: bool
    metadata: Mapping[str, str] | None
    progress: ProgressCallback | None


class WriteKeywords(SaveKeywords, total=False):
    """Every :class:`WriteOptions` field as a keyword shorthand (``split``, ``convert``)."""

    quantize: Quantize | None
    dry_run: bool


def resolve_cast(dtype: str | None, *, allow_lossy: bool) -> str | None:
    """``"bf16"``/``torch.bfloat16`` → ``"BF16"``; refuses lossy targets unless allowed."""
    if dtype is None:
        return None
    code = normalize_dtype(str(dtype).removeprefix("torch."))
    if code not in LOSSLESS_TARGETS and not allow_lossy:
        raise InvalidInputError(f"casting to {dtype} loses precision; pass ", Option("allow_lossy", True), " to do it")
    return code


MANY_SHARDS = 1000


def warn_if_many_shards(shard_count: int, *, max_shard_bytes: int, total_bytes: int) -> None:
    """A plan of thousands of files is almost always a size given in the wrong unit."""
    if shard_count > MANY_SHARDS:
        from ..units import format_size

        warn(f"the plan has {shard_count} shards of at most {format_size(max_shard_bytes)} for "
             f"{format_size(total_bytes)} of tensors; is ", Option("max_shard_size"),
             " in the unit you meant (5GB, 500MB)?")


def warn_if_output_taken(output: str, *, overwrite: bool) -> None:
    """A dry run writes nothing, but says when the real run would refuse the output."""
    if not overwrite and os.path.isdir(output) and os.listdir(output):
        warn(f"{output} exists and is not empty: the real run needs ", Option("overwrite", True))


def warn(*parts: Part) -> None:
    """A :class:`ShardkitWarning` attributed to the first caller outside shardkit.

    A fixed ``stacklevel`` would be wrong for some entry points: the same job runs under
    ``split``, ``convert``, ``save_sharded`` and pipeline splits, at different depths.
    """
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith("shardkit."):
        frame, level = frame.f_back, level + 1
    warnings.warn(ShardkitWarning(*parts), stacklevel=level)
