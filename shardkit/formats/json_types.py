"""Names for JSON documents read from other libraries' files: ``config.json``, ``quantization_config``.

A model's config is whatever its library wrote, key by key: each reader narrows the values it uses
where it uses them (``int(config.get("num_attention_heads") or 16)``, ``isinstance`` checks), so
the values stay ``Any`` — the one boundary every config reader shares, named here once. Documents
shardkit itself builds and reads back (reports, journals, manifests) are typed where they are defined.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeAlias

__all__ = ["Config", "JsonObject"]

# A parsed JSON object read, not changed (config.json, a quantization_config, GGUF metadata as a dict).
Config: TypeAlias = "Mapping[str, Any]"
# A JSON object built or edited (a config written next to converted weights).
JsonObject: TypeAlias = "dict[str, Any]"
