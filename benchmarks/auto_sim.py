"""``auto`` at model scale, simulated at step costs measured on a GPU: what the policy reaches against the best
fixed choice when a decode is short (a server's 64-token request), before spending device time on it.

Input: an ``oracle_27b.py --stage batched`` JSON (``benchmarks/results/oracle/`` or ``../shared/gpu/``): each
row's plain-engine and every-row-drafting median step times at its batch size C. A kind's step at B rows costs
a line through its two measured points (``a + b*B``, C = 4 and 8), times a lognormal noise (``--noise``). The
simulated decode runs ``run_batch``'s own control flow over C rows of ``--max-tokens`` tokens (their prompts
``--prompt`` tokens long); each row keeps its draft at an output position with probability ``--accept`` (keyed
by run, row and position, as ``KeepOracle`` keys them: every decoder of a run sees the same draws); a drafting
step after plain steps also pays the head's catch-up (``--catch-up`` plain steps per pending pair, and
``--switch-draft`` plain steps), the first plain step after drafting ``--switch-plain`` plain steps (it builds
two graphs before it waits); rows leave as they finish. Decoders:

``plain``, ``mtp``      the fixed choices;
``auto (turn4)``        ``DraftPolicy(optimism=0)`` (the policy as it was measured in turn4) warmed by one
                        untimed decode and kept, as the oracle bench ran it, every (B, kind) the process has not
                        run before costing ``--compile-ms`` once (the bench did not warm the shapes up);
``auto``                ``DraftPolicy(calibration=...)`` on its first decode: the calibration's step costs
                        drawn at each B 1..C, ``--cal-bias`` times the decode's (a shorter context), 8 per kind,
                        and one first step of each kind after the other;
``auto, kept``          the same policy on its second decode.

Prints tok/s (mean over ``--runs`` runs) and auto / best fixed: the ratio of the means, and the 10th percentile
of the same ratio per run. Seeded: the same JSON on any machine.

    python -m benchmarks.auto_sim ../shared/gpu/turn4/oracle27b_c4c8_64tok.json --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from pathlib import Path
from types import SimpleNamespace

from mtpconvert.runtime.decoding.draft_policy import Calibration, DraftPolicy
from mtpconvert.runtime.decoding.rows import StepLog


def cost_lines(report: dict):
    """{C: (plain ms, drafting ms)} of the rows, and per kind (a, b) of the line a + b*B through them."""
    points = {}
    for run in report["runs"]:
        for row in run["rows"]:
            d = row["decoders"]
            points[row["concurrency"]] = (d["plain"]["median_step_ms"], d["mtp"]["median_step_ms"])
    (c0, p0), (c1, p1) = sorted(points.items())[0], sorted(points.items())[-1]
    lines = []
    for kind in (0, 1):
        b = (p1[kind] - p0[kind]) / (c1 - c0) if c1 != c0 else p0[kind] / c0 * 0.5
        lines.append((p0[kind] - b * c0, b))
    return points, lines


class Sim:
    """One simulated process: its step costs, its draws, the shapes it has run."""

    def __init__(self, args, lines, run: int):
        self.args, self.lines, self.run = args, lines, run
        self.rng = random.Random(run)
        self.shapes = set()

    def cost(self, B: int, drafted: bool) -> float:
        a, b = self.lines[int(drafted)]
        return (a + b * B) / 1e3

    def noisy(self, t: float) -> float:
        return t * math.exp(self.rng.gauss(0.0, self.args.noise))

    def keeps(self, row: int, position: int) -> bool:
        return random.Random(f"{self.run}/{row}/{position}").random() < self.args.accept

    def decode(self, C: int, choose, compile_ms: float = 0.0) -> float:
        """One decode of C rows by ``choose`` (a policy, or a fixed kind); returns tokens per second."""
        a = self.args
        rows = [SimpleNamespace(row=r, out=1, draft=True, pend_t=[0] * a.prompt) for r in range(C)]
        engine = SimpleNamespace(depth=1, streams=list(rows))
        policy = choose if isinstance(choose, DraftPolicy) else None
        wall, previous, ahead_built, decided, first = 0.0, None, False, None, True
        while engine.streams:
            if policy is None:
                draft = choose
            else:
                draft = policy.choose(engine) if decided is None else decided
            ahead, decided = False, None
            if not draft and any(s.out + 1 < a.max_tokens for s in engine.streams):
                if policy is not None:
                    decided = policy.choose(engine)
                ahead = policy is None or not decided
            B = len(engine.streams)
            t = self.noisy(self.cost(B, draft))
            plain_t = self.cost(B, False)
            if (B, draft) not in self.shapes:
                self.shapes.add((B, draft))
                t += compile_ms / 1e3
            if draft:
                width = max(len(s.pend_t) for s in engine.streams)
                if previous is False:
                    t += a.switch_draft * plain_t
                t += a.catch_up * max(width - 2, 0) * plain_t
                kept = [int(self.keeps(s.row, s.out)) for s in engine.streams]
                for s, k in zip(engine.streams, kept):
                    s.out, s.pend_t = min(s.out + 1 + k, a.max_tokens), [0] * (k + 1)
                record = StepLog(list(range(B)), kept, True, t, after_join=first, head_width=width)
            else:
                if previous is not False:
                    t += a.switch_plain * plain_t
                for s in engine.streams:
                    s.out, s.pend_t = s.out + 1, s.pend_t + [0]
                record = StepLog(list(range(B)), [-1] * B, False, t, after_join=first,
                                 built_before=ahead_built, built_next=ahead)
            wall += t
            previous, ahead_built, first = draft, ahead, False
            if policy is not None:
                policy.observe(engine, record)
            engine.streams = [s for s in engine.streams if s.out < a.max_tokens]
            if not engine.streams:
                decided = None
        return C * (a.max_tokens - 1) / wall

    def calibration(self, C: int) -> Calibration:
        cal = Calibration(1)
        for B in range(1, C + 1):
            for drafted in (False, True):
                cal.seconds[(B, drafted)] = [self.noisy(self.cost(B, drafted)) * self.args.cal_bias for _ in range(8)]
            plain = self.cost(B, False)  # the first step of each kind after the other, as the decode pays it
            cal.switch[(B, False)] = [self.noisy(plain * (1 + self.args.switch_plain)) * self.args.cal_bias]
            cal.switch[(B, True)] = [self.noisy(self.cost(B, True) + self.args.switch_draft * plain) * self.args.cal_bias]
        return cal


def simulate(args, lines, C: int) -> dict:
    rates = {k: [] for k in ("plain", "mtp", "auto (turn4)", "auto", "auto, kept")}
    for run in range(args.runs):
        sim = Sim(args, lines, run)
        rates["plain"].append(sim.decode(C, False))
        rates["mtp"].append(sim.decode(C, True))
        old = DraftPolicy(optimism=0.0)  # as the oracle bench ran it: warmed once, shapes compiled on first use
        sim.decode(C, old, args.compile_ms)
        rates["auto (turn4)"].append(sim.decode(C, old, args.compile_ms))
        policy = DraftPolicy(calibration=sim.calibration(C), optimism=args.optimism)
        rates["auto"].append(sim.decode(C, policy))
        rates["auto, kept"].append(sim.decode(C, policy))
    mean = {k: statistics.mean(v) for k, v in rates.items()}
    best = max(mean["plain"], mean["mtp"])
    per_run = {k: sorted(r / max(p, m) for r, p, m in zip(v, rates["plain"], rates["mtp"]))
               for k, v in rates.items() if k.startswith("auto")}
    return {"concurrency": C, "tok_per_s": {k: round(v, 2) for k, v in mean.items()},
            "auto_vs_best": {k: round(mean[k] / best, 3) for k in per_run},
            "auto_vs_best_p10": {k: round(v[len(v) // 10], 3) for k, v in per_run.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("oracle", type=Path, help="oracle_27b.py --stage batched JSON")
    ap.add_argument("--accept", type=float, default=0.8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--noise", type=float, default=0.04, help="sd of a step's log cost")
    ap.add_argument("--catch-up", type=float, default=0.0117, help="plain steps per pending pair the head reads")
    ap.add_argument("--switch-draft", type=float, default=0.1)
    ap.add_argument("--switch-plain", type=float, default=0.25)
    ap.add_argument("--cal-bias", type=float, default=0.97)
    ap.add_argument("--compile-ms", type=float, default=150.0)
    ap.add_argument("--optimism", type=float, default=1.0, help="the calibrated policy's (DraftPolicy.optimism)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    points, lines = cost_lines(json.loads(args.oracle.read_text()))
    rows = [simulate(args, lines, C) for C in sorted(points)]
    print("| streams | plain | mtp | auto (turn4) | auto | auto, kept | auto / best: turn4, first, kept | 10th pct |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        t, v, p = r["tok_per_s"], r["auto_vs_best"], r["auto_vs_best_p10"]
        print(f"| {r['concurrency']} | {t['plain']:.1f} | {t['mtp']:.1f} | {t['auto (turn4)']:.1f} | {t['auto']:.1f} | "
              f"{t['auto, kept']:.1f} | {v['auto (turn4)']}, {v['auto']}, {v['auto, kept']} | "
              f"{p['auto (turn4)']}, {p['auto']}, {p['auto, kept']} |")
    if args.json:
        out = {"input": str(args.oracle), "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "cost_lines_ms": lines, "rows": rows}
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
