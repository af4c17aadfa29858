"""The API's ``Events`` drawn on stderr: rich bars on a terminal, a plain line log otherwise.

Bars (one per stage: converting and downloading in bytes, smoke and bench in tokens, ...) need both
stdout and stderr on a terminal; with either one piped or logged, or under ``--json``, every stage
prints one line when it starts and, while it runs, a line with its count at most every
``HEARTBEAT_S`` seconds, so a log shows a slow machine is not a hung one. A stage that counts nothing
for that long (importing mlx-lm, loading a model) gets a line saying how long it has run.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, Optional

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, ProgressColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.text import Text

from ..progress import Events
from ..progress import Step
from .render import human_bytes, plan_summary

HEARTBEAT_S = 5.0  # a log line at most this often while a stage runs (so a gap stays under 10 s)
BYTES = "bytes"


def interactive(console: Console) -> bool:
    """Whether bars can be drawn: ``console`` (stderr) and stdout are both terminals."""
    return console.is_terminal and sys.stdout.isatty()


def count_text(done: float, total: Optional[float], unit: str) -> str:
    """``144/432 tokens``, ``1.2 GiB/3.4 GiB``; ``done`` alone when the total is unknown."""
    if unit == BYTES:
        return human_bytes(done) + (f"/{human_bytes(total)}" if total else "")
    return f"{done:.0f}" + (f"/{total:.0f}" if total else "") + (f" {unit}" if unit else "")


class _Count(ProgressColumn):
    def render(self, task) -> Text:
        if task.fields.get("pulse"):
            return Text("")
        unit = task.fields.get("unit", "")
        text = count_text(task.completed, task.total, unit)
        if unit == BYTES and task.speed:
            text += f" {human_bytes(task.speed)}/s"
        return Text(text)


class Bars:
    """One rich bar per stage (transient: gone once the work is done). A stage that has not counted anything
    yet (loading libraries, choosing the smoke) pulses, so the screen never stands still."""

    def __init__(self, console: Console):
        self.console = console
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), _Count(),
                            TextColumn("{task.fields[detail]}"), TimeElapsedColumn(), console=console,
                            transient=True)
        self.tasks: Dict[str, TaskID] = {}
        self.pulse: Optional[TaskID] = None
        self.lock = threading.Lock()  # downloads report from their own threads

    def stage(self, name: str) -> None:
        self.console.print(f"[dim]{escape(name)}…[/dim]", highlight=False)
        with self.lock:
            self._end_pulse()
            self.pulse = self.bar.add_task(escape(name.split(" (")[0].split(":")[0]), total=None, detail="",
                                           pulse=True)

    def _end_pulse(self) -> None:
        if self.pulse is not None:
            self.bar.remove_task(self.pulse)
            self.pulse = None

    def step(self, s: Step) -> None:
        with self.lock:
            self._end_pulse()
            task = self.tasks.get(s.stage)
            if task is not None and s.done < self.bar.tasks[self._index(task)].completed:  # the stage runs again
                self.bar.remove_task(task)
                task = None
            if task is None:
                self._hide_finished()
                task = self.tasks[s.stage] = self.bar.add_task(s.stage, total=s.total, unit=s.unit, detail="")
            self.bar.update(task, completed=s.done, total=s.total, detail=escape(s.detail))

    def restart(self, stage: str) -> None:
        with self.lock:
            task = self.tasks.pop(stage, None)
            if task is not None:
                self.bar.remove_task(task)

    def _index(self, task: TaskID) -> int:
        return next(i for i, t in enumerate(self.bar.tasks) if t.id == task)

    def _hide_finished(self) -> None:
        """A new stage begins: the bars of stages that reached their total make room."""
        for t in self.bar.tasks:
            if t.total and t.completed >= t.total:
                t.visible = False

    def note(self, text: str) -> None:
        self.console.print(text, highlight=False)


class Lines:
    """A line per stage on ``console``, and its count every ``interval`` seconds while it runs."""

    def __init__(self, console: Console, interval: float = HEARTBEAT_S,
                 clock: Callable[[], float] = time.monotonic):
        self.console, self.interval, self.clock = console, interval, clock
        self.start = self.last = self.stage_started = clock()
        self.current: Optional[str] = None
        self.stage_name: Optional[str] = None
        self.lock = threading.Lock()  # downloads report from their own threads, beats from a timer thread

    def line(self, text: str) -> None:
        self.last = self.clock()
        self.console.print(f"[{self.last - self.start:6.1f}s] {text}", markup=False, highlight=False,
                           soft_wrap=True)

    def stage(self, name: str) -> None:
        with self.lock:
            self.current = None  # the next count starts a line of its own
            self.stage_name, self.stage_started = name, self.clock()
            self.line(f"{name}...")

    def beat(self) -> None:
        """A line for the stage that runs when nothing was printed for ``interval`` seconds (called by a timer)."""
        with self.lock:
            if self.stage_name is not None and self.clock() - self.last >= self.interval:
                self.line(f"{self.stage_name}: running for {self.clock() - self.stage_started:.0f} s")

    def step(self, s: Step) -> None:
        with self.lock:
            if s.stage != self.current or self.clock() - self.last >= self.interval:
                self.current = s.stage
                detail = f" ({s.detail})" if s.detail else ""
                self.line(f"{s.stage}: {count_text(s.done, s.total, s.unit)}{detail}")

    def restart(self, stage: str) -> None:
        if self.current == stage:
            self.current = None

    def note(self, text: str) -> None:
        self.console.print(text, highlight=False, soft_wrap=True)


def view_for(console: Console, quiet: bool = False):
    """``Bars`` where ``interactive`` and not ``quiet`` (``--json``), else ``Lines``."""
    return Bars(console) if not quiet and interactive(console) else Lines(console)


@contextmanager
def rich_events(console: Console, *, quiet: bool = False, summary: bool = True) -> Iterator[Events]:
    """Events that draw on ``console`` (stderr), in the view ``view_for`` picks. ``quiet`` (``--json``): no plan
    summary either; ``summary``: print each plan's summary table."""
    view = view_for(console, quiet)
    bytes_done: Dict[str, float] = {}
    bytes_total: Dict[str, Optional[float]] = {}
    counting = threading.Lock()  # range fetches report from several threads at once

    def advance(stage: str, n: float, total: Optional[float] = None) -> None:
        with counting:
            if total:
                bytes_total[stage] = total
            bytes_done[stage] = bytes_done.get(stage, 0) + n
            step = Step(stage, bytes_done[stage], bytes_total.get(stage), BYTES)
        view.step(step)

    def on_plan(plan) -> None:
        if summary and not quiet:
            plan_summary(plan, console)
        bytes_done["converting"] = 0  # each plan is a conversion of its own
        view.restart("converting")
        advance("converting", 0, sum(it.out_bytes for it in plan.items))

    events = Events(
        plan=on_plan,
        item=lambda item: advance("converting", item.out_bytes),
        stage=view.stage,
        download=lambda n, total: advance("downloading", n, total),
        note=view.note,
        progress=view.step,
    )
    if isinstance(view, Bars):
        with view.bar:
            yield events
        return
    stop = threading.Event()

    def beats() -> None:  # checks a few times an interval, so a silent stage's line comes within ~1.2 intervals
        while not stop.wait(view.interval / 5):
            view.beat()

    timer = threading.Thread(target=beats, name="progress-heartbeat", daemon=True)
    timer.start()
    try:
        yield events
    finally:
        stop.set()
        timer.join()
