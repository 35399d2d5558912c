"""The push options, defined once: what ``shardkit.push`` and ``split_and_push`` take and what
``shardkit push`` makes its flags from (``tests/test_options_drift.py`` checks both).

Light on purpose: the CLI imports it to build its commands, so it pulls in nothing beyond errors,
units and ``sharding/options.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidInputError, Option
from ..sharding.options import option_field
from ..units import ProgressCallback

__all__ = ["REPO_TYPES", "PushOptions"]

REPO_TYPES = ("model", "dataset")


@dataclass(frozen=True)
class PushOptions:
    """How a push publishes: the one definition of the push options (``shardkit.push``, ``split_and_push``
    and ``shardkit push``'s flags all build this).

    Args:
        private: create the repository as private (when it does not exist).
        revision: the branch to push to (created from main if missing), or the base of ``create_pr``.
        create_pr: open a pull request instead of committing to the branch.
        message: the commit message (default: "Upload N file(s) with shardkit").
        path_in_repo: the folder in the repository to upload into (default: its root).
        repo_type: ``"model"`` or ``"dataset"``.
        token: a token with write access (default ``HF_TOKEN`` or the stored login).
        include: globs on the paths inside the pushed folder; only matching files are pushed (a str is one glob).
        exclude: globs on the paths inside the pushed folder; matching files are skipped.
        dry_run: list what would be uploaded and what is already there; change nothing.
        verify: verify the checkpoint first and refuse a broken one.
        allow_lossy: push a quantized checkpoint whose scales or quantization config are unusable.
        follow_symlinks: upload the targets of symlinks leading outside the folder (refused by default).
        progress: ``progress(done_bytes, total_bytes)``, called as each file's upload ends.

    >>> PushOptions(include="unet/*").include
    ('unet/*',)
    """

    private: bool = option_field(False, "Create the repository as private (if it does not exist).")
    revision: str | None = option_field(
        None, ("Branch to push to (created from main if missing), or the base of ", Option("create_pr", True), "."))
    create_pr: bool = option_field(False, "Open a pull request instead of committing to the branch.")
    message: str | None = option_field(None, "Commit message (default: 'Upload N file(s) with shardkit').",
                                       short="-m")
    path_in_repo: str | None = option_field(None, "Folder in the repository to upload into (default: its root).")
    repo_type: str = option_field("model", "The kind of repository.", choices=REPO_TYPES)
    token: str | None = option_field(
        None, "Hugging Face token with write access (default: HF_TOKEN or the stored login).")
    include: tuple[str, ...] | list[str] | str = option_field(
        (), "Only push files whose path inside the folder matches, e.g. 'unet/*' (repeatable).", repeatable="GLOB")
    exclude: tuple[str, ...] | list[str] | str = option_field(
        (), "Skip files whose path inside the folder matches, e.g. '*.bin' (repeatable).", repeatable="GLOB")
    dry_run: bool = option_field(
        False, "List what would be uploaded and what is already there; change nothing. Asks the Hub what it has; "
        "offline, lists every file as an upload.")
    verify: bool = option_field(
        True, ("Verify the checkpoint first and refuse a broken one (", Option("verify", False), " pushes it unverified)."))
    allow_lossy: bool = option_field(
        False, "Push a quantized checkpoint even if a weight's scales or quantization config are unusable.")
    follow_symlinks: bool = option_field(
        False, "Upload the contents of files that are symlinks leading outside the folder (refused by default).")
    progress: ProgressCallback | None = option_field(
        None, "Called as progress(done_bytes, total_bytes) as each file's upload ends.", cli=False)

    def __post_init__(self) -> None:
        for name in ("include", "exclude"):  # one glob, a list or a tuple: kept as a tuple
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value or ()))
        if self.repo_type not in REPO_TYPES:
            raise InvalidInputError(Option("repo_type", self.repo_type), f": expected one of {', '.join(REPO_TYPES)}")
        if self.create_pr and self.revision is not None and self.revision.startswith("refs/pr/"):
            raise InvalidInputError(Option("revision", self.revision), " is a pull request already; push to it "
                                    "without ", Option("create_pr", True))

    def globs(self) -> tuple[list[str] | None, list[str] | None]:
        """``include`` and ``exclude`` as huggingface_hub's filter takes them (None: no filter)."""
        return list(self.include) or None, list(self.exclude) or None
