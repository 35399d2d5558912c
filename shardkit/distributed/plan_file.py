"""A conversion as a file: one task per output shard and one finalize task (``--write-plan PLAN.json``).

The document is made from the job the writer would run (:func:`~shardkit.sharding.job.plan_job`:
the same :class:`~shardkit.sharding.plan.ShardPlan`, the same casts) and the job's own
:class:`~shardkit.sharding.options.WriteOptions`, serialized field by field. It is deterministic
(sorted keys, no times, no pids: the same inputs and options give the same bytes), readable
(``--dry-run`` prints :func:`summary`) and carries the source's identity (each file's size and
mtime; an ``s3://`` object's size and ETag), so a task run against a changed source refuses in one line. Any engine runs it
(:mod:`shardkit.distributed.plan_run`): a task is an index, nothing else.

A plan file is untrusted input when it is read back (:func:`parse_plan`): it is bounded in size
and task count, every output name is a plain name inside the output folder, and a task checks
the plan against the job it rebuilds from the source before it writes a byte.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import InvalidInputError, Option, Part, parts_of
from ..formats.header import build_header
from ..formats.links import OutsideFolderError, check_name, parse_json
from ..sharding.job import ShardJob, shard_metadata
from ..sharding.options import WriteOptions
from ..sharding.writer import TensorWrite, clone_alignment
from ..sources.keymap import KeyMap
from ..units import format_size

__all__ = ["FORMAT", "GGUF_VERSION", "MAX_PLAN_BYTES", "MAX_TASKS", "PLAN_OPTION_FIELDS", "ConversionPlan", "PlanSpec", "ShardTask",
           "SourceFile", "build_plan", "dump_plan", "keymap_from_json", "options_from_json", "parse_plan",
           "same_path", "shard_tasks", "source_identity", "summary"]

FORMAT = "shardkit.plan"
VERSION = 1
GGUF_VERSION = 2  # a plan with to="gguf": refused by a shardkit that would write it as safetensors
MAX_PLAN_BYTES = 256 * 2**20  # a plan of 100,000 shards with their read ranges stays far below
MAX_TASKS = 100_000
MAX_READS = 10_000_000
# The WriteOptions a plan carries: every field but the callbacks and the dry run (a plan is run for real).
PLAN_OPTION_FIELDS = ("max_shard_bytes", "dtype", "allow_lossy", "quantize", "name", "variant", "overwrite",
                      "manifest", "metadata")
Read = tuple[str, int, int]  # (source file, absolute begin, absolute end)


@dataclass(frozen=True)
class SourceFile:
    """One file the plan reads, as it was when planned: a task refuses when it is not so any more.

    A local file is known by its size and mtime, an object in a store (``path`` its ``s3://`` URL)
    by its size and entity tag (``etag``; ``mtime_ns`` 0).
    """

    path: str
    size_bytes: int
    mtime_ns: int
    etag: str = ""


@dataclass(frozen=True)
class ShardTask:
    """One output shard: what it reads, what it casts, what it writes (``size_bytes`` exactly)."""

    index: int
    output: str
    size_bytes: int
    tensors: int
    reads: tuple[Read, ...]
    casts: tuple[tuple[str, int], ...]  # ("F32->BF16", tensor count), sorted
    header_crc32: str | None = None  # known up front where the plan holds the header (a GGUF part's)


@dataclass(frozen=True)
class PlanSpec:
    """The job a plan describes: the command, its source and output, and the options of the call."""

    command: str  # "split" or "convert"
    source: str
    output: str
    options: WriteOptions
    key: str | None = None
    keymap: KeyMap = dataclasses.field(default_factory=KeyMap)
    lora: tuple[str, ...] = ()  # local LoRA adapters merged into the source, in order (convert only)
    lora_scale: float = 1.0
    to: str | None = None  # "gguf": the output is a .gguf file (or gguf-split's parts), one task per file


@dataclass(frozen=True)
class ConversionPlan:
    """A parsed or built plan. ``finalize`` names what the last task publishes."""

    spec: PlanSpec
    sources: tuple[SourceFile, ...]
    tasks: tuple[ShardTask, ...]
    index: str | None
    side_files: tuple[str, ...]
    total_bytes: int

    @property
    def plan_id(self) -> str:
        """A short digest of the plan's bytes: names its work folder, so two plans never share one."""
        return hashlib.sha256(dump_plan(self)).hexdigest()[:16]


def options_to_json(options: WriteOptions) -> dict[str, object]:
    """The plan's copy of the job's :class:`WriteOptions` (:data:`PLAN_OPTION_FIELDS`)."""
    doc: dict[str, object] = {name: getattr(options, name) for name in PLAN_OPTION_FIELDS}
    doc["dtype"] = None if options.dtype is None else str(options.dtype).removeprefix("torch.")
    doc["metadata"] = dict(sorted((options.metadata or {}).items())) or None
    return doc


def options_from_json(doc: object, *, where: str) -> WriteOptions:
    """The :class:`WriteOptions` of a plan file, validated as the options of any call are."""
    if not isinstance(doc, dict) or set(doc) != set(PLAN_OPTION_FIELDS):
        raise _bad(where, f"options must name exactly {', '.join(PLAN_OPTION_FIELDS)}")
    metadata = doc["metadata"]
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise _bad(where, "options.metadata must map strings to strings")
    try:
        return WriteOptions(**doc)
    except (TypeError, InvalidInputError) as e:
        raise _bad(where, "options: ", *parts_of(e)) from e


def keymap_from_json(doc: object, *, where: str) -> KeyMap:
    fields = {"include", "exclude", "strip_prefix", "add_prefix", "rename"}
    if not isinstance(doc, dict) or set(doc) != fields:
        raise _bad(where, f"keymap must name exactly {', '.join(sorted(fields))}")
    lists = [doc["include"], doc["exclude"], *doc["rename"]] if isinstance(doc["rename"], list) else [None]
    if not all(isinstance(x, list) and all(isinstance(s, str) for s in x) for x in lists) \
            or not all(len(pair) == 2 for pair in doc["rename"]) \
            or not all(v is None or isinstance(v, str) for v in (doc["strip_prefix"], doc["add_prefix"])):
        raise _bad(where, "keymap entries must be lists of strings, renames [OLD, NEW] pairs")
    return KeyMap(tuple(doc["include"]), tuple(doc["exclude"]), doc["strip_prefix"], doc["add_prefix"],
                  tuple((a, b) for a, b in doc["rename"]))


def same_path(path: str) -> str:
    return path


def shard_tasks(job: ShardJob, options: WriteOptions, *, name_of: Callable[[str], str] = same_path,
                ) -> tuple[ShardTask, ...]:
    """One :class:`ShardTask` per shard of ``job``: its reads coalesced per file, its exact file size.

    ``name_of``: a file the readers open → its name in the plan (a store's URL for its local mirror's path).
    """
    by_name = {w.out.name: w for w in job.writes}
    metadata = shard_metadata(job, options.metadata or {})
    tasks = []
    for i, shard in enumerate(job.plan.shards):
        writes = [by_name[n] for n in shard.names]
        head, _ = build_header([w.out for w in writes], metadata=dict(sorted(metadata.items())),
                               data_start_mod=clone_alignment(writes))
        casts: dict[str, int] = {}
        for w in writes:  # a tensor a source view computes (fp8 dequantized with its scales) has no file range
            kind = f"{w.src.dtype}->{w.out.dtype}" if w.src.file else f"computed->{w.out.dtype}"
            if w.src.dtype != w.out.dtype or not w.src.file:
                casts[kind] = casts.get(kind, 0) + 1
        tasks.append(ShardTask(i, job.path(shard.filename), len(head) + sum(w.out.nbytes for w in writes),
                               len(writes), _reads(writes, name_of), tuple(sorted(casts.items()))))
    return tuple(tasks)


def _reads(writes: Sequence[TensorWrite], name_of: Callable[[str], str]) -> tuple[Read, ...]:
    """The source byte ranges a shard reads, adjacent ones coalesced (a split reads one range)."""
    reads: list[Read] = []
    for w in writes:
        if not w.src.file:
            continue  # computed: counted in the task's casts; its files are in the plan's source_files
        file, begin = name_of(w.src.file), w.src.offset
        if reads and reads[-1][0] == file and reads[-1][2] == begin:
            reads[-1] = (file, reads[-1][1], begin + w.src.nbytes)
        else:
            reads.append((file, begin, begin + w.src.nbytes))
    return tuple(reads)


def source_identity(paths: Sequence[str]) -> tuple[SourceFile, ...]:
    """Each path's size and mtime (sorted by path): what a task compares before it reads."""
    out = []
    for path in sorted(set(paths)):
        st = os.stat(path)
        out.append(SourceFile(path, st.st_size, st.st_mtime_ns))
    return tuple(out)


Identity = Callable[[Sequence[str]], tuple[SourceFile, ...]]  # plan names → each one's identity now, sorted


def build_plan(spec: PlanSpec, job: ShardJob, *, side_files: Sequence[str], side_paths: Sequence[str],
               name_of: Callable[[str], str] = same_path, identity: Identity = source_identity,
               local_files: Sequence[str] = ()) -> ConversionPlan:
    """The plan of ``job`` (planned from ``spec``'s source with ``spec.options``); ``name_of`` and
    ``identity`` as the source was opened (local files: the paths and their size and mtime).
    ``local_files``: local files read besides the source (LoRA adapters), known by size and mtime."""
    files = [e.file for e in job.source.entries() if e.file] + list(job.source.paths) + list(side_paths)
    read = {name_of(f) for f in files if f not in local_files}
    known = sorted(identity(sorted(read)) + source_identity(local_files), key=lambda f: f.path)
    return ConversionPlan(spec, tuple(known), shard_tasks(job, spec.options, name_of=name_of),
                          job.path(job.plan.index_filename) if job.plan.index_filename else None,
                          tuple(sorted(side_files)), job.plan.total_bytes)


def dump_plan(plan: ConversionPlan) -> bytes:
    """The plan's bytes: sorted keys, one task per line; equal plans give equal bytes."""
    spec = plan.spec
    km = spec.keymap
    head = {
        "format": FORMAT, "version": GGUF_VERSION if spec.to else VERSION, "command": spec.command, "source": spec.source, "output": spec.output,
        "key": spec.key, "options": options_to_json(spec.options),
        "keymap": {"include": list(km.include), "exclude": list(km.exclude), "strip_prefix": km.strip_prefix,
                   "add_prefix": km.add_prefix, "rename": [list(p) for p in km.rename]},
        "source_files": [[s.path, s.size_bytes, s.etag or s.mtime_ns] for s in plan.sources],
        "finalize": {"index": plan.index, "side_files": list(plan.side_files), "total_bytes": plan.total_bytes},
    }
    if spec.lora:  # only then: a plan without adapters keeps the bytes it always had
        head["lora"] = {"adapters": list(spec.lora), "scale": spec.lora_scale}
    if spec.to:  # likewise: only a GGUF plan (version 2) has it
        head["to"] = spec.to
    lines = [json.dumps({"task": t.index, "output": t.output, "size_bytes": t.size_bytes, "tensors": t.tensors,
                         "reads": [list(r) for r in t.reads], "casts": dict(t.casts)}
                        | ({"header_crc32": t.header_crc32} if t.header_crc32 is not None else {}),
                        sort_keys=True, separators=(",", ":")) for t in plan.tasks]
    text = json.dumps(head, sort_keys=True, indent=1)[:-2]
    return (text + ',\n "tasks": [\n  ' + ",\n  ".join(lines) + "\n ]\n}\n").encode()


def parse_plan(data: bytes, *, path: str) -> ConversionPlan:
    """A plan file's bytes, checked: its format and version, bounded counts, names inside the output."""
    if len(data) > MAX_PLAN_BYTES:
        raise _bad(path, f"larger than {format_size(MAX_PLAN_BYTES)}")
    doc = parse_json(data, path=path, what="shardkit plan")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise _bad(path, f"not a {FORMAT} file")
    if doc.get("version") not in (VERSION, GGUF_VERSION) or (doc.get("version") == GGUF_VERSION) != ("to" in doc):
        raise _bad(path, f"version {doc.get('version')!r} is not {VERSION} (or {GGUF_VERSION} with to): written by "
                         "another shardkit? re-plan it")
    try:
        return _parse(doc, path)
    except InvalidInputError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise _bad(path, f"malformed ({type(e).__name__}: {str(e)[:120]})") from e


def _parse(doc: dict[str, object], path: str) -> ConversionPlan:
    command, source, output, key = doc["command"], doc["source"], doc["output"], doc["key"]
    if command not in ("split", "convert") or not isinstance(source, str) or not isinstance(output, str) \
            or not (key is None or isinstance(key, str)):
        raise _bad(path, "command must be split or convert, source and output strings")
    to = doc.get("to")
    if to not in (None, "gguf"):
        raise _bad(path, Option("to", to), ": a plan writes safetensors, or ", Option("to", "gguf"))
    spec = PlanSpec(command, source, output, options_from_json(doc["options"], where=path), key,
                    keymap_from_json(doc["keymap"], where=path), *_lora(doc.get("lora"), path), to=to)
    raw_tasks, raw_sources, fin = doc["tasks"], doc["source_files"], doc["finalize"]
    if not isinstance(raw_tasks, list) or not isinstance(raw_sources, list) or not isinstance(fin, dict):
        raise _bad(path, "tasks and source_files must be lists, finalize an object")
    if not 0 < len(raw_tasks) <= MAX_TASKS or len(raw_sources) > MAX_TASKS:
        raise _bad(path, f"it must hold 1 to {MAX_TASKS} tasks")
    sources = tuple(_source_file(p, n, m) for p, n, m in raw_sources)
    tasks = tuple(_task(t, i, path) for i, t in enumerate(raw_tasks))
    if sum(len(t.reads) for t in tasks) > MAX_READS:
        raise _bad(path, f"more than {MAX_READS} read ranges")
    index, side = fin["index"], fin["side_files"]
    names = [t.output for t in tasks] + ([index] if index is not None else []) + list(side)
    for name in names:
        _check_output_name(name, path)
    if len(set(names)) != len(names):
        raise _bad(path, "two tasks or files write the same output name")
    return ConversionPlan(spec, sources, tasks, index, tuple(side), _count(fin["total_bytes"]))


def _lora(doc: object, path: str) -> tuple[tuple[str, ...], float]:
    """The plan's ``lora`` entry: ``{"adapters": [PATH, ...], "scale": X}``, or none."""
    if doc is None:
        return (), 1.0
    if not isinstance(doc, dict) or set(doc) != {"adapters", "scale"} or not isinstance(doc["adapters"], list) \
            or not doc["adapters"] or len(doc["adapters"]) > 64 or not all(isinstance(a, str) for a in doc["adapters"]) \
            or isinstance(doc["scale"], bool) or not isinstance(doc["scale"], (int, float)):
        raise _bad(path, "lora must be {\"adapters\": [1 to 64 paths], \"scale\": a number}")
    return tuple(doc["adapters"]), float(doc["scale"])


def _source_file(path: object, size_bytes: object, version: object) -> SourceFile:
    """``[path, size, mtime]`` of a local file, ``[url, size, "etag"]`` of an object in a store."""
    if isinstance(version, str):
        return SourceFile(str(path), _count(size_bytes), 0, version)
    return SourceFile(str(path), _count(size_bytes), _count(version))


def _task(doc: object, i: int, path: str) -> ShardTask:
    if not isinstance(doc, dict) or doc["task"] != i:
        raise _bad(path, f"task {i} is out of order")
    reads = tuple((str(f), _count(b), _count(e)) for f, b, e in doc["reads"])
    casts = tuple(sorted((str(k), _count(v)) for k, v in doc["casts"].items()))
    crc = doc.get("header_crc32")
    if crc is not None and not (isinstance(crc, str) and len(crc) == 8 and all(c in "0123456789abcdef" for c in crc)):
        raise ValueError(f"header_crc32 {crc!r} is not 8 hex digits")
    return ShardTask(i, str(doc["output"]), _count(doc["size_bytes"]), _count(doc["tensors"]), reads, casts,
                     None if crc is None else str(crc))


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a byte count")
    return value


def _check_output_name(name: object, path: str) -> None:
    try:
        parts = check_name(name, where=path)
    except OutsideFolderError as e:
        raise _bad(path, f"output name {name!r} leaves the output folder") from e
    if len(parts) > 8 or parts[-1].startswith("."):
        raise _bad(path, f"output name {name!r} is not a plain file name of the output")


def _bad(path: str, *why: Part) -> InvalidInputError:
    return InvalidInputError(f"{path}: not a usable shardkit plan (", *why, "); write it again with ",
                             Option("write_plan"))


def summary(plan: ConversionPlan) -> list[str]:
    """The lines ``--dry-run`` prints: the job, every task in one line, then finalize."""
    spec = plan.spec
    casts: dict[str, int] = {}
    for t in plan.tasks:
        for k, v in t.casts:
            casts[k] = casts.get(k, 0) + v
    lines = [f"plan {plan.plan_id}: {spec.command} {spec.source} -> {spec.output}",
             f"  {len(plan.tasks)} shard task(s), {format_size(plan.total_bytes)} of tensors, "
             f"{len(plan.sources)} source file(s)" + (f", casts {dict(sorted(casts.items()))}" if casts else "")]
    shown = plan.tasks if len(plan.tasks) <= 12 else plan.tasks[:6] + plan.tasks[-6:]
    for t in shown:
        if t.index == 6 and len(plan.tasks) > 12:
            lines.append(f"  ... {len(plan.tasks) - 12} more task(s)")
        lines.append(f"  task {t.index}: {t.output} {format_size(t.size_bytes)} ({t.tensors} tensors, "
                     f"{len(t.reads)} read range(s))")
    if spec.to == "gguf":
        lines.append(f"  finalize: publish {len(plan.tasks)} .gguf file(s) (each checked: size, header crc32)"
                     + (", the first one last" if len(plan.tasks) > 1 else ""))
        return lines
    lines.append(f"  finalize: {plan.index or 'no index (one file)'}"
                 f"{', manifest' if spec.options.manifest else ''}, {len(plan.side_files)} side file(s)")
    return lines
