"""What every command shares: error mapping, progress bars, JSON output, option types and options."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import Field
from types import FrameType
from typing import TYPE_CHECKING, Any, TextIO

import click

from ..errors import Part, ShardkitError

# A click command function, and what an option decorator does to one.
Command = Callable[..., object]
Decorator = Callable[[Command], Command]


def _debug_requested(argv: list[str]) -> bool:
    return "--debug" in argv


def configure_logging(*, debug: bool) -> None:
    """The CLI is the application, so it (and only it) sets logging up.

    shardkit's own logger goes to stderr (INFO, DEBUG with ``--debug``); the libraries shardkit
    drives are quieted to errors, since their warnings (accelerate on GPUs a plan names but this
    machine lacks, diffusers on experimental APIs) and huggingface_hub's own progress bars would
    interleave with ours.
    """
    log = logging.getLogger("shardkit")
    if not any(isinstance(h, _StderrHandler) for h in log.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.DEBUG if debug else logging.WARNING)
    if debug:
        return
    # diffusers and transformers reset their loggers' level from these on first use.
    for variable in ("DIFFUSERS_VERBOSITY", "TRANSFORMERS_VERBOSITY", "HF_HUB_VERBOSITY"):
        os.environ.setdefault(variable, "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for name in ("accelerate", "diffusers", "transformers", "huggingface_hub"):
        logging.getLogger(name).setLevel(logging.ERROR)
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils.tqdm import disable_progress_bars

        disable_progress_bars()


if TYPE_CHECKING:  # generic to type checkers; not subscriptable at run time on every supported version
    _Handler = logging.StreamHandler[TextIO]
    _SizeType = click.ParamType[int]
    StrParamType = click.ParamType[str]
else:
    _Handler = logging.StreamHandler
    _SizeType = click.ParamType
    StrParamType = click.ParamType


class _StderrHandler(_Handler):
    """Writes to whatever ``sys.stderr`` is at emit time (click's test runner swaps it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass


GLOBAL_FLAGS = ("--debug", "--progress")


def hoist_global_flags(args: list[str]) -> list[str]:
    """Move ``--debug``/``--progress`` before the command, wherever the user typed them.

    Errors tell users to add ``--debug``; they add it at the end, where click alone would refuse it.

    >>> hoist_global_flags(["split", "a", "b", "--debug"])
    ['--debug', 'split', 'a', 'b']
    """
    cut = args.index("--") if "--" in args else len(args)
    flags = [a for a in GLOBAL_FLAGS if a in args[:cut]]
    return flags + [a for i, a in enumerate(args) if i >= cut or a not in GLOBAL_FLAGS]


def run_cli(group: click.Group, argv: list[str] | None = None) -> int:
    """Run the click group; map errors to one line and an exit code (2 input, 1 check failed)."""
    args = hoist_global_flags(list(sys.argv[1:] if argv is None else argv))
    debug = _debug_requested(args)
    configure_logging(debug=debug)
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    if not args:  # bare `shardkit`: the help, as a help (click would fold it into one error line)
        click.echo(group.get_help(click.Context(group, info_name="shardkit")))
        return 0
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.showwarning = _show_warning
        try:
            group.main(args=args, prog_name="shardkit", standalone_mode=False)
        except BrokenPipeError:  # `shardkit info out/ | head -1`: the reader left; not an error
            silence_stdout()
        except SystemExit as e:  # click's own EPIPE handling exits 1 after pacifying stdout
            if not type(sys.stdout).__name__.endswith("PacifyFlushWrapper"):
                raise
            silence_stdout()
            return 0 if e.code in (0, 1, None) else int(e.code)
        except (click.exceptions.Abort, KeyboardInterrupt):
            click.echo("interrupted; nothing was published", err=True)
            return 130
        except click.ClickException as e:
            _echo_click_error(e)
            return 2 if e.exit_code not in (0, 1) else e.exit_code
        except click.exceptions.Exit as e:
            return e.exit_code
        except (ShardkitError, OSError, ValueError, RuntimeError, ArithmeticError, MemoryError) as e:
            # shardkit's errors, a file it did not expect to fail on, and the failures of the libraries it
            # drives (torch's RuntimeError, parsers' ValueError)
            return _report_error(e, debug=debug)
        except Exception as e:  # a bug: still one line for the user, the traceback with --debug
            if debug:
                raise
            click.echo(f"error: internal error {type(e).__name__}: {e} (a bug in shardkit: run with --debug for the "
                       "traceback and report it)", err=True)
            return 2
    return 0


def _report_error(e: Exception, *, debug: bool) -> int:
    if debug:
        traceback.print_exc()
    if isinstance(e, ShardkitError):
        from .flags import message_words

        click.echo(f"error: {message_words(e)}", err=True)
        return e.exit_code
    if isinstance(e, OSError) and e.filename:
        # A file the library did not expect to fail on (unreadable, vanished, read-only): name it.
        from ..errors import describe_os_error

        click.echo(f"error: {e.filename}: {describe_os_error(e)} (run with --debug for the traceback)", err=True)
        return 2
    # An unexpected library error: still one line unless --debug.
    click.echo(f"error: {type(e).__name__}: {e} (run with --debug for the traceback)", err=True)
    return 2


def silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush cannot fail on a closed pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # not a real file (click's test runner)
        pass


def _echo_click_error(e: click.ClickException) -> None:
    """Usage errors as one line (click's default is a usage block plus the message)."""
    message = " ".join(e.format_message().split())
    ctx = getattr(e, "ctx", None)
    hint = f" (see '{ctx.command_path} --help')" if isinstance(e, click.UsageError) and ctx is not None else ""
    click.echo(f"error: {message}{hint}", err=True)


def _raise_keyboard_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: TextIO | None = None, line: str | None = None) -> None:
    from ..errors import ShardkitWarning

    if issubclass(category, ShardkitWarning):
        from .flags import message_words

        click.echo(f"warning: {message_words(message)}", err=True)


def _progress_requested() -> bool:
    """Whether ``shardkit --progress`` was given (the group stores its flags in the root context)."""
    ctx = click.get_current_context(silent=True)
    return bool(ctx is not None and (ctx.find_root().obj or {}).get("progress"))


@contextlib.contextmanager
def byte_progress(description: str, *, enabled: bool) -> Iterator[Callable[[int, int], None]]:
    """A ``(done_bytes, total_bytes)`` callback rendered as a tqdm bar on stderr.

    Only on a terminal (or with ``shardkit --progress``): a bar's ``\\r`` frames would litter logs.
    """
    if not enabled or not (_progress_requested() or sys.stderr.isatty()):
        yield lambda done, total: None
        return
    from tqdm import tqdm

    bar = None
    last = 0

    def update(done: int, total: int) -> None:
        nonlocal bar, last
        if bar is None:
            bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=description,
                       file=sys.stderr, dynamic_ncols=True, leave=False)
        bar.update(done - last)
        last = done

    try:
        yield update
    finally:
        if bar is not None:
            bar.close()


def echo_json(data: object) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False))


class SizeParam(_SizeType):
    """A size option: '5GB' (10⁹), '2GiB' (2³⁰), '500MB', or bytes."""

    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        from ..units import parse_size

        try:
            size_bytes = parse_size(value, name="size")
        except ShardkitError as e:
            from .flags import message_words

            self.fail(message_words(e), param, ctx)
        _warn_bare_number(value, size_bytes, param)
        return size_bytes


BARE_NUMBER_WARN_BYTES = 10**6


def _warn_bare_number(value: object, size_bytes: int, param: click.Parameter | None) -> None:
    """A bare number is a byte count; ``--max-shard-size 5000`` almost always meant 5000MB."""
    if isinstance(value, str) and value.strip().isdigit() and size_bytes < BARE_NUMBER_WARN_BYTES:
        flag = param.opts[0] if param is not None and getattr(param, "opts", None) else "size"
        click.echo(f"warning: {flag} {value.strip()} has no unit and means {size_bytes} bytes; "
                   f"write a unit if you meant more, e.g. {flag} {value.strip()}MB", err=True)


SIZE = SizeParam()


class LibraryWordsOption(click.Option):
    """An option whose help comes from the library (a :class:`WriteOptions` field): the options its help
    names (its ``help_parts``) are shown as flags, like the library's error messages
    (:func:`~shardkit.cli.flags.cli_words`)."""

    def __init__(self, param_decls: Sequence[str] | None = None, *, help_parts: tuple[Part, ...] = (),
                 **attrs: Any) -> None:
        super().__init__(param_decls, **attrs)
        self.help_parts = help_parts

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        from .flags import cli_words

        record = super().get_help_record(ctx)
        if record is None or not self.help or not self.help_parts or not record[1].startswith(self.help):
            return record
        return record[0], cli_words(self.help_parts) + record[1][len(self.help):]


def option_from_field(option: Field[object]) -> Decorator:
    """The click option of one options field (:class:`WriteOptions`, :class:`PushOptions`): ``--KEYWORD``
    (``max_shard_bytes`` is typed as ``--max-shard-size``), stored under the field's name so a command
    passes ``**options`` on."""
    from ..api.options import DEFAULT_MAX_SHARD_SIZE, option_keyword

    flag = "--" + option_keyword(option).replace("_", "-")
    meta = option.metadata
    decls = [flag, *([meta["short"]] if meta.get("short") else []), option.name]
    common: dict[str, Any] = {"help": meta["help"], "cls": LibraryWordsOption, "help_parts": meta["help_parts"]}
    if option.name.endswith("_bytes"):  # a size, parsed here at the edge into bytes
        return click.option(*decls, type=SIZE, default=DEFAULT_MAX_SHARD_SIZE, show_default=True, **common)
    if isinstance(option.default, bool):
        if meta["negatable"]:
            return click.option(f"{flag}/--no-{flag[2:]}", option.name, default=option.default, show_default=True,
                                **common)
        if option.default:  # on unless turned off: typed --no-NAME alone
            return click.option(f"--no-{flag[2:]}", option.name, is_flag=True, flag_value=False, default=True,
                                **common)
        return click.option(*decls, is_flag=True, default=option.default, **common)
    if meta["choices"]:
        return click.option(*decls, type=click.Choice(list(meta["choices"])), default=option.default,
                            show_default=True, **common)
    if meta.get("repeatable"):
        return click.option(*decls, multiple=True, metavar=meta["repeatable"], **common)
    return click.option(*decls, default=option.default, **common)


def push_options(f: Command) -> Command:
    """Add ``shardkit push``'s options, one per :class:`PushOptions` field the CLI has a flag for."""
    from ..api.options import push_fields

    for option in reversed([o for o in push_fields() if o.metadata["cli"]]):
        f = option_from_field(option)(f)
    return f


def _shard_options() -> dict[str, Decorator]:
    """The output options of the commands that write shards (split, convert): one per :class:`WriteOptions`
    field the CLI has a flag for, made from the field, plus the CLI's own ``--json`` and ``--quiet``."""
    from ..api.options import option_keyword, write_fields

    made = {option_keyword(f).replace("_", "-"): option_from_field(f) for f in write_fields() if f.metadata["cli"]}
    made["json"] = click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary.")
    made["quiet"] = click.option("--quiet", "-q", is_flag=True, help="No progress bar and no summary.")
    return made


_SHARD_OPTIONS = _shard_options()


# hf:// inputs: the read token (info, fit, plan, verify, split, convert) and how split/convert read them.
hub_token_option = click.option(
    "--token", help="Hub token for hf://ORG/REPO[@REV][/SUBFOLDER] paths (default: HF_TOKEN or the login).")
no_cache_option = click.option(
    "--no-cache", "no_cache", is_flag=True,
    help="For an hf:// SOURCE: stream the tensor bytes by range reads straight into the shards (bounded memory, "
         "each byte fetched once, nothing in the HF cache) instead of downloading through the cache.")


def shard_options(*names: str) -> Decorator:
    """Add the named shard-writing options, in the given order (the order ``--help`` lists them).

    >>> @click.command()
    ... @shard_options("max-shard-size", "dtype", "dry-run")
    ... def cmd(max_shard_bytes: int, dtype: str | None, dry_run: bool) -> None: ...
    """
    def decorate(f: Command) -> Command:
        for name in reversed(names):  # click lists options in the order the decorators are written
            f = _SHARD_OPTIONS[name](f)
        return f

    return decorate
