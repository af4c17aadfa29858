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
    """List each supported family: its config model_types, the module that loads its backbone (mlx-lm's or
    mlx-vlm's), its MTP head's design, the runtimes that use its head, and what mtpconvert's runtime does with
    it (batched decoding, the pre-norm hidden state)."""
    described = api.families()
    if as_json:
        out_console.print_json(json.dumps(described))
        return
    table = Table(title="model families")
    for column in ("family", "model_type", "backbone module", "MTP head", "head runs in", "layouts", "runtime"):
        table.add_column(column)
    for f in described:
        head = f["head"]
        design = (f"{head['projection']} over [{', '.join(head['concat'])}], {head['layer']}, {head['output']}; "
                  f"fed the {head['hidden_state'].replace('_', '-')} state")
        can = f["capabilities"]
        runtime = "\n".join([("batched" if can["batched"] else "one stream"),
                             ("pre/post-norm" if can["pre_norm_hidden"] else "post-norm")])
        table.add_row(f"{f['family']}\n{f['title']}", "\n".join(f["model_types"]), "\n".join(f["backbone_modules"]),
                      escape(design), "\n".join(f["head_runtimes"]), "\n".join(f["mtp_layouts"]), runtime)
    print_whole(table, out_console)


def register(app) -> None:
    app.command(cls=Command, epilog=EPILOG)(families)
