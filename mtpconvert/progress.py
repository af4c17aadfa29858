"""How the API reports progress: ``Events`` callbacks, and the ``Step``s of a long stage.

A ``Progress`` callback receives ``Step``s: the runtime (smoke, bench), the checks, verify
``--deep`` and add-mtp call it, and ``Events.progress`` carries it to the caller with the
conversion's bytes, the downloads and the stage names; ``cli.progress`` draws them (rich bars on
a terminal, a line on stderr every few seconds otherwise). Nothing here prints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from .plan import Plan, PlanItem


@dataclass(frozen=True)
class Step:
    """``done`` of ``total`` ``unit`` of ``stage`` are finished; ``detail`` names what runs now."""

    stage: str  # "smoke", "bench", "verify --deep", ...: one bar (or log line) per stage
    done: int
    total: Optional[int]  # None: not known in advance
    unit: str = ""  # what done and total count: "tokens", "layers", "tensors", "bytes"
    detail: str = ""  # "prompt 2/3: MTP depth 1", "layer 5/40", ...


Progress = Callable[[Step], None]


def silent(*_args) -> None:
    return None


@dataclass
class Events:
    """Progress callbacks; each defaults to doing nothing."""

    plan: Callable[[Plan], None] = silent  # the plan about to run
    item: Callable[[PlanItem], None] = silent  # an item's bytes are on disk
    stage: Callable[[str], None] = silent  # a named stage starts (resolving, verifying, smoke, ...)
    download: Callable[[int, Optional[int]], None] = silent  # (bytes just fetched, total bytes or None)
    note: Callable[[str], None] = silent  # something the user should know (a check skipped, peak disk, ...)
    progress: Callable[[Step], None] = silent  # a long stage's count: smoke tokens, layers, bench runs, ...


class Counter:
    """One stage's running count, reported to ``progress`` on every change."""

    def __init__(self, progress: Optional[Progress], stage: str, total: Optional[int], unit: str = ""):
        self.progress = progress or silent
        self.stage, self.total, self.unit = stage, total, unit
        self.done, self.detail = 0, ""

    def _report(self) -> None:
        self.progress(Step(self.stage, self.done, self.total, self.unit, self.detail))

    def add(self, n: int = 1) -> None:
        self.done += n
        self._report()

    def at(self, detail: str, done: Optional[int] = None) -> None:
        """Now running ``detail``; ``done`` sets the count (a decode that stopped early skips ahead)."""
        self.detail = detail
        if done is not None:
            self.done = done
        self._report()
