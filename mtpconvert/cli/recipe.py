"""`recipe list` and `recipe run`: per-model conversion recipes, run through the API (exit codes included)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from .. import api
from ..gate import Gate
from ..recipes import BUNDLED, find_recipe, list_recipes, load_recipe
from . import options as o
from .convert import print_pull_plan, print_result
from .errors import handled
from .helpfmt import Command, Group
from .progress import rich_events
from .render import print_whole

console = Console(stderr=True)
out_console = Console()

app = typer.Typer(cls=Group, help="Per-model conversion recipes (the bundled ones, or your own TOML files).",
                  no_args_is_help=True)

LIST_EPILOG = """Examples:

  mtpconvert recipe list

  mtpconvert recipe list --dir my-recipes/
"""

RUN_EPILOG = """Examples:

  mtpconvert recipe run Qwen3.5-27B-4bit-bf16 --dry-run

  mtpconvert recipe run Qwen3.5-27B-4bit-bf16 --out Qwen3.5-27B-4bit-mtp --no-upload

  mtpconvert recipe run my-recipes/custom.toml
"""


@app.command("list", cls=Command, epilog=LIST_EPILOG)
@handled
def recipe_list(folder: Annotated[Optional[Path], typer.Option(
        "--dir", help="Folder of recipe files (default: the recipes that ship with mtpconvert).",
        show_default=False)] = None):
    """Every recipe with its repository and options."""
    recipes = list_recipes(folder or BUNDLED)
    table = Table(title=f"recipes in {folder or 'mtpconvert (bundled)'}")
    for col in ("file", "repo", "bits", "group", "dtype", "MTP", "upload to"):
        table.add_column(col, overflow="fold")
    for r in recipes:
        table.add_row(r.path.name, r.repo, str(r.bits or "-"), str(r.group_size or "-"), r.dtype or "source",
                      r.mtp if r.mtp_bits is None else f"{r.mtp_bits}-bit", r.upload_repo or "-")
    print_whole(table, out_console)


@app.command("run", cls=Command, epilog=RUN_EPILOG)
@handled
def recipe_run(
    ctx: typer.Context,
    path: Annotated[Path, typer.Argument(help="A recipe file, or the name of a bundled recipe (see `recipe "
                                         "list`).")],
    out: Annotated[Optional[Path], typer.Option("--out", help="Output folder (default: ./<name>-<bits>bit-mtp-mlx).",
                                                show_default=False)] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show the download plan only.")] = False,
    no_upload: Annotated[bool, typer.Option("--no-upload", help="Convert but do not upload.")] = False,
    stream: Annotated[bool, typer.Option("--stream", help="Fetch raw data when first needed and delete it after "
                                         "its last use (pull-and-quantize --stream, with the recipe's "
                                         "raw_window_gb or prefetch_shards).")] = False,
    resume: o.Resume = False,
    smoke_mode: o.SmokeMode = o.DEFAULTS["smoke_mode"],
    token: o.Token = None,
):
    """Run one recipe: pull-and-quantize -> verify -> smoke -> upload."""
    path = find_recipe(path)
    recipe = load_recipe(path)
    console.print("mtpconvert " + " ".join(recipe.cli_args(stream=stream and not dry_run)), highlight=False)
    if dry_run:
        print_pull_plan(api.pull_plan(recipe.source(token), recipe.options), False)
        return
    with rich_events(console) as events:
        result = api.run_recipe(path, out, upload=not no_upload, token=token, events=events, stream=stream,
                                resume=resume, checks=Gate(smoke_mode=smoke_mode.value))
    print_result(result)


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="recipe")
