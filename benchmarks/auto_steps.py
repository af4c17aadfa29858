"""Where an ``auto`` batched decode's time goes: every step of a timed run (after the same warm-up
``bench --concurrency`` does), with its batch size, whether it drafted, the head's pass width and
its wall time; slow steps (> 3x the median of their kind) are listed, the steps are summed by
switch (a plain step after a drafting one, ...) beside the run's wall time, and each ``auto`` run
prints what its policy decided from.

    python -m benchmarks.auto_steps OUT [--concurrency 2] [--depth 1] [--max-tokens 128] [--repeat 2] [--calibrated]
        [--json out.json]

``--calibrated``: the policy starts from ``calibration.calibrate`` and its first decode is the first timed
``auto`` run, as ``bench --concurrency`` runs it (else an uncalibrated policy warmed by one untimed decode).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx

from mtpconvert.fixture.text import heldout_prompts, text_fixture_path
from mtpconvert.runtime.decoding.batched import DraftPolicy, Stream, run_batch
from mtpconvert.runtime.decoding.calibration import calibrate, warm_up
from mtpconvert.runtime.decoding.load import load
from mtpconvert.runtime.decoding.sampling import Sampling
from mtpconvert.runtime.measure.batch_bench import engine_decode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--variant", default="dense")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=1, help="timed auto runs, one policy (a slow step that recurs is not a compile)")
    ap.add_argument("--calibrated", action="store_true", help="the bench's calibrated policy (see the module doc)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    m = load(args.folder)
    _, ids, _ = heldout_prompts(text_fixture_path(args.variant), per_file=1, prompt_tokens=32, files=8)
    prompts = [ids[i % len(ids)] for i in range(args.concurrency)]
    greedy = Sampling()
    if mx.default_device() == mx.gpu:
        warm_up(m, args.depth, args.concurrency)
    for mode in ("plain", "mtp"):
        engine_decode(m, prompts, args.max_tokens, greedy, 0, args.depth, mode)
    if args.calibrated:
        policy = DraftPolicy(calibration=calibrate(m, args.depth, args.concurrency))
    else:
        policy = DraftPolicy()
        engine_decode(m, prompts, args.max_tokens, greedy, 0, args.depth, "auto", policy=policy)
    report = {}
    for mode in ("plain", "mtp") + ("auto",) * args.repeat:
        streams = [Stream(list(p), args.max_tokens) for p in prompts]
        start = time.perf_counter()
        engine = run_batch(m, streams, args.depth, mode, policy=policy if mode == "auto" else None)
        wall = 1e3 * (time.perf_counter() - start)
        steps = [{"B": len(r.streams), "drafted": r.drafted, "head_width": r.head_width, "ms": round(1e3 * r.seconds, 3),
                  "built_before": r.built_before, "built_next": r.built_next}
                 for r in engine.log]
        # steps by (this step drafted, the step before drafted): what a switch of kind costs
        by_switch = {}
        for before, s in zip(steps, steps[1:]):
            by_switch.setdefault(f"{'draft' if before['drafted'] else 'plain'}->{'draft' if s['drafted'] else 'plain'}",
                                 []).append(s["ms"])
        kinds = {}
        for s in steps:
            kinds.setdefault(s["drafted"], []).append(s["ms"])
        medians = {k: statistics.median(v) for k, v in kinds.items()}
        slow = [dict(s, step=i) for i, s in enumerate(steps) if s["ms"] > 3 * medians[s["drafted"]]]
        total = sum(s["ms"] for s in steps)
        switches = {k: (len(v), round(statistics.median(v), 2), round(sum(v), 1)) for k, v in sorted(by_switch.items())}
        print(f"{mode}: {len(steps)} steps, {total:.0f} ms in steps, {wall:.0f} ms wall; (steps, median ms, total ms) "
              f"by switch {switches}; median ms drafted/plain "
              f"{medians.get(True, 0):.2f}/{medians.get(False, 0):.2f}; slow steps {len(slow)} = "
              f"{sum(s['ms'] for s in slow):.0f} ms: {slow[:12]}"
              + (f"; policy {policy.to_json()}" if mode == "auto" else ""), flush=True)
        report.setdefault(mode, []).append({"steps": steps, "slow": slow, "total_ms": total, "wall_ms": wall,
                                            "by_switch": switches})
    if args.json:
        args.json.write_text(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
