"""What :func:`~shardkit.checking.verify.verify` found: one :class:`VerifyReport` of :class:`Finding` and
:class:`FileReport` records, plain data that the Hub and store checks fill in too."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["FileReport", "Finding", "VerifyReport"]


@dataclass
class Finding:
    """One problem: the file it is in (relative to the checked path), the tensor if any, what is wrong."""

    file: str
    tensor: str | None
    message: str
    quantization: bool = False  # a quantized weight's scales or recipe: ``push --allow-lossy`` sends it anyway

    def __str__(self) -> str:
        where = f"{self.file}: tensor {self.tensor!r}" if self.tensor is not None else self.file
        return f"{where}: {self.message}"


@dataclass
class FileReport:
    """A weight file that was read in full: its name, size in bytes and sha256."""

    name: str
    bytes: int
    sha256: str
    checked: str = "structure"  # "manifest": every byte matches it; "hub-cache": its blob name; "gguf-values": a GGUF
    # whose every value was dequantized and found finite; else structure only


@dataclass
class VerifyReport:
    """The outcome of :func:`verify`. ``ok`` is true when there are no findings.

    Attributes:
        path: the checked path.
        findings: every problem found, as :class:`Finding` records.
        files: the weight and index files read in full, with their sha256.
        tensors_checked: tensors whose headers were validated and whose bytes are all in their file
            (a tensor past a truncated file's end is a finding, not a checked tensor).
        bytes_read: bytes read from disk.
        against: the reference compared with (a path, ``"<in-memory source>"``), or None.
        tensors_compared: tensors compared bit for bit with ``against``.
        components: for a pipeline, the components checked.
        manifests: the shardkit manifests the files were checked against (empty: none found).
        structure_only: files read whose data could only be checked for structure (no manifest
            entry, no Hugging Face cache blob name); a changed tensor in them goes unnoticed
            unless ``against`` is given.
        warnings: what the checkpoint lacks though nothing in it is wrong (a GGUF language model without a
            vocabulary); ``ok`` does not depend on them.
    """

    path: str
    findings: list[Finding] = field(default_factory=list)
    files: list[FileReport] = field(default_factory=list)
    tensors_checked: int = 0
    bytes_read: int = 0
    against: str | None = None
    tensors_compared: int = 0
    components: list[str] = field(default_factory=list)
    manifests: list[str] = field(default_factory=list)
    structure_only: list[str] = field(default_factory=list)
    unhashed: int = 0  # tensors the manifest records without a crc32 (copied inside an object store)
    warnings: list[str] = field(default_factory=list)  # what the checkpoint lacks (a GGUF without vocabulary); ok stays

    @property
    def ok(self) -> bool:
        """True when nothing is wrong."""
        return not self.findings

    def to_dict(self) -> dict[str, object]:
        """Every field, plus ``ok``, as plain JSON-ready data."""
        data = asdict(self)
        return {"path": self.path, "ok": self.ok, **{k: v for k, v in data.items() if k != "path"}}
