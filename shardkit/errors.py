"""The one error hierarchy of shardkit.

Every error derives from :class:`ShardkitError` and also from the builtin a caller would
naturally catch (``ValueError``, ``FileNotFoundError``, ``OSError``). ``exit_code`` is what
the CLI exits with: 2 for bad input or usage, 1 for a check that failed.
"""

from __future__ import annotations

import errno


class ShardkitError(Exception):
    """Base class of every error shardkit raises on purpose."""

    exit_code = 2


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

    def __init__(self, message: str, findings: list[str] | None = None) -> None:
        super().__init__(message)
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

    def __init__(self, message: str, *, min_gpu_bytes: int | None = None, min_cpu_bytes: int | None = None) -> None:
        super().__init__(message)
        self.min_gpu_bytes = min_gpu_bytes
        self.min_cpu_bytes = min_cpu_bytes


class ShardkitWarning(UserWarning):
    """Something worth a user's attention that is not an error (the CLI prints it as one line)."""


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
