"""The records and constants the CLI prints with, re-exported from the stages that define them (light imports only)."""

from __future__ import annotations

from ..atomic.journal import Recovery
from ..devices import device_label
from ..formats.manifest import MANIFEST_NAME

__all__ = ["MANIFEST_NAME", "Recovery", "device_label"]
