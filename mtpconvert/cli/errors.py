"""The one table from exceptions to what the user reads and the exit code.

Every command runs inside ``handled``: a ``ConvertError`` prints its own message (it
names the file, key or option), Ctrl-C and SIGTERM exit 130, a full disk or a missing
permission is named as such, and anything else is reported as a bug in mtpconvert,
never renamed into something it is not. ``MTPCONVERT_DEBUG=1`` prints the traceback too.
"""

from __future__ import annotations

import errno
import functools
import os
import signal
import traceback
from typing import Callable, Tuple

import click
import typer
from rich.console import Console

from ..errors import ConvertError

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


def report(e: BaseException) -> int:
    """Print what went wrong; return the exit code."""
    message, code = next(render(e) for kind, render in TABLE if isinstance(e, kind))
    if debug():
        console.print(traceback.format_exc(), markup=False, highlight=False)
    console.print(f"[red]error:[/red] {message}" if code != INTERRUPTED else f"[red]{message}[/red]",
                  highlight=False)
    return code


def _terminate_as_interrupt() -> None:
    """SIGTERM unwinds like Ctrl-C, so temp folders, locks and worker processes are cleaned up."""

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (an embedding program): leave its handler alone
        pass


def handled(fn: Callable) -> Callable:
    """Run a command callback under the error table."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _terminate_as_interrupt()
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, click.exceptions.Exit, click.ClickException):
            raise
        except BaseException as e:  # noqa: BLE001 - the table decides, unknown ones are reported as bugs
            if isinstance(e, (SystemExit, GeneratorExit)):
                raise
            raise typer.Exit(report(e)) from None

    return wrapper
