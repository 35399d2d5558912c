"""The one error hierarchy of shardkit.

Every error derives from :class:`ShardkitError` and also from the builtin a caller would
naturally catch (``ValueError``, ``FileNotFoundError``, ``OSError``). ``exit_code`` is what
the CLI exits with: 2 for bad input or usage, 1 for a check that failed.

A message is a sequence of parts: plain text, and :class:`Option` for each option it names
(``overwrite=True``). ``str(error)`` is the Python text; ``error.parts`` keeps the structure, so the
CLI writes each option as the flag a user of the command line types (``--overwrite``), without
guessing from the text.
"""

from __future__ import annotations

import errno
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeAlias


@dataclass(frozen=True)
class Option:
    """An option a message names, written as its Python parameter.

    ``value`` is what the message suggests (Ellipsis: the parameter alone, ``config=...``);
    ``choices`` are the other values it offers.

    >>> str(Option("overwrite", True)), str(Option("config")), str(Option("to", "gguf"))
    ('overwrite=True', 'config=...', "to='gguf'")
    >>> str(Option("dtype", "bf16", choices=("fp16", "fp32")))
    "dtype='bf16', 'fp16' or 'fp32'"
    """

    name: str
    value: object = ...
    choices: tuple[str, ...] = ()

    def __str__(self) -> str:
        text = f"{self.name}=..." if self.value is ... else f"{self.name}={self.value!r}"
        return with_choices(text, [repr(choice) for choice in self.choices])


def with_choices(first: str, others: list[str]) -> str:
    """``first`` followed by the other choices a message offers, in both forms of an :class:`Option`.

    >>> with_choices("dtype='bf16'", ["'fp16'", "'fp32'"]), with_choices("--to gguf", [])
    ("dtype='bf16', 'fp16' or 'fp32'", '--to gguf')
    """
    return f"{', '.join([first, *others[:-1]])} or {others[-1]}" if others else first


Part: TypeAlias = str | Option


def join_parts(parts: Iterable[Part]) -> str:
    """The Python text of a message's parts.

    >>> join_parts(["out/ is not empty; pass ", Option("overwrite", True)])
    'out/ is not empty; pass overwrite=True'
    """
    return "".join(map(str, parts))


def parts_of(error: BaseException) -> tuple[Part, ...]:
    """The parts of an error's message (another library's error: its text), for a message that wraps it.

    >>> parts_of(InvalidInputError("pass ", Option("overwrite", True))), parts_of(KeyError("w"))
    (('pass ', Option(name='overwrite', value=True, choices=())), ("'w'",))
    """
    parts = getattr(error, "parts", None)
    return tuple(parts) if isinstance(parts, tuple) else (str(error),)


class ShardkitError(Exception):
    """Base class of every error shardkit raises on purpose.

    Made from message parts (:class:`Option` for each option named): ``str(error)`` is their Python
    text, also the one element of ``args``; ``parts`` keeps them.
    """

    exit_code = 2

    def __init__(self, *parts: Part) -> None:
        super().__init__(join_parts(parts))
        self.parts: tuple[Part, ...] = parts


class InvalidInputError(ShardkitError, ValueError):
    """The input (a file, an option, a state dict) is not usable as given."""


class InvalidSizeError(InvalidInputError):
    """A size string such as ``"5XB"`` could not be parsed."""


class HeaderError(InvalidInputError):
    """A safetensors header is malformed, inconsistent or unsafe."""


class CheckpointIndexError(InvalidInputError):
    """An index JSON file is malformed, inconsistent or names unsafe paths."""


class UnsafePickleError(InvalidInputError):
    """A pickle holds objects other than tensors, or would execute code."""


class KeyMismatchError(InvalidInputError):
    """Checkpoint keys or shapes do not match the model they are loaded into."""


class SourceNotFoundError(ShardkitError, FileNotFoundError):
    """The source path does not exist or holds no checkpoint."""


class OutputExistsError(ShardkitError, FileExistsError):
    """The output exists and is not empty; pass ``overwrite=True`` to replace it."""


class ShardkitWriteError(ShardkitError, OSError):
    """Writing the output failed (disk full, file too large, I/O error)."""


class VerificationError(ShardkitError):
    """A check found problems; ``findings`` lists them."""

    exit_code = 1

    def __init__(self, *parts: Part, findings: list[str] | None = None) -> None:
        super().__init__(*parts)
        self.findings = list(findings or [])


class HubError(ShardkitError):
    """Talking to the Hugging Face Hub failed."""


class StoreError(ShardkitError, OSError):
    """Talking to an object store (``s3://``) failed: refused credentials, no access, a failed request."""


class CopyRefusedError(StoreError):
    """The store does not copy byte ranges between objects (``UploadPartCopy``): stream the bytes instead."""


class OffloadError(ShardkitError, ValueError):
    """An offload strategy cannot be applied to this object in its current state."""


class JournalError(CheckpointIndexError):
    """A ``.shardkit-journal.json`` that is not shardkit's own: recovery stops and changes nothing."""


class UntrustedFileError(InvalidInputError):
    """A file from a checkpoint folder that shardkit refuses: it leaves the folder, is not a regular
    file, is over its byte cap, or does not parse (one line naming the file)."""


class OutsideFolderError(UntrustedFileError):
    """A path that leaves its folder, or is not a regular file: refused before it is opened."""


class ManifestError(InvalidInputError):
    """A manifest file exists but cannot be read or is not a shardkit manifest."""


class DistributedError(ShardkitWriteError):
    """Another rank failed (or disagreed) during a collective job; nothing was published."""


class FitError(InvalidInputError):
    """No candidate setup fits the memory budget; says the smallest budget that would."""

    def __init__(self, *parts: Part, min_gpu_bytes: int | None = None, min_cpu_bytes: int | None = None) -> None:
        super().__init__(*parts)
        self.min_gpu_bytes = min_gpu_bytes
        self.min_cpu_bytes = min_cpu_bytes


class ShardkitWarning(UserWarning):
    """Something worth a user's attention that is not an error (the CLI prints it as one line).

    Made from message parts like :class:`ShardkitError`: ``warnings.warn(ShardkitWarning(...))``.
    """

    def __init__(self, *parts: Part) -> None:
        super().__init__(join_parts(parts))
        self.parts: tuple[Part, ...] = parts


_WRITE_ERRORS = {
    errno.ENOSPC: "no space left on the device",
    errno.EFBIG: "file too large for this filesystem or process limit",
    errno.EIO: "I/O error",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only filesystem",
    errno.EACCES: "permission denied",
}


def describe_os_error(e: OSError) -> str:
    """A short reason for a failed write.

    Args:
        e: the ``OSError`` a write, fsync or rename raised.

    Returns:
        ``"no space left on the device"``, ``"I/O error"``... or the OS's own message.

    >>> describe_os_error(OSError(28, "No space left on device"))
    'no space left on the device'
    """
    return _WRITE_ERRORS.get(e.errno or 0, e.strerror or str(e))


def first_line(error: BaseException | str, *, limit: int = 200) -> str:
    """The first non-empty line of an error's message, cut to ``limit`` characters (an exception with
    no message gives its type's name): how another library's error is quoted in a one-line message.

    >>> first_line(KeyError("down_blocks.0.weight"))
    "'down_blocks.0.weight'"
    >>> first_line(ValueError("\\nbad shape\\nat layer 3"))
    'bad shape'
    >>> first_line(RuntimeError()), first_line("x" * 300, limit=5)
    ('RuntimeError', 'xxxxx')
    """
    text = str(error).strip()
    if not text:
        return type(error).__name__ if isinstance(error, BaseException) else ""
    return text.splitlines()[0][:limit]
