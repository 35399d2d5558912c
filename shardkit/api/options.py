"""The options of each job, defined once: what ``shardkit.split``/``convert``/``save_sharded`` take
(``options=WriteOptions(...)`` or its keyword shorthands), what ``shardkit.push`` takes
(``PushOptions``), and what the CLI makes its flags from.

Light on purpose: the CLI imports it to build its commands, so it pulls in no stage beyond
``sharding/options.py`` and ``hub/options.py`` (errors and units only).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from ..hub.options import PushOptions
from ..sharding.options import (
    DEFAULT_MAX_SHARD_SIZE,
    ProgressCallback,
    Quantize,
    SaveKeywords,
    WriteKeywords,
    WriteOptions,
    option_keyword,
)

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "ConvertTo", "ProgressCallback", "PushOptions", "Quantize", "SaveKeywords",
           "WriteKeywords", "WriteOptions", "option_keyword", "push_fields", "write_fields"]

ConvertTo = Literal["diffusers", "single-file", "gguf"]  # convert's targets: the Python type and the CLI's --to choices


def write_fields() -> tuple[dataclasses.Field[object], ...]:
    """The :class:`WriteOptions` fields, in the order the CLI's ``--help`` and the docs list them."""
    return dataclasses.fields(WriteOptions)


def push_fields() -> tuple[dataclasses.Field[object], ...]:
    """The :class:`PushOptions` fields, in the order ``shardkit push --help`` lists them."""
    return dataclasses.fields(PushOptions)
