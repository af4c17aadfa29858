"""The one table from exceptions to what the user reads and the exit code.

Every command runs inside ``handled``: a ``ConvertError`` prints its own message (it
names the file, key or option), Ctrl-C and SIGTERM exit 130, a full disk or a missing
permission is named as such, and anything else is reported as a bug in mtpconvert,
never renamed into something it is not. ``MTPCONVERT_DEBUG=1`` prints the traceback too.
Where a failure left finished shards (``errors.Kept`` on the exception), the message ends
with the exact command that resumes: the same command and options, plus ``--resume``.
"""

from __future__ import annotations

import errno
import functools
import os
import shlex
import signal
import traceback
from enum import Enum
from typing import Callable, Dict, List, Optional, Tuple

import click
import typer
from rich.console import Console

from ..errors import ConvertError, Kept

console = Console(stderr=True)
INTERRUPTED = 130
BUG = 1


def _interrupted(e: BaseException) -> Tuple[str, int]:
    return "interrupted", INTERRUPTED


def _os_error(e: OSError) -> Tuple[str, int]:
    where = f" ({e.filename})" if e.filename else ""
    if e.errno == errno.ENOSPC:
        return f"no space left on the device{where}", 2
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied{where}", 2
    return f"{e.strerror or e}{where}", 2


def _memory(e: MemoryError) -> Tuple[str, int]:
    return "out of memory", 2


def _bug(e: BaseException) -> Tuple[str, int]:
    return (f"internal error: {type(e).__name__}: {e}\n  this is a bug in mtpconvert; rerun with "
            "MTPCONVERT_DEBUG=1 for the traceback and report it"), BUG


# (exception type, message and exit code); the first matching row wins
TABLE: Tuple[Tuple[type, Callable[[BaseException], Tuple[str, int]]], ...] = (
    (ConvertError, lambda e: (str(e), e.exit_code)),
    (KeyboardInterrupt, _interrupted),
    (click.exceptions.Abort, _interrupted),
    (MemoryError, _memory),
    (OSError, _os_error),
    (Exception, _bug),
)


def debug() -> bool:
    return os.environ.get("MTPCONVERT_DEBUG", "") not in ("", "0")


NEVER_ECHOED = {"token"}  # a secret: the resume command relies on HF_TOKEN or the saved login instead


def _word(value) -> str:
    return str(value.value if isinstance(value, Enum) else value)


def _option_words(param, value) -> List[str]:
    """The words that give ``param`` this ``value`` on a command line; none where it is the default."""
    default = param.default() if callable(param.default) else param.default
    if value is None or value == default or (isinstance(value, Enum) and value.value == _word(default)):
        return []
    if param.is_flag and isinstance(value, bool):
        names = param.opts if value else param.secondary_opts
        return names[:1]
    if param.multiple:
        return [w for item in value for w in (param.opts[0], _word(item))]
    return [param.opts[0], _word(value)]


def command_line(ctx: typer.Context, replace: Dict[str, List[str]]) -> str:
    """The command ``ctx`` ran, as given: its arguments and every option that differs from its
    default, each param named in ``replace`` given those words instead (where the command has it)."""
    words = ["mtpconvert", *ctx.command_path.split()[1:]]
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if param.name in NEVER_ECHOED:
            continue
        if param.name in replace:
            words += replace[param.name]
        elif param.param_type_name == "argument":
            words += [] if value is None else [_word(value)]
        else:
            words += _option_words(param, value)
    return shlex.join(words)


def resume_replacements(e: BaseException, kept: Kept) -> Dict[str, List[str]]:
    """--resume, and what to do about a post-check that failed: a full smoke that ran out of
    memory goes layerwise; any other smoke failure is skipped (its own message says why it failed)."""
    if kept.failed_check != "smoke":
        return {"resume": ["--resume"]}
    if isinstance(e, MemoryError) and kept.smoke_mode == "full":
        return {"resume": ["--resume"], "smoke_mode": ["--smoke-mode", "layerwise"]}
    return {"resume": ["--resume"], "no_smoke": ["--no-smoke"]}


def resume_advice(e: BaseException, ctx: Optional[typer.Context]) -> Optional[str]:
    """Where the finished shards are and the command (``ctx``) that picks them up, or None."""
    kept: Optional[Kept] = getattr(e, "kept", None)
    if kept is None:
        return None
    if ctx is None or "resume" not in ctx.params:
        return f"finished shards are kept in {kept.partial}"
    return f"finished shards are kept in {kept.partial}; resume with: {command_line(ctx, resume_replacements(e, kept))}"


def report(e: BaseException, ctx: Optional[typer.Context] = None) -> int:
    """Print what went wrong; return the exit code. ``ctx``: the command's context, for the resume command."""
    message, code = next(render(e) for kind, render in TABLE if isinstance(e, kind))
    advice = resume_advice(e, ctx)
    if advice and code == INTERRUPTED:  # one line: what happened, where the work is, how to go on
        message = f"{getattr(e, 'summary', message)}; {advice}"
    elif advice:
        message = f"{message}\n  {advice}"
    if debug():
        console.print(traceback.format_exc(), markup=False, highlight=False)
    # soft_wrap: a long path or the resume command stays on its line, whatever the terminal's width
    console.print(f"[red]error:[/red] {message}" if code != INTERRUPTED else f"[red]{message}[/red]",
                  highlight=False, soft_wrap=True)
    return code


def _terminate_as_interrupt() -> None:
    """SIGTERM unwinds like Ctrl-C, so temp folders, locks and worker processes are cleaned up."""

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (an embedding program): leave its handler alone
        pass


# usage errors (unknown option, bad value) as the parser raises them: typer >= 0.29 parses with its own
# copy of click, whose exceptions are not click's
CLICK_ERRORS = tuple({click.ClickException,
                      next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")})

def handled(fn: Callable) -> Callable:
    """Run a command callback under the error table."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _terminate_as_interrupt()
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, click.exceptions.Exit, *CLICK_ERRORS):
            raise
        except BaseException as e:  # noqa: BLE001 - the table decides, unknown ones are reported as bugs
            if isinstance(e, (SystemExit, GeneratorExit)):
                raise
            # a command that can resume takes its context as ``ctx``: the resume command is built from it
            raise typer.Exit(report(e, kwargs.get("ctx"))) from None

    return wrapper
