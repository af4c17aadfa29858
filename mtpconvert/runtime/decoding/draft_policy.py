"""When the batched engine drafts: ``DraftPolicy``, its "auto" mode (``batched.run_batch``), and the
``Calibration`` it can start from (``calibration.calibrate``: both kinds timed per batch size before decoding)."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional, Tuple

from .rows import StepLog

SD_FLOOR = 0.3  # the least spread assumed of the drafts a row keeps per step (a few steps can all agree)


@dataclass
class Calibration:
    """Step costs timed before decoding: per (batch size, drafted) the seconds of the steady steps, as
    ``DraftPolicy.observe`` times a step (``DraftPolicy.timeable``). Kept per model and depth by its caller (a
    server, the bench) and given to every ``DraftPolicy`` it makes for them."""

    depth: int
    seconds: Dict[Tuple[int, bool], List[float]] = field(default_factory=dict)
    # per (batch size, drafted) the seconds of a kind's first step after a step of the other kind: the way
    # into a probe and back out of it (a plain step's graphs built anew, a drafting step's catch-up)
    switch: Dict[Tuple[int, bool], List[float]] = field(default_factory=dict)
    wall_s: float = 0.0  # how long calibrating took

    def add(self, record: StepLog, previous: Optional[StepLog] = None) -> None:
        key = (len(record.streams), record.drafted)
        if DraftPolicy.timeable(record, self.depth):
            self.seconds.setdefault(key, []).append(record.seconds)
        elif (previous is not None and previous.drafted != record.drafted and not record.after_join
              and len(previous.streams) == len(record.streams)):
            self.switch.setdefault(key, []).append(record.seconds)

    def switch_extra(self, B: int, drafted: bool) -> float:
        """Seconds a kind's first step after the other kind takes beyond its steady step at batch size B
        (0 where calibrating saw none)."""
        key = (B, drafted)
        if not self.switch.get(key) or not self.seconds.get(key):
            return 0.0
        return max(statistics.median(self.switch[key]) - statistics.median(self.seconds[key]), 0.0)

    def to_json(self) -> dict:
        return {f"B={b},{'draft' if d else 'plain'}{' switch' if switch else ''}": round(1e3 * statistics.median(t), 3)
                for switch, times in ((False, self.seconds), (True, self.switch)) for (b, d), t in sorted(times.items())}


class DraftPolicy:
    """Draft a step only when drafting is measured to emit more tokens per second at this batch size.

    Measures, per batch size B, the wall time of a drafting step and of a plain step
    (``StepLog.seconds``: device work plus the host sync and bookkeeping) and the tokens a drafting
    row emits per drafting step (1 + the mean of the drafts kept over the last ``accept_window`` drafting
    row-steps: an average over single steps of a few rows is too noisy to see a drafting edge of
    5-10%, the margin at which it pays on a GPU at model scale). A kind's cost
    is the median of its last ``window`` timed steps: robust to a slow outlier (other load, not the
    step's own cost), where the fastest of them would favour the kind whose steps spread more (on the
    H200, drafting steps of the dense fixture at 4 rows had a fastest-of-8 13% under their mean, plain
    steps 1%). Steps whose head read more than one step's pending pairs (after a join, or the
    first draft after a plain stretch, which reads the whole stretch) are not timed at all, nor are
    the first and last steps of a pipelined plain stretch (``StepLog.steady``). With n
    of B rows drafting it predicts (n * tokens_per_row + B - n) / t_draft against B / t_plain and
    drafts when the first is larger. Both kinds are timed ``probe_steps`` times at the first B.
    At a B where a kind has not been timed, its cost is the other kind's there (or, where neither was,
    the nearest timed B's) times the two kinds' ratio at the nearest B where both were timed: rows
    leave one by one at the end of a batch, and timing both kinds afresh at every smaller B costs
    most where the loser is expensive (drafting steps of 2-4x a plain one on a GPU), while the
    ratio moves little from one B to the next.

    Exploration has a budget: the losing kind is probed (``probe_steps`` steps) to keep its cost and
    the acceptance current, but only once the time spent on the winning kind since the last probe (the
    first timings count as one, at the loser's timed cost: a compile is not a probe's loss),
    times ``budget``, covers what that probe lost — its steps' time minus the time the winner
    would have taken for the same tokens, a drafting probe's catch-up of the whole plain stretch
    included, and the way back: the first step of the winner after it, beyond a step of the
    winner's cost (a drafting step's catch-up over a plain probe, the first plain step after a
    drafting one) — and never within ``min_interval`` decisions of it. A drafting probe's catch-up grows
    with the plain stretch before it (and takes in the prompts of rows that joined since), so the last
    probe's loss does not bound the next one's: the condition counts the next probe's catch-up as
    predicted, the pairs the rows have pending beyond one step's times the head's measured cost per
    pair (the last ``catch_up_window`` catch-ups over at least ``min_interval`` pairs, in plain steps at
    their batch size), in place of the last catch-up. A shorter catch-up (the way back from a plain
    probe) is mostly a head pass's fixed cost: on the H200 one over 3 pairs cost 0.1-0.4 plain steps a
    pair, one over 47 pairs 0.02. Where a pair costs more than ``budget`` of a plain step (the 2-core
    CPU: 0.06-0.3 with the text fixtures, whose few layers make the head's one layer a large share)
    no stretch pays for its own catch-up: within a decode plain runs on without drafting probes, and
    the time on plain across decodes pays for one over a new row's prompt now and then. Nor is drafting
    probed where it would lose with every draft kept (a drafting step over 1 + depth plain ones; on
    the CPU with the text fixtures one costs 1.9-5.2): the probe could only re-time a step, and a
    step cost moving by that much is not noise. Exploring so costs at most about ``budget`` of the decode time,
    however expensive a probe is on the machine.
    """

    def __init__(self, budget: float = 0.03, min_interval: int = 16, accept_window: int = 64, window: int = 8,
                 probe_steps: int = 3, catch_up_window: int = 4, calibration: Optional[Calibration] = None,
                 optimism: float = 1.0):
        self.budget, self.min_interval, self.optimism = budget, min_interval, optimism
        self.calibration = calibration
        self.accepted: Deque[int] = deque(maxlen=accept_window)  # drafts kept, per drafting row-step
        # their sum and sum of squares, kept as they come and go: on a launch-bound device the host's time per
        # step is the step's time, and ``statistics.pstdev`` over the window cost a plain step's 2-3%
        self.accepted_sum = self.accepted_squares = 0
        self.window, self.probe_steps = window, probe_steps
        self.timed: Dict[Tuple[int, bool], Deque[float]] = {}
        self.tokens_per_row: Optional[float] = None
        self.seen = 0  # drafting row-steps observed, all told
        self.least_seen = accept_window // 4  # drafting row-steps a calibrated policy observes before giving up on it
        self.decisions = 0
        self.winner: Optional[bool] = None  # the kind predicted faster at the last decision
        self.probing = 0  # probe steps still to choose
        self.probe_loss = 0.0  # seconds the last probe (or the first timings of the loser) lost
        self.probe_catch_up = 0.0  # the part of probe_loss that its drafting steps' catch-up cost
        self.catch_up: Deque[float] = deque(maxlen=catch_up_window)  # plain steps per pending pair the head read
        self.first_steps: Optional[Dict[bool, int]] = {True: 0, False: 0}  # steps of each kind before any prediction
        self.since_probe = 0.0  # seconds spent on the winner since then
        self.last_probe = 0  # decision count when the last probe started
        self.probes = 0  # probes started
        self.previous: Optional[bool] = None  # the kind of the last step observed
        self.steps_seen = 0
        # per (B, kind): the step count at its last timing, and the other kind's step cost at B then (its anchor)
        self.last_timed: Dict[Tuple[int, bool], int] = {}
        self.anchor: Dict[Tuple[int, bool], Optional[float]] = {}
        if calibration is not None and calibration.seconds:  # the calibration took the first timings
            for key, times in calibration.seconds.items():
                self.timed[key] = deque(times[-window:], maxlen=window)
                self.last_timed[key] = 0
            for (B, drafted) in calibration.seconds:  # both kinds were timed side by side
                self.anchor[(B, drafted)] = self.seconds(B, not drafted)
            self.first_steps = None

    step_cost = staticmethod(statistics.median)  # of a kind's last timed steps (see the class)

    def seconds(self, B: int, drafted: bool) -> Optional[float]:
        """The step cost of one kind at batch size B, or None until it was timed ``probe_steps`` times."""
        times = self.timed.get((B, drafted))
        return self.step_cost(times) if times and len(times) >= min(self.probe_steps, self.window) else None

    def costs(self, B: int) -> Optional[Tuple[float, float]]:
        """(drafting step, plain step) seconds at batch size B: as timed, else estimated through the kinds'
        ratio at the nearest B where both were timed (see the class); None before any B had both."""
        draft, plain = self.seconds(B, True), self.seconds(B, False)
        if draft is not None and plain is not None:
            return self._current(B, draft, plain)
        both = [b for b in {b for b, _ in self.timed}
                if self.seconds(b, True) is not None and self.seconds(b, False) is not None]
        if not both:
            return None
        near = min(both, key=lambda b: (abs(b - B), b))
        near_draft, near_plain = self._current(near, self.seconds(near, True), self.seconds(near, False))
        if plain is not None:
            return plain * near_draft / near_plain, plain
        if draft is not None:
            return draft, draft * near_plain / near_draft
        return near_draft, near_plain

    def _current(self, B: int, draft: float, plain: float) -> Tuple[float, float]:
        """Both kinds' step costs at B as of now: the kind timed last as timed, the other's timed cost times how
        much the last one's cost moved since the other was timed beside it (its anchor). The machine's speed moves
        (on the H200, stretches of plain steps 1.3-1.5 times their neighbours'): timed apart, the kind the batch
        runs would carry every slowdown and the other none, and a slowdown alone would switch the kind."""
        fresh = self.last_timed.get((B, True), -1) > self.last_timed.get((B, False), -1)
        stale_anchor = self.anchor.get((B, not fresh))
        if stale_anchor:
            if fresh:
                plain *= draft / stale_anchor
            else:
                draft *= plain / stale_anchor
        return draft, plain

    def predicted_rates(self, B: int, drafting: int) -> Optional[Tuple[float, float]]:
        """(drafting tok/s, plain tok/s) at batch size B, or None until both kinds were measured."""
        return self._rates(B, drafting, self.costs(B))

    def _rates(self, B: int, drafting: int, costs: Optional[Tuple[float, float]],
               tokens_per_row: Optional[float] = None) -> Optional[Tuple[float, float]]:
        """(drafting tok/s, plain tok/s) at ``costs``, a drafting row emitting ``tokens_per_row`` (default: as measured)."""
        tokens_per_row = self.tokens_per_row if tokens_per_row is None else tokens_per_row
        if costs is None or tokens_per_row is None:
            return None
        return (drafting * tokens_per_row + B - drafting) / costs[0], B / costs[1]

    def choose(self, engine) -> bool:
        B = len(engine.streams)
        drafting = sum(s.draft for s in engine.streams)
        if not drafting:
            return False
        costs = self.costs(B)
        tokens_per_row = self.bound(engine.depth)
        rates = self._rates(B, drafting, costs, tokens_per_row)
        if rates is None:  # the first timings: drafting's, then plain's
            return self.seconds(B, True) is None or self.tokens_per_row is None
        self.decisions += 1
        better = rates[0] > rates[1]
        if self.decisions == 1 and self.calibration is not None:
            self.probe_loss = self.calibrated_probe_loss(B, drafting, better, costs, tokens_per_row)
        if better != self.winner:  # a new winner: what was spent so far was exploring it
            self.winner, self.since_probe, self.probing = better, 0.0, 0
        if self.probing:
            self.probing -= 1
            return not better
        if (self.decisions - self.last_probe >= self.min_interval and (better or self.could_draft(engine, costs))
                and self.since_probe * self.budget >= self.next_probe_loss(engine, better, costs)):
            self.probing, self.last_probe = self.probe_steps - 1, self.decisions
            self.probe_loss, self.probe_catch_up, self.since_probe = 0.0, 0.0, 0.0
            self.probes += 1
            return not better
        return better

    def bound(self, depth: int) -> Optional[float]:
        """Tokens a drafting row emits per step, as the decisions take it: an upper confidence bound, the mean
        of the drafts kept over the window plus ``optimism`` spreads over the root of every drafting row-step
        seen (so the bonus fades as drafting is observed, where the window's own error would keep favouring
        drafting at a near tie for good); at most 1 + depth. Until ``least_seen`` drafting row-steps were seen
        it is 1 + depth once calibrated (drafting is tried first wherever it could win: its own steps are what
        measures it, while plain's cost is known; a few rows' first steps are too few to give it up on: at 4
        rows keeping 0.8 of their drafts, 2 steps keep half or fewer one time in 20), None otherwise (the
        first timings)."""
        n = len(self.accepted)
        if not n or (self.calibration is not None and self.seen < self.least_seen):
            return None if self.calibration is None else 1.0 + depth
        mean = self.accepted_sum / n
        spread = max(math.sqrt(max(self.accepted_squares / n - mean * mean, 0.0)), SD_FLOOR) if n > 1 else SD_FLOOR
        return min(1.0 + depth, 1.0 + mean + self.optimism * spread / math.sqrt(self.seen))

    def calibrated_probe_loss(self, B: int, drafting: int, drafting_wins: bool, costs: Tuple[float, float],
                              tokens_per_row: float) -> float:
        """What a probe of the loser is predicted to lose, from the calibration, before any was run: its
        ``probe_steps`` steps against the winner's rate for the same tokens, and the extra of the first
        step into the probe and of the first step back (``Calibration.switch_extra`` of both kinds). The
        budget pays this before the first probe, as it pays a measured probe's loss before the next (with no
        debt a calibrated policy would probe as soon as ``min_interval`` allows: in a 64-token decode of the
        27B shape at 4 rows on the H200 that probe, its first plain step 3.7 plain steps long, cost 4%)."""
        winner_rate = max(self._rates(B, drafting, costs, tokens_per_row))
        if drafting_wins:
            loser_cost, loser_tokens = costs[1], B
        else:
            loser_cost, loser_tokens = costs[0], drafting * tokens_per_row + B - drafting
        steps = self.probe_steps * max(loser_cost - loser_tokens / winner_rate, 0.0)
        return steps + self.calibration.switch_extra(B, True) + self.calibration.switch_extra(B, False)

    def could_draft(self, engine, costs: Tuple[float, float]) -> bool:
        """Whether drafting would win with every draft kept (1 + depth tokens a drafting row) at ``costs``
        (drafting step, plain step); if not, a drafting probe could only confirm that it loses."""
        draft_rate, plain_rate = self._rates(len(engine.streams), sum(s.draft for s in engine.streams), costs,
                                             1 + engine.depth)
        return draft_rate > plain_rate

    def next_probe_loss(self, engine, drafting_wins: bool, costs: Tuple[float, float]) -> float:
        """What the next probe is expected to lose at ``costs``: the last one's loss, with a drafting
        probe's catch-up predicted for the pairs the rows have pending now rather than taken from the
        last stretch."""
        if drafting_wins or not self.catch_up:
            return self.probe_loss
        pending = max(len(s.pend_t) for s in engine.streams)  # pairs the head reads at the next drafting step
        per_pair = statistics.median(self.catch_up) * costs[1]
        return self.probe_loss - self.probe_catch_up + per_pair * max(pending - engine.depth - 1, 0)

    @staticmethod
    def timeable(record: StepLog, depth: int) -> bool:
        """Whether a step's time is a step cost of its kind (the class doc says which are not)."""
        return record.head_width <= depth + 1 and not record.after_join and record.steady

    def observe(self, engine, record: StepLog) -> None:
        B = len(record.streams)
        self.steps_seen += 1
        if self.timeable(record, engine.depth):
            times = self.timed.setdefault((B, record.drafted), deque(maxlen=self.window))
            times.append(record.seconds)
            key, other = (B, record.drafted), (B, not record.drafted)
            if self.last_timed.get(other, -1) >= self.last_timed.get(key, -1):  # the first of a stretch: the other
                self.anchor[key] = self.seconds(*other)  # kind's cost as it ran just before is this one's reference
            if other in self.timed and self.anchor.get(other) is None:  # the other kind was timed first, before
                self.anchor[other] = self.seconds(*key)  # this one had a cost: this one's first cost is its reference
            self.last_timed[key] = self.steps_seen
        kept = [a for a in record.accepted if a >= 0]
        if record.drafted and kept:
            for a in kept:
                if len(self.accepted) == self.accepted.maxlen:
                    gone = self.accepted[0]
                    self.accepted_sum -= gone
                    self.accepted_squares -= gone * gone
                self.accepted.append(a)
                self.accepted_sum += a
                self.accepted_squares += a * a
            self.seen += len(kept)
            self.tokens_per_row = 1 + self.accepted_sum / len(self.accepted)
        drafting = sum(a >= 0 for a in record.accepted) or B
        costs = self.costs(B)
        rates = self._rates(B, drafting, costs, self.tokens_per_row or self.bound(engine.depth))
        # a step after a join reads the new prompts: its cost is the join's, not a switch's
        switched = self.previous is not None and self.previous != record.drafted and not record.after_join
        self.previous = record.drafted
        if rates is None:  # still taking the first timings
            self.first_steps[record.drafted] += 1
            return
        winner, winner_rate = rates[0] > rates[1], max(rates)
        catch_up = 0.0  # this step's extra over a drafting step, for the head's pending pairs beyond one step's
        extra_pairs = record.head_width - engine.depth - 1
        if record.drafted and extra_pairs >= self.min_interval:  # after a join too: the head reads a prompt as a stretch
            catch_up = max(record.seconds - costs[0], 0.0)
            self.catch_up.append(catch_up / extra_pairs / costs[1])
        if self.first_steps is not None:  # the first timings of the loser were a probe too: the budget pays them
            loser_cost = costs[0 if not winner else 1]
            loser_tokens = drafting * self.tokens_per_row + B - drafting if not winner else B
            self.probe_loss += self.first_steps[not winner] * max(loser_cost - loser_tokens / winner_rate, 0.0)
            self.first_steps = None
        if record.drafted == winner and switched:
            # the way back from the loser (the first plain step after drafting, or a drafting step's
            # catch-up over the plain steps): its extra over a step of the winner is exploring's too
            winner_cost = costs[0 if winner else 1]
            self.probe_loss += max(record.seconds - winner_cost, 0.0)
            self.since_probe += min(record.seconds, winner_cost)
        elif record.drafted == winner:
            self.since_probe += record.seconds
        else:  # what this step lost against the winner for the same tokens
            lost = max(record.seconds - (B + sum(kept)) / winner_rate, 0.0)
            self.probe_loss += lost
            self.probe_catch_up += min(catch_up, lost)

    def to_json(self) -> dict:
        """What the policy decided from: its step costs per (B, kind) in ms, the tokens a drafting row
        emits per step, how many probes it started, and the head's catch-up per pending pair in plain steps."""
        costs = {key: self.seconds(*key) for key in sorted(self.timed)}
        return {"policy_step_ms": {f"B={b},{'draft' if d else 'plain'}": round(1e3 * t, 3)
                                   for (b, d), t in costs.items() if t is not None},
                "policy_tokens_per_row": None if self.tokens_per_row is None else round(self.tokens_per_row, 3),
                "policy_probes": self.probes,
                "policy_calibration_ms": None if self.calibration is None else self.calibration.to_json(),
                "policy_catch_up_per_pair": round(statistics.median(self.catch_up), 4) if self.catch_up else None}
