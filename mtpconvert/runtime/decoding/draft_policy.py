"""When the batched engine drafts: ``DraftPolicy``, its "auto" mode (``batched.run_batch``)."""

from __future__ import annotations

from collections import deque
from typing import Deque, Dict, Optional, Tuple

from .rows import StepLog


class DraftPolicy:
    """Draft a step only when drafting is measured to emit more tokens per second at this batch size.

    Measures, per batch size B, the wall time of a drafting step and of a plain step
    (``StepLog.seconds``: device work plus the host sync and bookkeeping) and the tokens a drafting
    row emits per drafting step (1 + accepted drafts, moving average over all rows). A kind's cost
    is the fastest of its last ``window`` timed steps (a slow outlier is other load, not the step's
    own cost), and steps whose head read more than one step's pending pairs (after a join, or the
    first draft after a plain stretch, which reads the whole stretch) are not timed at all, nor are
    the first and last steps of a pipelined plain stretch (``StepLog.steady``). With n
    of B rows drafting it predicts (n * tokens_per_row + B - n) / t_draft against B / t_plain and
    drafts when the first is larger. Each kind is timed ``probe_steps`` times at a new B before
    predicting.

    Exploration has a budget: the losing kind is probed (``probe_steps`` steps) to keep its cost and
    the acceptance current, but only once the time spent on the winning kind since the last probe,
    times ``budget``, covers what that probe lost — its steps' time minus the time the winner
    would have taken for the same tokens, a drafting probe's catch-up of the whole plain stretch
    included — and never within ``min_interval`` decisions of it. Exploring so costs at most about
    ``budget`` of the decode time, however expensive a probe is on the machine.
    """

    def __init__(self, budget: float = 0.03, min_interval: int = 16, smoothing: float = 0.3, window: int = 8,
                 probe_steps: int = 3):
        self.budget, self.min_interval, self.smoothing = budget, min_interval, smoothing
        self.window, self.probe_steps = window, probe_steps
        self.timed: Dict[Tuple[int, bool], Deque[float]] = {}
        self.tokens_per_row: Optional[float] = None
        self.decisions = 0
        self.winner: Optional[bool] = None  # the kind predicted faster at the last decision
        self.probing = 0  # probe steps still to choose
        self.probe_loss = 0.0  # seconds the last probe (or the first timing of the loser) lost
        self.since_probe = 0.0  # seconds spent on the winner since then
        self.last_probe = 0  # decision count when the last probe started
        self.probes = 0  # probes started

    def seconds(self, B: int, drafted: bool) -> Optional[float]:
        """The step cost of one kind at batch size B, or None until it was timed ``probe_steps`` times."""
        times = self.timed.get((B, drafted))
        return min(times) if times and len(times) >= min(self.probe_steps, self.window) else None

    def predicted_rates(self, B: int, drafting: int) -> Optional[Tuple[float, float]]:
        """(drafting tok/s, plain tok/s) at batch size B, or None until both kinds were measured."""
        t_draft, t_plain = self.seconds(B, True), self.seconds(B, False)
        if t_draft is None or t_plain is None or self.tokens_per_row is None:
            return None
        return (drafting * self.tokens_per_row + B - drafting) / t_draft, B / t_plain

    def choose(self, engine) -> bool:
        B = len(engine.streams)
        drafting = sum(s.draft for s in engine.streams)
        if not drafting:
            return False
        if self.seconds(B, True) is None or self.tokens_per_row is None:
            return True
        if self.seconds(B, False) is None:
            return False
        draft_rate, plain_rate = self.predicted_rates(B, drafting)
        self.decisions += 1
        better = draft_rate > plain_rate
        if better != self.winner:  # a new winner: what was spent so far was exploring it
            self.winner, self.since_probe, self.probing = better, 0.0, 0
        if self.probing:
            self.probing -= 1
            return not better
        if (self.decisions - self.last_probe >= self.min_interval
                and self.since_probe * self.budget >= self.probe_loss):
            self.probing, self.last_probe = self.probe_steps - 1, self.decisions
            self.probe_loss, self.since_probe, self.probes = 0.0, 0.0, self.probes + 1
            return not better
        return better

    def observe(self, engine, record: StepLog) -> None:
        B = len(record.streams)
        if record.head_width <= engine.depth + 1 and not record.after_join and record.steady:
            times = self.timed.setdefault((B, record.drafted), deque(maxlen=self.window))
            times.append(record.seconds)
        kept = [a for a in record.accepted if a >= 0]
        if record.drafted and kept:
            new = 1 + sum(kept) / len(kept)
            old = self.tokens_per_row
            self.tokens_per_row = new if old is None else old + self.smoothing * (new - old)
        rates = self.predicted_rates(B, sum(a >= 0 for a in record.accepted) or B)
        if rates is None:  # still timing the kinds at this B: the price of a new B, not of a probe
            return
        winner, winner_rate = rates[0] > rates[1], max(rates)
        if record.drafted == winner:
            self.since_probe += record.seconds
        else:  # what this step lost against the winner for the same tokens
            self.probe_loss += max(record.seconds - (B + sum(kept)) / winner_rate, 0.0)
