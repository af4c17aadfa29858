"""Does `auto` keep up with the best fixed choice, and does the plain engine keep up with mlx-lm's
BatchGenerator? `bench --concurrency` (runtime/measure/batch_bench.py) on one converted text fixture,
each decoder's timed run repeated ``--rounds`` times interleaved (median reported), then one
markdown row per (depth, streams): aggregate tok/s of BatchGenerator, the plain engine, every row
drafting (mtp) and `auto`, auto / best fixed choice, plain / BatchGenerator (each as the ratio of the
medians, then in brackets the median of the same ratio taken within each round), the same two
ratios in tokens per CPU second of the process (paired per round: what a decode costs, robust to
other jobs on a shared machine, blind to overlap), the drafted steps of auto's median run, and
whether every greedy stream equalled the plain engine's.

Then one pooled line: geometric means over every round of every row of within-round ratios. "x /
best in round" divides by the fastest fixed choice of that round; since that maximum picks up the
round's noise, a fixed decoder scores below 1 against it too, and plain's and BatchGenerator's
scores are printed beside auto's as the statistic's floor on this machine.

    python benchmarks/batched_auto.py OUT [--variant dense] [--concurrency 1,2,4,8] [--depth 1 --depth 2]
        [--max-tokens 64] [--rounds 3] [--json out.json]
    python benchmarks/batched_auto.py --pooled RESULT.json [RESULT.json ...]   # the pooled line of saved runs
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import mlx.core as mx

from mtpconvert.fixture.text import heldout_prompts, text_fixture_path
from mtpconvert.runtime.decoding.load import load
from mtpconvert.runtime.measure.batch_bench import bench_concurrency


def table(result, label: str) -> str:
    lines = ["| fixture | k | streams | BatchGenerator | plain engine | mtp | auto (drafted steps) | auto / best | "
             "plain / BatchGenerator | per CPU second: auto / best, plain / BatchGenerator | greedy = plain |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result.rows:
        tps = {n: run.aggregate_tps for n, run in r.runs.items()}
        auto = r.runs["auto"]
        same = "yes" if all(r.greedy_identical().values()) else "no: " + ",".join(
            n for n, ok in r.greedy_identical().items() if not ok)
        paired = (r.paired("auto", ("batchgen", "plain", "mtp")), r.paired("plain", ("batchgen",)))
        ratios = [f"{a:.2f}" + (f" ({p:.2f})" if p is not None else "")
                  for a, p in zip((r.auto_vs_best(), r.speedup("plain")), paired)]
        per_cpu = (r.paired("auto", ("batchgen", "plain", "mtp"), cpu=True), r.paired("plain", ("batchgen",), cpu=True))
        cpu = ", ".join("-" if x is None else f"{x:.2f}" for x in per_cpu)
        lines.append(f"| {label} | {r.depth} | {r.concurrency} | {tps['batchgen']:.0f} | {tps['plain']:.0f} | "
                     f"{tps['mtp']:.0f} | {tps['auto']:.0f} ({auto.drafted_steps}/{auto.steps}) | "
                     f"{ratios[0]} | {ratios[1]} | {cpu} | {same} |")
    return "\n".join(lines)


FIXED = ("batchgen", "plain", "mtp")


def pooled(report: dict) -> dict:
    """Geometric means, over every round of every row of a saved ``bench_concurrency`` JSON, of the
    within-round ratios named by the keys."""
    ratios: dict = {}
    for row in report["rows"]:
        rounds = {name: d["aggregate_tok_per_s_rounds"] for name, d in row["decoders"].items()}
        for i in range(len(rounds["plain"])):
            best = max(rounds[n][i] for n in FIXED)
            pairs = {"auto / plain": rounds["auto"][i] / rounds["plain"][i],
                     "auto / BatchGenerator": rounds["auto"][i] / rounds["batchgen"][i],
                     "auto / mtp": rounds["auto"][i] / rounds["mtp"][i],
                     "plain / BatchGenerator": rounds["plain"][i] / rounds["batchgen"][i]}
            pairs.update({f"{n} / best in round": rounds[n][i] / best for n in ("auto", "plain", "batchgen")})
            for k, v in pairs.items():
                ratios.setdefault(k, []).append(math.log(v))
    return {k: round(math.exp(sum(v) / len(v)), 3) for k, v in ratios.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path, nargs="?")
    ap.add_argument("--variant", default="dense", help="which text fixture's held-out prompts (dense, moe)")
    ap.add_argument("--label", default=None, help="the fixture column (default: the variant)")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--depth", type=int, action="append")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--pooled", type=Path, nargs="+", default=None, help="print the pooled line of saved JSON and exit")
    args = ap.parse_args(argv)
    if args.pooled:
        for f in args.pooled:
            print(f, pooled(json.loads(f.read_text())))
        return 0
    m = load(args.folder)
    _, ids, _ = heldout_prompts(text_fixture_path(args.variant), per_file=1, prompt_tokens=32, files=8)
    t0 = time.perf_counter()
    result = bench_concurrency(m, str(args.folder), ids, [int(c) for c in args.concurrency.split(",")],
                               args.max_tokens, args.depth or [1], rounds=args.rounds)
    print(table(result, args.label or args.variant), flush=True)
    print(f"({time.perf_counter() - t0:.0f} s; {mx.default_device()}, {platform.node()})", flush=True)
    report = result.to_json()
    report["rounds"] = args.rounds
    print("pooled:", pooled(report), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
