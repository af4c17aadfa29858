"""Replay ``DraftPolicy`` offline on step times measured on a machine: what ``auto`` reaches against
the better fixed choice when step costs are those of a real run but drawn independently.

Input: JSON written by ``auto_steps.py --json`` (its timed ``plain`` and ``mtp`` runs give each
kind's step times at the batch's full size). Each replayed decode runs the policy over a fake batch
of that size: a step of the kind it picks costs a time drawn from that kind's measured steps, plus
a switch cost when the kind changes (``--switch-plain``, ``--switch-draft``: what ``auto_steps.py``
measured as the extra of the first step after a switch), times the machine's speed (``--drift LO,HI``:
piecewise constant over 50-300 steps, log-uniform in [LO, HI]; default 1,1: none). A drafting row
keeps its draft with probability ``--accept``. As in the benches, the policy is warmed by one
untimed decode and kept for the timed one; always-plain and always-draft decode under the same
draws. Prints tok/s of each and auto / best fixed, with the policy's step cost as it is (median of
its last timed steps) and as the fastest of them.

    python -m benchmarks.auto_replay benchmarks/results/batched/gpu_auto_steps_dense_c4.json --accept 0.84 --accept 0.6
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from pathlib import Path
from types import SimpleNamespace

from mtpconvert.runtime.decoding.batched import DraftPolicy, StepLog, Stream


class Fixed:
    """Always the same kind (the fixed choices)."""

    def __init__(self, draft: bool):
        self.draft = draft

    def choose(self, engine) -> bool:
        return self.draft

    def observe(self, engine, record) -> None:
        pass


class Fastest(DraftPolicy):
    """The policy costing a kind by the fastest of its last timed steps instead of their median."""

    step_cost = staticmethod(min)


def step_times(path: Path):
    """(batch size, plain step seconds, drafting step seconds) from an ``auto_steps.py`` JSON."""
    report = json.loads(path.read_text())
    B = max(s["B"] for s in report["plain"][0]["steps"])
    kind = lambda mode: [s["ms"] / 1e3 for s in report[mode][0]["steps"][2:] if s["B"] == B]  # noqa: E731
    return B, kind("plain"), kind("mtp")


def decode(policy, B, plain, draft, accept, tokens, rng, speed, switch_plain, switch_draft):
    """One decode of ``tokens`` per row; returns (tokens emitted, seconds)."""
    engine = SimpleNamespace(depth=1, streams=[Stream([1], tokens) for _ in range(B)])
    emitted, wall, previous, plain_run = 0, 0.0, None, 0
    while emitted < tokens * B:
        drafted = policy.choose(engine)
        first = previous is None
        if drafted:
            kept = [int(rng.random() < accept) for _ in range(B)]
            t = rng.choice(draft) + (switch_draft if previous is False else 0.0)
            record = StepLog(list(range(B)), kept, True, 0.0, head_width=40 if first else plain_run + 2,
                             after_join=first)
            emitted, plain_run = emitted + B + sum(kept), 0
        else:
            t = rng.choice(plain) + (switch_plain if previous is True else 0.0)
            record = StepLog(list(range(B)), [-1] * B, False, 0.0, after_join=first,
                             built_before=previous is False, built_next=True)
            emitted, plain_run = emitted + B, plain_run + 1
        record.seconds = t * speed()
        wall += record.seconds
        previous = drafted
        for s in engine.streams:  # the pairs the head reads at the next drafting step
            s.pend_t = [0] * (plain_run + 2)
        policy.observe(engine, record)
    return emitted, wall


def replay(path: Path, accept: float, runs: int, tokens: int, drift, switch_plain: float, switch_draft: float) -> dict:
    B, plain, draft = step_times(path)
    lo, hi = drift
    rates = {}
    for name, make in (("auto", DraftPolicy), ("auto, fastest step", Fastest), ("plain", lambda: Fixed(False)),
                       ("mtp", lambda: Fixed(True))):
        out = []
        for i in range(runs):  # every decoder sees run i's draws
            rng, speed_rng, state = random.Random(i), random.Random(10_000 + i), {"f": 1.0, "left": 0}

            def speed():
                if state["left"] <= 0:
                    state["f"] = math.exp(speed_rng.uniform(math.log(lo), math.log(hi)))
                    state["left"] = speed_rng.randint(50, 300)
                state["left"] -= 1
                return state["f"]

            policy = make()
            decode(policy, B, plain, draft, accept, tokens, rng, speed, switch_plain, switch_draft)
            emitted, wall = decode(policy, B, plain, draft, accept, tokens, rng, speed, switch_plain, switch_draft)
            out.append(emitted / wall)
        rates[name] = statistics.mean(out)
    best = max(rates["plain"], rates["mtp"])
    return {"file": path.name, "rows": B, "accept": accept, "drift": list(drift),
            "tok_per_s": {k: round(v, 1) for k, v in rates.items()},
            "auto_vs_best": round(rates["auto"] / best, 3),
            "auto_fastest_step_vs_best": round(rates["auto, fastest step"] / best, 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("steps", type=Path, nargs="+", help="auto_steps.py JSON")
    ap.add_argument("--accept", type=float, action="append", help="draft acceptance (repeat); default 0.84")
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=383)
    ap.add_argument("--drift", default="1,1", help="LO,HI of the machine's speed factor (default 1,1: none)")
    ap.add_argument("--switch-plain", type=float, default=0.0021, help="extra seconds of a plain step after drafting")
    ap.add_argument("--switch-draft", type=float, default=0.001, help="extra seconds of a drafting step after plain")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    drift = tuple(float(x) for x in args.drift.split(","))
    rows = [replay(path, accept, args.runs, args.max_tokens, drift, args.switch_plain, args.switch_draft)
            for path in args.steps for accept in (args.accept or [0.84])]
    print("| steps | rows | acceptance | drift | plain tok/s | mtp tok/s | auto tok/s | auto / best | "
          "auto (fastest-step cost) / best |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        t = r["tok_per_s"]
        print(f"| {r['file']} | {r['rows']} | {r['accept']} | {r['drift'][0]:g}–{r['drift'][1]:g} | {t['plain']:.0f} | "
              f"{t['mtp']:.0f} | {t['auto']:.0f} | {r['auto_vs_best']} | {r['auto_fastest_step_vs_best']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
