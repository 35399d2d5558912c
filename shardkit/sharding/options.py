"""The options every writing job shares (split, convert, save_sharded, pipeline folders).

Public functions keep their wide keyword signatures for callers; they parse sizes once, at
that edge, into one :class:`WriteOptions`, and everything below them takes that object.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..errors import InvalidInputError, InvalidSizeError, ShardkitWarning
from ..units import LOSSLESS_TARGETS, normalize_dtype, parse_size

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "ProgressCallback", "WriteOptions", "resolve_cast", "warn", "warn_if_many_shards",
           "warn_if_output_taken"]

DEFAULT_MAX_SHARD_SIZE = "5GB"
DEFAULT_MAX_SHARD_BYTES = parse_size(DEFAULT_MAX_SHARD_SIZE)
ProgressCallback = Callable[[int, int], None]  # (bytes done, bytes total)


@dataclass(frozen=True)
class WriteOptions:
    """How a writing job shapes and publishes its output.

    Args:
        max_shard_bytes: the largest shard, in tensor bytes (a bigger tensor gets its own shard).
        dtype: cast floating-point tensors to this (``"bf16"``, ``"fp16"``, ``torch.float32``...).
        allow_lossy: permit casts that lose range or precision (fp8).
        name: output file prefix (``"model"``); None keeps the source's convention.
        variant: inserted before the extension (``"fp16"``); None keeps the source's.
        overwrite: replace the checkpoint in an existing, non-empty output folder.
        dry_run: plan only; write nothing.
        metadata: extra safetensors header metadata for every shard.
        manifest: write ``shardkit.manifest.json`` (crc32 of every tensor, for ``verify``); off
            saves reading back the tensors of a source that has none.
        progress: called as ``progress(done_bytes, total_bytes)`` while bytes are written.
        quantize: ``"fp8-block"`` (transformers FineGrainedFP8), ``"fp8-channel"`` or ``"fp8-tensor"``
            (compressed-tensors): weights to e4m3fn with scales (see :mod:`shardkit.sharding.quant`);
            ``"nvfp4"`` (compressed-tensors nvfp4-pack-quantized) or ``"mxfp4"`` (gpt-oss MoE experts);
            ``"f16"``, ``"bf16"``, ``"q8_0"``, ``"q4_0"``: ggml types, for ``convert(..., to="gguf")``.

    Invalid values (a non-positive size, a lossy cast without ``allow_lossy``) are refused when
    the object is made, before any source is opened.

    >>> options = WriteOptions(max_shard_bytes=2 * 10**9, dtype="bf16")
    >>> options.cast_to
    'BF16'
    >>> WriteOptions.parse(max_shard_size="2GB", dry_run=True).max_shard_bytes
    2000000000
    """

    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    dtype: str | None = None
    allow_lossy: bool = False
    name: str | None = None
    variant: str | None = None
    overwrite: bool = False
    dry_run: bool = False
    metadata: Mapping[str, str] | None = None
    manifest: bool = True
    progress: ProgressCallback | None = None
    quantize: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_shard_bytes, bool) or not isinstance(self.max_shard_bytes, int):
            raise InvalidSizeError(f"max_shard_bytes must be a byte count (int), got {self.max_shard_bytes!r}; "
                                    "parse sizes such as '5GB' with WriteOptions.parse")
        if self.max_shard_bytes <= 0:
            raise InvalidSizeError(f"max shard size must be positive, got {self.max_shard_bytes}")
        code = resolve_cast(self.dtype, allow_lossy=self.allow_lossy)
        if self.quantize is not None:
            from ..formats.gguf import GGUF_QUANTIZE
            from ..layouts.fp8 import QUANTIZE_SCHEMES
            from ..sources.quantized_fp4 import FP4_SCHEMES

            if self.quantize not in QUANTIZE_SCHEMES + FP4_SCHEMES and self.quantize not in GGUF_QUANTIZE:
                raise InvalidInputError(f"--quantize {self.quantize}: expected one of "
                                        f"{', '.join(QUANTIZE_SCHEMES + FP4_SCHEMES + tuple(GGUF_QUANTIZE))}")
            if code is not None and code not in LOSSLESS_TARGETS:
                raise InvalidInputError(f"--quantize {self.quantize} with --dtype {self.dtype}: --dtype casts the "
                                        "tensors --quantize keeps (norms, embeddings...); give bf16, fp16 or fp32")

    @classmethod
    def parse(cls, *, max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE, **fields: object) -> WriteOptions:
        """Build from a user-facing size (``"5GB"``, ``"2GiB"``, or bytes) and the other fields.

        Args:
            max_shard_size: the largest shard as the user wrote it.
            **fields: any other :class:`WriteOptions` field.

        Returns:
            The validated options.
        """
        return cls(max_shard_bytes=parse_size(max_shard_size, name="max shard size"), **fields)  # type: ignore[arg-type]

    @property
    def cast_to(self) -> str | None:
        """The safetensors dtype code floating-point tensors are cast to, or None."""
        return resolve_cast(self.dtype, allow_lossy=self.allow_lossy)


def resolve_cast(dtype: str | None, *, allow_lossy: bool) -> str | None:
    """``"bf16"``/``torch.bfloat16`` → ``"BF16"``; refuses lossy targets unless allowed."""
    if dtype is None:
        return None
    code = normalize_dtype(str(dtype).removeprefix("torch."))
    if code not in LOSSLESS_TARGETS and not allow_lossy:
        raise InvalidInputError(f"casting to {dtype} loses precision; pass --allow-lossy (allow_lossy=True) to do it")
    return code


MANY_SHARDS = 1000


def warn_if_many_shards(shard_count: int, *, max_shard_bytes: int, total_bytes: int) -> None:
    """A plan of thousands of files is almost always a size given in the wrong unit."""
    if shard_count > MANY_SHARDS:
        from ..units import format_size

        warn(f"the plan has {shard_count} shards of at most {format_size(max_shard_bytes)} for "
             f"{format_size(total_bytes)} of tensors; is --max-shard-size in the unit you meant (5GB, 500MB)?")


def warn_if_output_taken(output: str, *, overwrite: bool) -> None:
    """A dry run writes nothing, but says when the real run would refuse the output."""
    if not overwrite and os.path.isdir(output) and os.listdir(output):
        warn(f"{output} exists and is not empty: the real run needs --overwrite")


def warn(message: str) -> None:
    """A :class:`ShardkitWarning` attributed to the first caller outside shardkit.

    A fixed ``stacklevel`` would be wrong for some entry points: the same job runs under
    ``split``, ``convert``, ``save_sharded`` and pipeline splits, at different depths.
    """
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith("shardkit."):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, ShardkitWarning, stacklevel=level)
