"""`families`: the model families mtpconvert converts, and where each one's head runs."""

from __future__ import annotations

import json

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .. import api
from . import options as o
from .errors import handled
from .helpfmt import Command
from .render import print_whole

out_console = Console()

EPILOG = """Examples:

  mtpconvert families

  mtpconvert families --json
"""


@handled
def families(as_json: o.Json = False):
    """List each supported family: its config model_types, its MTP head's design, the mlx-lm module that loads
    its backbone, and the runtimes that use its head."""
    described = api.families()
    if as_json:
        out_console.print_json(json.dumps(described))
        return
    table = Table(title="model families")
    for column in ("family", "model_type", "mlx-lm module", "MTP head", "head runs in", "layouts"):
        table.add_column(column)
    for f in described:
        head = f["head"]
        design = (f"{head['projection']} over [{', '.join(head['concat'])}], {head['layer']}, {head['output']}; "
                  f"fed the {head['hidden_state'].replace('_', '-')} state")
        table.add_row(f"{f['family']}\n{f['title']}", "\n".join(f["model_types"]), "\n".join(f["mlx_lm_modules"]),
                      escape(design), "\n".join(f["head_runtimes"]), "\n".join(f["mtp_layouts"]))
    print_whole(table, out_console)


def register(app) -> None:
    app.command(cls=Command, epilog=EPILOG)(families)
