"""The `mtpconvert` command: one module per command group registers its commands here."""

from __future__ import annotations

import sys
from typing import List, Optional

import click
import typer
from rich.console import Console

from .. import __version__
from ..logs import quiet_known_warnings
from . import convert, families, hub, inspect, recipe
from .errors import CLICK_ERRORS, report
from .helpfmt import Group

app = typer.Typer(
    cls=Group,
    help="Convert Qwen3.5/3.6/3.8 and Qwen3-Next checkpoints (BF16 or block-FP8) to MLX with the Multi-Token-Prediction head kept.",
    epilog="Examples:\n\n  mtpconvert pull-and-quantize Qwen/Qwen3.5-27B --bits 4\n\n  mtpconvert convert "
           "~/models/Qwen3.5-27B out/ --bits 4\n\n  mtpconvert COMMAND --help   # each command's options and "
           "examples\n",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback(invoke_without_command=True)
def _root(version: bool = typer.Option(False, "--version", help="Print the version and exit.")):
    if version:
        Console().print(__version__)
        raise typer.Exit(0)


for group in (convert, inspect, hub, recipe, families):
    group.register(app)


def run(argv: Optional[List[str]] = None) -> int:
    """Run the CLI; return its exit code (errors outside a command go through the same table)."""
    quiet_known_warnings()
    command = typer.main.get_command(app)
    try:
        code = command.main(args=argv, prog_name="mtpconvert", standalone_mode=False)
    except click.exceptions.Exit as e:
        return e.exit_code
    except CLICK_ERRORS as e:
        e.show()
        return e.exit_code
    except BaseException as e:  # noqa: BLE001 - the error table decides
        if isinstance(e, SystemExit):
            return e.code if isinstance(e.code, int) else 1
        return report(e)
    return code if isinstance(code, int) else 0


def main() -> None:
    sys.exit(run())
