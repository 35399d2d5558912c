"""``verify``: check a checkpoint's structure, read every byte, and optionally compare with a source.

Findings are collected, never raised: a report lists every problem by file and tensor. Only
unusable input (a missing path, something that is not a checkpoint) raises ``ShardkitError``.
"""

from __future__ import annotations

import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..errors import InvalidInputError, Option
from ..formats.header import TensorEntry
from ..formats.manifest import MANIFEST_NAME, ManifestError
from ..sources.base import CheckpointSource, Source
from ..sources.ranged import RangedCheckpoint, beneath, shown
from ..units import FLOAT_DTYPES, ProgressCallback
from .bytescan import ScanResult, TensorComparator, scan_file
from .gguf_verify import is_gguf_checkpoint, verify_gguf_path
from .integrity import Expected, compare_with_manifest, expected_files, manifest_ranges
from .manifest_trust import trusted_entries
from .structure import HeaderRead, Layout, Problem, check_structure, resolve_layout
from .verify_report import FileReport, Finding, VerifyReport

__all__ = ["FileReport", "Finding", "VerifyReport", "verify"]  # the report types are defined in verify_report

_HUB_BLOB_RE = re.compile(r"^[0-9a-f]{64}$")
MAX_SCAN_THREADS = 8


@dataclass
class _ScanJob:
    path: str
    name: str                     # display name relative to the verified path
    entries: list[TensorEntry]
    comparator: TensorComparator | None
    crc_ranges: list[tuple[str, int, int]] | None = None  # a shard's manifest ranges, crc'd in the same read
    crc32s: list[str] | None = None  # their crc32s, once scanned


def verify(path: str | os.PathLike[str] | RangedCheckpoint, *, against: CheckpointSource | None = None,
           progress: ProgressCallback | None = None, read_data: bool = True) -> VerifyReport:
    """Check a checkpoint: structure, every byte (sha256 per file), and optionally every tensor.

    ``path`` is a ``.safetensors`` file, a sharded folder or its index, or a diffusers pipeline
    folder (each weight-bearing component is checked; file names are then ``component/file``).
    ``against`` is any source :func:`shardkit.open_source` accepts (for a pipeline, another
    pipeline folder, a :class:`~shardkit.sources.ranged.RangedCheckpoint` too); every tensor is compared bit for bit, after casting the source the way
    ``split --dtype`` does where the dtypes differ.

    Problems in the checkpoint are collected in the report, never raised. A folder left pending
    by a crashed shardkit write is refused in one line (``shardkit recover`` finishes it): verify
    never writes.

    Args:
        path: the checkpoint to check; a :class:`~shardkit.sources.ranged.RangedCheckpoint` (an
            ``s3://`` checkpoint's header mirror) has its safetensors bytes read by range.
        against: the reference: a path, a state dict or an ``nn.Module``; None checks
            ``path`` alone.
        progress: called as ``progress(bytes_done, bytes_total)`` while files are read (from
            several threads, one call at a time).
        read_data: False checks structure only (index, headers, file sizes; no tensor byte is
            read, no manifest compared): what ``verify hf://...`` runs on a header-only mirror.

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is true when nothing was found.

    Raises:
        SourceNotFoundError: ``path`` does not exist or holds no safetensors checkpoint.
        InvalidInputError: ``path`` is not a safetensors checkpoint, ``against`` cannot be
            opened, or a pipeline folder is checked against something other than a pipeline.

    report = verify("out/", against="model.safetensors")
    report.ok, [str(f) for f in report.findings]
    (True, [])
    """
    from ..atomic.snapshot import wait_settled
    from ..formats.layout import is_pipeline_folder

    ranged = path if isinstance(path, RangedCheckpoint) else None  # a remote checkpoint: its bytes read by range
    path = os.fspath(path)
    wait_settled(path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path)))  # reported, never rolled forward
    against_path = shown(against) if isinstance(against, (str, os.PathLike)) else None
    report = VerifyReport(path, against=against_path if against is not None else None)
    if against is not None and report.against is None:
        report.against = "<in-memory source>"
    if ranged is None and is_gguf_checkpoint(path):  # a GGUF file, a split's first part, a folder of GGUFs
        return _verify_gguf(path, report, against=against, progress=progress, read_data=read_data)
    opened: list[Source] = []
    try:
        pipeline = is_pipeline_folder(path)
        if pipeline:
            jobs = _prepare_pipeline(path, against, report, opened)
        else:
            jobs = _prepare_checkpoint(path, against, report, opened, prefix="", read_scales=read_data)
        report.unhashed = _unhashed(path, pipeline)
        if not read_data:
            return report
        expected = _manifest_entries(path, pipeline, report)
        jobs += _listed_jobs(path, expected, jobs, report)
        for job in jobs:
            record = expected[job.name].record if job.name in expected else None
            if record is not None and record.data_start is not None:
                job.crc_ranges = manifest_ranges(record)
        _run_scans(jobs, report, progress, ranged=ranged)
        _check_manifest(report, expected, {job.name: job.crc32s for job in jobs})
    finally:
        for source in opened:
            source.close()
    return report


def _verify_gguf(path: str, report: VerifyReport, *, against: CheckpointSource | None, progress: ProgressCallback | None,
                 read_data: bool) -> VerifyReport:
    """A GGUF file (a split: every part), or a folder of them: container, model metadata and every value (see
    :mod:`shardkit.checking.gguf_verify`)."""
    if against is not None:
        raise InvalidInputError(f"{path}: ", Option("against"),
                                " compares safetensors checkpoints; convert the GGUF first "
                                "with ", Option("dtype", "fp32"), " and verify that against it")
    check = verify_gguf_path(path, progress=progress, read_data=read_data)  # a split GGUF: every part
    report.findings += [Finding(file, tensor, message) for file, tensor, message in check.findings]
    report.warnings += check.warnings
    report.tensors_checked = check.tensors_checked
    checked = "gguf-values" if check.tensors_checked else "structure"  # values need every part of a split
    report.files += [FileReport(file, nbytes, sha256, checked=checked) for file, nbytes, sha256 in check.files]
    report.bytes_read = sum(nbytes for _, nbytes, _ in check.files)
    return report


def _prepare_pipeline(path: str, against: CheckpointSource | None, report: VerifyReport, opened: list[Source]) -> list[_ScanJob]:
    from ..formats.layout import find_components, is_pipeline_folder

    if against is not None and not (isinstance(against, (str, os.PathLike)) and is_pipeline_folder(os.fspath(against))):
        raise InvalidInputError(f"{path} is a pipeline folder: ", Option("against"), " must be a pipeline folder too "
                                f"(got {against!r}); or verify one component folder against a checkpoint")
    theirs = {c.name: c for c in find_components(against)} if against is not None else {}
    jobs: list[_ScanJob] = []
    for component in find_components(path):
        other = theirs.get(component.name)
        if not component.has_weights:
            if os.path.isfile(os.path.join(component.path, "config.json")):
                report.findings.append(Finding(f"{component.name}/", None, "component has config.json but no weight files"))
            elif other is not None and other.has_weights:
                report.findings.append(Finding(f"{component.name}/", None, f"no weights, but {against} has them"))
            continue
        report.components.append(component.name)
        pickled = _pickled_only(component.path)
        if pickled:  # not safetensors: nothing to check structurally, but hash what is there
            jobs += [_ScanJob(os.path.join(component.path, n), f"{component.name}/{n}", [], None) for n in pickled]
            continue
        if against is not None and (other is None or not other.has_weights):
            report.findings.append(Finding(f"{component.name}/", None, f"component has weights but {against} has none"))
            other = None
        jobs += _prepare_checkpoint(component.path, beneath(against, other.path) if other and against is not None
                                    else None, report, opened, prefix=f"{component.name}/")
    for name, other in theirs.items():
        if other.has_weights and name not in report.components and not os.path.isdir(os.path.join(path, name)):
            report.findings.append(Finding(f"{name}/", None, f"component missing: {against} has it with weights"))
    return jobs


def _prepare_checkpoint(path: str, against: CheckpointSource | None, report: VerifyReport, opened: list[Source], *,
                        prefix: str, read_scales: bool = True) -> list[_ScanJob]:
    """Structural checks of one checkpoint; returns the files still to be read."""
    layout = resolve_layout(path)
    headers = check_structure(layout)
    report.findings += _quantization_findings(path, layout, headers, prefix=prefix,
                                              read_scales=read_scales and layout.all_present and not layout.problems)
    comparator = None
    if against is not None:
        from ..sources import open_source

        source = open_source(against)
        opened.append(source)
        label = shown(against) if isinstance(against, (str, os.PathLike)) else "the source"
        comparator = _compare_entries(layout, headers, source, label)
    for problem in layout.problems:
        report.findings.append(Finding(prefix + problem.file, problem.tensor, problem.message))
    report.tensors_checked += sum(len(r.complete) for r in headers.values() if r.header)  # past a file's end: not checked
    jobs = [_ScanJob(os.path.join(layout.root, name), prefix + name,
                     read.complete if read.header else [], comparator) for name, read in headers.items()]
    if layout.index:
        jobs.append(_ScanJob(os.path.join(layout.root, layout.index), prefix + layout.index, [], None))
    return jobs


def _quantization_findings(path: str, layout: Layout, headers: dict[str, HeaderRead], *, prefix: str,
                           read_scales: bool) -> list[Finding]:
    """Quantized weights whose scales or recipe are missing, misshapen or (read) non-finite."""
    from .scales import scale_problems_of

    reads = [r.header for r in headers.values() if r.header]
    where = layout.index or (layout.files[0] if layout.files else "")
    problems = scale_problems_of(path, layout.root, [e for h in reads for e in h.entries],
                                 reads[0].metadata if reads else {}, where=where, read_scales=read_scales)
    return [Finding(prefix + where, None, line, quantization=True) for line in problems]


def _compare_entries(layout: Layout, headers: dict[str, HeaderRead], source: Source, label: str) -> TensorComparator:
    """Missing/extra tensors and shape/dtype mismatches; the comparator gets the comparable rest."""
    expected = {e.name: e for e in source.entries()}
    groups = {name: [name] for name in expected}
    for alias, kept in source.aliases().items():  # tied tensors: any one of the names may have been kept
        if kept in expected:
            expected.setdefault(alias, expected[kept])
            groups[kept].append(alias)
    actual: dict[str, tuple[str, TensorEntry]] = {}
    for shard, read in headers.items():
        for entry in read.header.entries if read.header else []:
            actual.setdefault(entry.name, (shard, entry))
    where = layout.index or (layout.files[0] if layout.files else "")
    if layout.all_present:  # otherwise the tensors of an unreadable shard are already reported
        for kept, names in groups.items():
            if not any(n in actual for n in names):
                layout.problems.append(Problem(where, kept, f"missing: in {label} but not in this checkpoint"))
    comparable: dict[str, TensorEntry] = {}
    for name, (shard, entry) in actual.items():
        src = expected.get(name)
        if src is None:
            layout.problems.append(Problem(shard, name, f"extra tensor: not in {label}"))
        elif tuple(src.shape) != tuple(entry.shape):
            layout.problems.append(Problem(shard, name, f"shape {list(entry.shape)} but {label} has {list(src.shape)}"))
        elif src.dtype != entry.dtype and not _castable(src.dtype, entry.dtype):
            layout.problems.append(Problem(shard, name, f"dtype {entry.dtype} but {label} has {src.dtype} "
                                           "(not a floating-point cast)"))
        else:
            comparable[name] = src
    return TensorComparator(source, comparable)


def _pickled_only(folder: str) -> list[str]:
    from ..formats.layout import weight_files

    names = weight_files(folder)
    return [] if any(n.endswith(".safetensors") for n in names) else names


def _castable(src: str, out: str) -> bool:
    if src not in FLOAT_DTYPES or out not in FLOAT_DTYPES:
        return False
    try:
        from ..formats.dtypes import to_torch

        to_torch(src), to_torch(out)
    except InvalidInputError:  # a float dtype this torch has no type for
        return False
    return True


def _run_scans(jobs: list[_ScanJob], report: VerifyReport, progress: ProgressCallback | None, *,
               ranged: RangedCheckpoint | None = None) -> None:
    """Read every file (several at once: sha256 is CPU-bound) and record digests and mismatches."""
    total = sum(_size(j.path) for j in jobs)
    done = 0
    lock = threading.Lock()

    def tick(n: int) -> None:
        nonlocal done
        with lock:
            done += n
            if progress is not None:
                progress(done, total)

    def run(job: _ScanJob) -> ScanResult:
        root = job.path[:-len(job.name) - 1] if job.path.endswith(os.sep + job.name) else None
        remote = ranged.open_file(job.path) if ranged is not None and job.path.endswith(".safetensors") else None
        return scan_file(job.path, job.entries, comparator=job.comparator, crc_ranges=job.crc_ranges, tick=tick,
                         root=root, range_file=remote)

    workers = max(1, min(len(jobs), os.cpu_count() or 1, MAX_SCAN_THREADS))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(run, jobs))
    for job, result in zip(jobs, results, strict=True):
        job.crc32s = result.crc32s
        _record(job, result, report)


def _record(job: _ScanJob, result: ScanResult, report: VerifyReport) -> None:
    report.bytes_read += result.bytes_read
    if result.error:
        if job.name not in {f.file for f in report.findings}:  # e.g. a link leaving the folder: reported once
            report.findings.append(Finding(job.name, None, result.error))
        return
    report.files.append(FileReport(job.name, result.bytes_read, result.sha256))
    if os.path.basename(job.name) == MANIFEST_NAME:
        report.files[-1].checked = "manifest"
    for tensor, message in result.mismatches:
        report.findings.append(Finding(job.name, tensor, message))
    report.tensors_compared += result.tensors_compared
    blob = _hub_blob_sha256(job.path)
    if blob == result.sha256:
        report.files[-1].checked = "hub-cache"
    if blob and blob != result.sha256:
        report.findings.append(Finding(job.name, None, f"sha256 {result.sha256} does not match the Hugging Face "
                                       f"cache blob it links to ({blob}): the file is corrupt; re-download it"))


def _manifest_entries(path: str, pipeline: bool, report: VerifyReport) -> dict[str, Expected]:
    """The files the covering manifest(s) list; an unreadable manifest, or a record that disagrees with
    its file's header (checked before any data is read), is a finding."""
    try:
        expected, report.manifests = expected_files(path, pipeline=pipeline)
    except ManifestError as e:
        report.findings.append(Finding(MANIFEST_NAME, None, str(e)))
        return {}
    expected, untrusted = trusted_entries(expected, reported={f.file for f in report.findings})
    report.findings += [Finding(f.file, f.tensor, f.message) for f in untrusted]
    return expected


def _unhashed(path: str, pipeline: bool) -> int:
    """Tensors the covering manifest(s) record as not hashed (``"crc32": null``: copied in an object store)."""
    try:
        expected, _ = expected_files(path, pipeline=pipeline)
    except ManifestError:
        return 0  # reported by the manifest check
    return sum(t.crc32 is None for e in expected.values() for t in e.record.tensors.values())


def _listed_jobs(path: str, expected: dict[str, Expected], jobs: list[_ScanJob],
                 report: VerifyReport) -> list[_ScanJob]:
    """Scans for listed files the structural checks do not read (configs, model_index.json) and for
    the manifests inside the checked folder themselves."""
    have = {job.name for job in jobs}
    extra = [_ScanJob(e.path, name, [], None) for name, e in expected.items()
             if name not in have and os.path.lexists(e.path)]  # a FIFO or folder in its place: a finding
    folder = path if os.path.isdir(path) else os.path.dirname(path) if path.endswith(".json") else None
    if folder is not None:  # a folder or its index: the manifest is one of its files (not for a single file)
        extra += [_ScanJob(os.path.join(folder, m), m, [], None) for m in report.manifests
                  if not m.startswith("..") and m not in have]
    return extra


def _check_manifest(report: VerifyReport, expected: dict[str, Expected], crc32s: dict[str, list[str] | None]) -> None:
    """Compare every listed file with its record; one cause, one line: a file the structural checks
    already reported gets no second finding from the manifest."""
    read = {f.name: f for f in report.files}
    flagged = {f.file for f in report.findings}
    for name, entry in expected.items():
        got = read.get(name)
        if name in flagged or (got is None and os.path.lexists(entry.path)):
            continue  # already reported (or unreadable, which the scan reported)
        found = compare_with_manifest(entry, size_bytes=got.bytes if got else None, sha256=got.sha256 if got else None,
                                      crc32s=crc32s.get(name))
        report.findings += [Finding(f.file, f.tensor, f.message) for f in found]
        if got is not None and not found:
            got.checked = "manifest"
    report.structure_only = [f.name for f in report.files if f.checked == "structure"]


def _hub_blob_sha256(path: str) -> str | None:
    """In the Hugging Face cache, a snapshot file links to a blob named by its sha256 (LFS files)."""
    if not os.path.islink(path):
        return None
    name = os.path.basename(os.path.realpath(path))
    return name if _HUB_BLOB_RE.match(name) else None


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
