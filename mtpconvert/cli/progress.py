"""Rich progress for the API's ``Events``: a bytes bar for conversion and downloads, a status line per stage."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, TransferSpeedColumn

from ..api import Events
from .render import plan_summary


@contextmanager
def rich_events(console: Console, *, quiet: bool = False) -> Iterator[Events]:
    """Events that draw on ``console`` (stderr); ``quiet`` keeps only the notes."""
    bar = Progress(TextColumn("{task.description}"), BarColumn(), TransferSpeedColumn(), TimeElapsedColumn(),
                   console=console, transient=True, disable=quiet)
    tasks: dict = {}

    def task(name: str, total: Optional[float]) -> TaskID:
        if name not in tasks:
            tasks[name] = bar.add_task(name, total=total)
        return tasks[name]

    def on_plan(plan) -> None:
        if not quiet:
            plan_summary(plan, console)
        task("converting", sum(it.out_bytes for it in plan.items))

    def on_download(n: int, total: Optional[int]) -> None:
        t = task("downloading", total)
        if total:
            bar.update(t, total=total)
        bar.advance(t, n)

    def on_stage(name: str) -> None:
        if not quiet:
            bar.console.print(f"[dim]{escape(name)}…[/dim]", highlight=False)

    events = Events(
        plan=on_plan,
        item=lambda item: bar.advance(task("converting", None), item.out_bytes),
        stage=on_stage,
        download=on_download,
        note=lambda text: bar.console.print(text, highlight=False),
    )
    with bar:
        yield events
