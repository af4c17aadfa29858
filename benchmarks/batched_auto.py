"""Does `auto` keep up with the best fixed choice, and does the plain engine keep up with mlx-lm's
BatchGenerator? `bench --concurrency` (runtime/measure/batch_bench.py) on one converted text fixture,
each decoder's timed run repeated ``--rounds`` times interleaved (median reported), then one
markdown row per (depth, streams): aggregate tok/s of BatchGenerator, the plain engine, every row
drafting (mtp) and `auto`, auto / best fixed choice, plain / BatchGenerator (each as the ratio of the
medians, then in brackets the median of the same ratio taken within each round), the same two
ratios in tokens per CPU second of the process (paired per round: what a decode costs, robust to
other jobs on a shared machine, blind to overlap), the drafted steps of auto's median run, and
whether every greedy stream equalled the plain engine's. The best fixed choice of a row is the fixed
decoder (BatchGenerator, plain, mtp) with the best median, one choice for all its rounds
(``batch_bench.paired_ratio``).

Then one pooled line: geometric means over every round of every row of within-round ratios.

    python -m benchmarks.batched_auto OUT [--variant dense] [--concurrency 1,2,4,8] [--depth 1 --depth 2]
        [--max-tokens 64] [--rounds 3] [--json out.json] [--step-logs] [--settle-ms 0]
    python -m benchmarks.batched_auto --saved RESULT.json [RESULT.json ...]   # the table and pooled line of saved runs
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from pathlib import Path

import mlx.core as mx

from mtpconvert.fixture.text import heldout_prompts, text_fixture_path
from mtpconvert.runtime.decoding.load import load
from mtpconvert.runtime.measure.batch_bench import auto_vs_best, bench_concurrency, paired_ratio


FIXED = ("batchgen", "plain", "mtp")


def _rounds(row: dict, name: str, cpu: bool = False) -> list:
    return row["decoders"][name]["tok_per_cpu_s_rounds" if cpu else "aggregate_tok_per_s_rounds"]


def table(report: dict, label: str) -> str:
    """One markdown row per (depth, streams) of a ``bench_concurrency`` JSON report."""
    lines = ["| fixture | k | streams | BatchGenerator | plain engine | mtp | auto (drafted steps) | auto / best | "
             "plain / BatchGenerator | per CPU second: auto / best, plain / BatchGenerator | greedy = plain |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in report["rows"]:
        tps = {n: d["aggregate_tok_per_s"] for n, d in row["decoders"].items()}
        auto = row["decoders"]["auto"]
        greedy = row.get("greedy_identical_to_plain_engine", {})
        same = "yes" if all(greedy.values()) else "no: " + ",".join(n for n, ok in greedy.items() if not ok)
        cells = []
        for cpu in (False, True):
            fixed = {n: _rounds(row, n, cpu) for n in FIXED}
            cells.append((paired_ratio(_rounds(row, "auto", cpu), fixed),
                          paired_ratio(_rounds(row, "plain", cpu), {"batchgen": fixed["batchgen"]})))
        ratios = [f"{a:.2f}" + (f" ({p:.2f})" if p is not None else "")
                  for a, p in zip((auto_vs_best(tps["auto"], *(tps[n] for n in FIXED)), tps["plain"] / tps["batchgen"]),
                                  cells[0])]
        cpu = ", ".join("-" if x is None else f"{x:.2f}" for x in cells[1])
        lines.append(f"| {label} | {row['depth']} | {row['concurrency']} | {tps['batchgen']:.0f} | {tps['plain']:.0f} | "
                     f"{tps['mtp']:.0f} | {tps['auto']:.0f} ({auto['drafted_steps']}/{auto['steps']}) | "
                     f"{ratios[0]} | {ratios[1]} | {cpu} | {same} |")
    return "\n".join(lines)


def pooled(report: dict) -> dict:
    """Geometric means, over every round of every row of a saved ``bench_concurrency`` JSON, of the
    within-round ratios named by the keys; "best fixed" is each row's fixed decoder with the best median."""
    ratios: dict = {}
    for row in report["rows"]:
        rounds = {name: _rounds(row, name) for name in row["decoders"]}
        best = max(FIXED, key=lambda n: statistics.median(rounds[n]))
        for i in range(len(rounds["plain"])):
            pairs = {"auto / best fixed": rounds["auto"][i] / rounds[best][i],
                     "auto / plain": rounds["auto"][i] / rounds["plain"][i],
                     "auto / BatchGenerator": rounds["auto"][i] / rounds["batchgen"][i],
                     "auto / mtp": rounds["auto"][i] / rounds["mtp"][i],
                     "plain / BatchGenerator": rounds["plain"][i] / rounds["batchgen"][i]}
            cpu = {name: _rounds(row, name, cpu=True) for name in ("auto", "plain")}
            pairs["auto / plain per CPU second"] = cpu["auto"][i] / cpu["plain"][i]
            for k, v in pairs.items():
                ratios.setdefault(k, []).append(math.log(v))
    return {k: round(math.exp(sum(v) / len(v)), 3) for k, v in ratios.items()}


def busy(ms: float):
    """A ``settle`` for ``bench_concurrency``: square a 4096 x 4096 matrix for ``ms`` milliseconds."""
    x = mx.random.normal((4096, 4096)).astype(mx.bfloat16)

    def settle() -> None:
        end = time.perf_counter() + ms / 1e3
        while time.perf_counter() < end:
            mx.eval(x @ x)
    return settle


def running_on() -> int:
    """The CPU this thread last ran on (field 39 of /proc/thread-self/stat), -1 where there is none."""
    try:
        return int(Path("/proc/thread-self/stat").read_text().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return -1


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
    ap.add_argument("--step-logs", action="store_true",
                    help="keep every round's steps of the engine's decoders in the JSON ([B, drafted, head width, ms])")
    ap.add_argument("--settle-ms", type=float, default=0.0,
                    help="before every timed run, keep the device busy this long (large matmuls), so no run starts "
                         "from an idle device (on the H200 the SM clock stayed at its maximum either way)")
    ap.add_argument("--saved", type=Path, nargs="+", default=None,
                    help="print the table (labelled --label) and pooled line of saved JSON and exit")
    args = ap.parse_args(argv)
    if args.saved:
        for f in args.saved:
            report = json.loads(f.read_text())
            print(table(report, args.label or f.stem), "\npooled:", pooled(report), sep="\n")
        return 0
    m = load(args.folder)
    _, ids, _ = heldout_prompts(text_fixture_path(args.variant), per_file=1, prompt_tokens=32, files=8)
    timeline: list = []  # (wall clock, what starts): to lay the runs beside the device's own samples

    def progress(step) -> None:
        timeline.append([round(time.time(), 4), step.detail, running_on()])

    t0 = time.perf_counter()
    result = bench_concurrency(m, str(args.folder), ids, [int(c) for c in args.concurrency.split(",")],
                               args.max_tokens, args.depth or [1], rounds=args.rounds, progress=progress,
                               settle=busy(args.settle_ms) if args.settle_ms else None)
    report = result.to_json(step_logs=args.step_logs)
    report["rounds"] = args.rounds
    report["settle_ms"] = args.settle_ms
    if args.step_logs:
        report["timeline"] = timeline
    print(table(report, args.label or args.variant), flush=True)
    print(f"({time.perf_counter() - t0:.0f} s; {mx.default_device()}, {platform.node()})", flush=True)
    print("pooled:", pooled(report), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
