"""A split whose OUTPUT ends in ``.safetensors``: one file, written atomically, or a clear refusal.

``split x.bin out.safetensors`` used to create a folder called ``out.safetensors``. A user who
names a file wants a file; that is possible when the plan has one shard, and otherwise the
error says how to get either one file or a folder.
"""

from __future__ import annotations

import os

from ..atomic.commit import file_transaction
from ..errors import InvalidInputError, Option
from ..formats.index import Naming
from ..sources import Source
from ..units import format_size
from .flush import ByteCounter
from .job import ShardJob, SplitResult, plan_job, shard_metadata
from .options import WriteOptions, warn
from .plan import plan_shards
from .writer import write_safetensors

SUFFIX = ".safetensors"


def is_file_output(output: str) -> bool:
    """Whether ``output`` names a single ``.safetensors`` file rather than a folder.

    >>> is_file_output("out.safetensors"), is_file_output("out/")
    (True, False)
    """
    return output.endswith(SUFFIX) and not os.path.isdir(output)


def refuse_file_output(source: object, output: str) -> None:
    """A pipeline folder holds several models; one ``.safetensors`` file cannot hold them."""
    if is_file_output(output):
        raise InvalidInputError(f"{output}: a pipeline folder ({source}) holds several models and is written as "
                                f"a folder; give a folder as OUTPUT, e.g. {output[: -len(SUFFIX)]}/")


def split_to_file(src: Source, output_file: str, *, options: WriteOptions) -> SplitResult:
    """Write every tensor of ``src`` into the one file ``output_file`` (a dry run only plans).

    Args:
        src: the open source.
        output_file: the ``.safetensors`` path to create (replaced only with ``overwrite``).
        options: the write options; the plan must come out as one shard.

    Returns:
        The :class:`SplitResult`; its ``output`` is the file's folder and its plan names the file.

    Raises:
        InvalidInputError: the tensors need more than one shard at ``max_shard_bytes``.

    with open_source("model.bin") as src:
        split_to_file(src, "model.safetensors", options=WriteOptions()).files
    ['/abs/model.safetensors']
    """
    job = plan_job(src, options=options)
    folder, base = os.path.split(os.path.abspath(output_file))
    if len(job.plan.shards) > 1:
        raise InvalidInputError(
            f"{output_file} names one file, but {format_size(job.plan.total_bytes)} of tensors make "
            f"{len(job.plan.shards)} shards at ", Option("max_shard_size", _flag_size(options.max_shard_bytes)),
                                "; give a "
            f"folder as OUTPUT (e.g. {output_file[: -len(SUFFIX)]}/) for shards with an index, or pass ",
            Option("max_shard_size", _flag_size(job.plan.total_bytes)), " or more for one file"
        )
    if options.name is not None or options.variant is not None:
        warn(Option("name"), "/", Option("variant"), f" do not apply when OUTPUT is a file; writing {base}")
    plan = plan_shards([(w.out.name, w.out.nbytes) for w in job.writes], max_shard_bytes=options.max_shard_bytes,
                       naming=Naming(base[: -len(SUFFIX)]))
    job = ShardJob(job.source, job.writes, plan, cast_to=job.cast_to)  # the (de)quantizing view plan_job chose
    result = job.result(folder, options)
    if options.dry_run:
        if os.path.exists(output_file) and not options.overwrite:
            warn(f"{output_file} exists: the real run needs ", Option("overwrite", True))
        return result
    with file_transaction(output_file, overwrite=options.overwrite) as tmp:
        written = write_safetensors(tmp, job.writes, job.source, metadata=shard_metadata(job, options.metadata or {}),
                                    progress=ByteCounter(plan.total_bytes, options.progress))
    job.cloned_bytes = written.cloned_bytes
    return job.result(folder, options)  # after the write: quantization errors are known


def _flag_size(size_bytes: int) -> str:
    """A size to type after a flag, rounded up so that it is enough: ``480B``, ``10274MB``."""
    return f"{size_bytes}B" if size_bytes < 10**6 else f"{-(-size_bytes // 10**6)}MB"

