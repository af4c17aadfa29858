"""``auto`` that starts informed: ``calibration.calibrate`` times both kinds of step at every batch size before a
decode, ``DraftPolicy(calibration=...)`` decides from the first step with those costs and an optimistic bound on
the acceptance (drafting is tried first wherever it could win, and its own steps measure it)."""

import random
import statistics
from types import SimpleNamespace

import pytest

from tests.test_batched import dense  # noqa: F401  (the module fixture)
from mtpconvert.runtime.decoding.calibration import calibrate
from mtpconvert.runtime.decoding.draft_policy import Calibration, DraftPolicy
from mtpconvert.runtime.decoding.rows import StepLog, Stream


def calibrated(plain: float, draft: float, B: int = 4) -> Calibration:
    return Calibration(1, {(b, d): [t * b / B] * 8 for b in range(1, B + 1) for d, t in ((False, plain), (True, draft))})


def decode(policy, B: int, plain: float, draft: float, accept: float, tokens: int, rng) -> tuple:
    """One decode of ``tokens`` per row as ``run_batch`` drives it (the next step decided during a plain one),
    each draft kept with probability ``accept``; returns (tokens per second, kinds chosen)."""
    engine = SimpleNamespace(depth=1, streams=[Stream([1], tokens) for _ in range(B)])
    for s in engine.streams:
        s.out, s.pend_t = [0], [0] * 32
    wall, chosen, decided, before = 0.0, [], None, False
    while engine.streams:
        d = policy.choose(engine) if decided is None else decided
        decided = policy.choose(engine) if not d else None
        n = len(engine.streams)
        if d:
            kept = [int(rng.random() < accept) for _ in engine.streams]
            record = StepLog(list(range(n)), kept, True, draft * n / B, head_width=max(len(s.pend_t) for s in engine.streams),
                             after_join=not chosen)
            for s, k in zip(engine.streams, kept):
                s.out, s.pend_t = s.out + [0] * (1 + k), [0] * (1 + k)
        else:
            record = StepLog(list(range(n)), [-1] * n, False, plain * n / B, after_join=not chosen, built_before=before,
                             built_next=decided is False)
            for s in engine.streams:
                s.out, s.pend_t = s.out + [0], s.pend_t + [0]
        before = not d and decided is False
        wall += record.seconds
        chosen.append(d)
        policy.observe(engine, record)
        engine.streams = [s for s in engine.streams if len(s.out) < tokens]
    return B * (tokens - 1) / wall, chosen


def test_calibrate_times_both_kinds_at_every_batch_size(dense):  # noqa: F811
    m, _ = dense
    cal = calibrate(m, 2, 3, steps=2)
    assert sorted(cal.seconds) == [(b, d) for b in (1, 2, 3) for d in (False, True)]
    assert all(len(t) == 4 and min(t) > 0 for t in cal.seconds.values()) and cal.wall_s > 0
    # each round's first plain step after drafting and first drafting step after plain, at every size
    assert sorted(cal.switch) == sorted(cal.seconds) and all(len(t) == 2 for t in cal.switch.values())
    policy = DraftPolicy(calibration=cal)
    assert policy.costs(3) is not None and policy.first_steps is None and set(policy.to_json()["policy_calibration_ms"])
    assert policy.bound(2) == 3.0  # no draft seen: every draft kept


def test_a_calibrated_policy_never_drafts_where_drafting_cannot_win():
    """A drafting step of 2.5 plain ones loses at depth 1 even with every draft kept: plain from the first step,
    no drafting step at all (the uncalibrated policy first times drafting 3 times)."""
    rates, chosen = decode(DraftPolicy(calibration=calibrated(0.010, 0.025)), 4, 0.010, 0.025, 0.9, 64, random.Random(0))
    assert not any(chosen)
    _, chosen = decode(DraftPolicy(), 4, 0.010, 0.025, 0.9, 64, random.Random(0))
    assert chosen[:3] == [True] * 3


def test_a_calibrated_policy_drafts_from_the_first_step_where_drafting_wins():
    """27B-shaped on the H200 (4 rows: plain 62 ms, drafting 106 ms; acceptance 0.8, 1.8 tokens a row): drafting
    wins by 6%; a fresh calibrated policy drafts its first steps and most of a 64-token decode (plain probes
    aside: at a 6% edge a probe of 3 plain steps loses little, so the budget allows one early)."""
    shares = []
    for run in range(40):
        _, chosen = decode(DraftPolicy(calibration=calibrated(0.062, 0.106)), 4, 0.062, 0.106, 0.8, 64,
                           random.Random(run))
        assert chosen[:4] == [True] * 4, run
        shares.append(sum(chosen) / len(chosen))
    assert statistics.median(shares) > 0.8, sorted(shares)


def test_the_calibrated_switch_cost_defers_the_first_probe():
    """27B-shaped at 4 rows as on the H200: the first plain step after drafting took 238 ms against 62 steady.
    With that switch in the calibration the budget owes a probe's predicted loss from the start, so a 64-token
    decode runs no probe (plain steps only where the drafts kept fall short); with no switch seen the first
    probe comes as soon as ``min_interval`` allows."""
    switch = {(4, False): [0.238], (4, True): [0.110]}
    for run in range(20):
        cal = calibrated(0.062, 0.106)
        cal.switch = dict(switch)
        policy = DraftPolicy(calibration=cal)
        _, chosen = decode(policy, 4, 0.062, 0.106, 0.8, 64, random.Random(run))
        assert policy.probes == 0 and chosen[:20] == [True] * 20, (run, chosen)
    probed = [DraftPolicy(calibration=calibrated(0.062, 0.106)) for _ in range(20)]
    for run, policy in enumerate(probed):
        decode(policy, 4, 0.062, 0.106, 0.8, 64, random.Random(run))
    assert sum(p.probes > 0 for p in probed) >= 10


def test_a_calibrated_policy_stops_drafting_soon_where_the_acceptance_is_too_low():
    """Drafting could win (1.7 plain steps a drafting step) but the drafts are kept at 0.4 (1.4 tokens a row):
    the optimistic bound falls below what drafting needs within a few steps, then plain runs."""
    for run in range(20):
        _, chosen = decode(DraftPolicy(calibration=calibrated(0.010, 0.017)), 4, 0.010, 0.017, 0.4, 64,
                           random.Random(run))
        first_plain = chosen.index(False)
        assert first_plain <= 6 and sum(chosen) <= first_plain + 6, (run, chosen)


class Fixed(DraftPolicy):
    def __init__(self, draft: bool):
        super().__init__()
        self.draft = draft

    def choose(self, engine):
        return self.draft


@pytest.mark.parametrize("B, plain, draft, accept", [(4, 0.0624, 0.1064, 0.8), (8, 0.0983, 0.1425, 0.8),
                                                     (4, 0.0624, 0.1064, 0.6)])
def test_the_first_decode_reaches_the_best_fixed_choice(B, plain, draft, accept):
    """At the 27B shape's step costs measured on the H200 (turn4: the plain engine's and every-row-drafting's
    median steps at 4 and 8 rows), 64-token decodes by a fresh calibrated policy reach at least 0.95 of the
    better fixed choice over the same draws (plain wins at acceptance 0.6 and 4 rows, drafting elsewhere)."""
    rates = {"auto": [], "plain": [], "mtp": []}
    for run in range(40):
        for name, policy in (("auto", DraftPolicy(calibration=calibrated(plain, draft, B))), ("plain", Fixed(False)),
                             ("mtp", Fixed(True))):
            rates[name].append(decode(policy, B, plain, draft, accept, 64, random.Random(run))[0])
    mean = {k: statistics.mean(v) for k, v in rates.items()}
    assert mean["auto"] >= 0.95 * max(mean["plain"], mean["mtp"]), mean
