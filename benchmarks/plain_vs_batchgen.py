"""Is the plain batched engine BatchGenerator's equal, and does running on BatchGenerator's stream matter?

On one converted text fixture, at each concurrency C, C greedy streams of the held-out prompts decode
``--max-tokens`` tokens each with mlx-lm's ``BatchGenerator``, the plain batched engine on mlx-lm's
``generation_stream`` (``run_batch``'s default, BatchGenerator's stream) and the plain engine on the device's
default stream, ``--rounds`` times in the balanced order (``batch_bench.timed_rounds``) after an untimed run of
each. Per decoder: the median round's aggregate tok/s, the median step (BatchGenerator: the interval between
two ``next()`` returns; the engine: its steps' times, which for a pipelined step count from the end of the one
before), and each ratio to BatchGenerator as the median over rounds of the within-round ratio (aggregate
tok/s, tokens per CPU second).

    python -m benchmarks.plain_vs_batchgen FOLDER --variant moe --concurrency 1,2,4,8 --max-tokens 192 --rounds 10
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx

from mtpconvert.fixture.text import heldout_prompts, text_fixture_path
from mtpconvert.runtime.decoding.batched import Stream, run_batch
from mtpconvert.runtime.decoding.load import load
from mtpconvert.runtime.measure.baseline import mlx_lm_sampler
from mtpconvert.runtime.decoding.sampling import Sampling
from mtpconvert.runtime.measure.batch_bench import DecoderRun, paired_ratio, timed_rounds


def batchgen(m, prompts, max_tokens: int) -> DecoderRun:
    """``batch_bench.batchgen_decode``, with the time of every ``next()`` return kept (``steps_s``)."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(m.model, max_tokens=max_tokens, sampler=mlx_lm_sampler(Sampling()),
                         prefill_batch_size=len(prompts), completion_batch_size=len(prompts))
    stamps, tokens = [], [[] for _ in prompts]
    first, done = [0.0] * len(prompts), [0.0] * len(prompts)
    try:
        row = {uid: i for i, uid in enumerate(gen.insert([list(p) for p in prompts], [max_tokens] * len(prompts)))}
        while sum(d > 0 for d in done) < len(prompts):
            _, responses = gen.next()
            now = time.perf_counter()
            if responses:
                stamps.append(now)
            for r in responses:
                i = row[r.uid]
                first[i] = first[i] or now
                tokens[i].append(int(r.token))
                if r.finish_reason is not None:
                    done[i] = now
    finally:
        gen.close()
    run = DecoderRun(tokens, first, done)
    run.step_ms = statistics.median(1e3 * (b - a) for a, b in zip(stamps[1:], stamps[2:]))
    return run


def engine(m, prompts, max_tokens: int, stream) -> DecoderRun:
    streams = [Stream(list(p), max_tokens, seed=i) for i, p in enumerate(prompts)]
    e = run_batch(m, streams, 1, "plain", stream=stream)
    run = DecoderRun([s.out for s in streams], [s.first_token_s for s in streams], [s.done_s for s in streams],
                     steps=len(e.log))
    run.step_ms = statistics.median(1e3 * r.seconds for r in e.log[1:])
    return run


def level(m, prompts, max_tokens: int, rounds: int) -> dict:
    default = mx.default_stream(mx.default_device())
    decoders = {"batchgen": lambda: batchgen(m, prompts, max_tokens),
                "plain": lambda: engine(m, prompts, max_tokens, None),
                "plain, default stream": lambda: engine(m, prompts, max_tokens, default)}
    for run in decoders.values():
        run()
    runs = timed_rounds(decoders, rounds)
    out = {"concurrency": len(prompts), "decoders": {}}
    for name, run in runs.items():
        out["decoders"][name] = dict(run.to_json(), median_step_ms=round(run.step_ms, 3))
        if name != "batchgen":
            out[f"{name} / batchgen"] = round(paired_ratio(run.rounds, {"b": runs["batchgen"].rounds}), 3)
            out[f"{name} / batchgen per CPU second"] = round(
                paired_ratio(run.cpu_rounds, {"b": runs["batchgen"].cpu_rounds}), 3)
    out["greedy_identical"] = runs["plain"].tokens == runs["batchgen"].tokens
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--variant", default="dense")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--same-length", action="store_true",
                    help="cut every prompt to the shortest one's length: rows then stay at one length (the engine's "
                         "uniform cache path) and BatchGenerator pads none")
    args = ap.parse_args(argv)
    m = load(args.folder)
    _, ids, _ = heldout_prompts(text_fixture_path(args.variant), per_file=1, prompt_tokens=32, files=8)
    if args.same_length:
        ids = [p[:min(len(q) for q in ids)] for p in ids]
    rows = []
    for c in (int(x) for x in args.concurrency.split(",")):
        rows.append(level(m, [ids[i % len(ids)] for i in range(c)], args.max_tokens, args.rounds))
        d = rows[-1]["decoders"]
        print(f"{args.variant} C={c}: " + ", ".join(f"{n} {v['aggregate_tok_per_s']} tok/s ({v['median_step_ms']} ms)"
                                                    for n, v in d.items())
              + " | " + ", ".join(f"{k} {v}" for k, v in rows[-1].items() if "/" in k), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"folder": str(args.folder), "device": str(mx.default_device()),
                                         "max_tokens": args.max_tokens, "rounds": args.rounds,
                                         "same_length": args.same_length, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
