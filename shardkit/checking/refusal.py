"""Refuse a broken checkpoint before it is published: a verification's findings as one error.

A quantized weight whose scales or recipe are unusable is an :class:`~shardkit.errors.InvalidInputError`
(``allow_lossy=True`` lets it through); any other finding a :class:`~shardkit.errors.VerificationError`
carrying the findings.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..errors import InvalidInputError, Option, VerificationError

if TYPE_CHECKING:
    from .verify import VerifyReport

__all__ = ["refuse_broken", "verify_folder"]


def verify_folder(path: str | os.PathLike[str], *, allow_lossy: bool = False) -> VerifyReport:
    """Run ``shardkit.verify`` and refuse a broken checkpoint; returns the report.

    Raises:
        InvalidInputError: a quantized weight's scales or recipe are unusable (unless ``allow_lossy``).
        VerificationError: any other finding.
    """
    from .verify import verify as verify_checkpoint

    report = verify_checkpoint(path)
    refuse_broken(report, os.fspath(path), allow_lossy=allow_lossy)
    return report


def refuse_broken(report: VerifyReport, path: str, *, allow_lossy: bool = False) -> None:
    """Raise for a verification with findings, as :func:`verify_folder` does."""
    quant = [f for f in report.findings if f.quantization]
    if quant and not allow_lossy:
        raise InvalidInputError(f"{path}: refusing to push: {_describe(quant[0])}"
                                f"{f' (and {len(quant) - 1} more)' if len(quant) > 1 else ''}; fix the checkpoint, or "
                                "pass ", Option("allow_lossy", True), " to push it as it is")
    if any(not f.quantization for f in report.findings):
        findings = [_describe(finding) for finding in report.findings if not finding.quantization]
        first = findings[0] if findings else "see `shardkit verify`"
        raise VerificationError(f"{path}: refusing to push, verification found {len(findings)} problem(s), "
                                f"first: {first} (fix the folder, or pass ", Option("verify", False), ")",
                                findings=findings)


def _describe(finding: object) -> str:
    where = ": ".join(str(part) for part in (getattr(finding, "file", None), getattr(finding, "tensor", None)) if part)
    text = getattr(finding, "message", None) or str(finding)
    return f"{where}: {text}" if where else text
