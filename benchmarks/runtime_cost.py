"""MTP runtime cost on a large-shaped model with random weights: beta, delta and loop overhead.

Writes a synthetic raw checkpoint shaped like a published release (``synth.py``, first
``--layers`` decoder layers plus the MTP head), converts it with ``mtpconvert convert``
(timed), then runs ``mtpconvert.runtime.measure.bench`` on random prompt ids. Random weights make
acceptance meaningless, so the script reports the step costs (beta = verify pass / decode
step, delta = head steps / decode step, rho = undo after a rejection / decode step, the
loop's own overhead) and the speedup they imply at given acceptance rates: tokens per step
= 1 + a + ... + a^k for per-draft acceptance a.

    python -m benchmarks.runtime_cost Qwen3.5-27B /tmp/rt27 --layers 16 --bits 4 --depth 1 --depth 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import synth


def implied_speedup(beta: float, delta: float, rho: float, alpha: float, depth: int) -> float:
    """Expected tokens per step over the step's cost, drafts accepted independently at ``alpha``.

    A step costs beta + delta decode steps, plus rho when one of its ``depth`` drafts is rejected.
    """
    return sum(alpha ** i for i in range(depth + 1)) / (beta + delta + (1 - alpha ** depth) * rho)


def stock_forward_ms(m, context, max_tokens: int) -> dict:
    """mlx-lm's own forward of 1..max_tokens tokens at a fixed context: the floor for beta.

    If a stock 2-token pass already costs ~beta decode steps, beta comes from the backend's
    kernels for more than one row, not from the runtime's state recording.
    """
    import mlx.core as mx

    from mtpconvert.runtime.measure.bench import context_restorer, timed

    cache = m.model.make_cache()
    mx.eval(m.model(mx.array([list(context)]), cache=cache))
    restore = context_restorer(cache)
    out = {}
    for n in range(1, max_tokens + 1):
        toks = mx.array([list(context[-n:])])

        def step():
            logits = m.model(toks, cache=cache)
            mx.eval(logits)
            restore(n)
            return logits

        out[n] = round(1e3 * timed(step, 20), 3)
    return out


def quantized_matmul_ms(m, max_rows: int) -> dict:
    """One of the model's largest quantized projections applied to 1..max_rows rows."""
    import mlx.core as mx
    import mlx.nn as nn

    from mtpconvert.runtime.measure.bench import timed

    layers = [mod for _, mod in m.model.named_modules() if isinstance(mod, nn.QuantizedLinear)]
    if not layers:
        return {}
    big = max(layers, key=lambda q: q.weight.size)
    big = next(q for q in layers if q.weight.shape == big.weight.shape)
    in_dims = big.weight.shape[1] * 32 // big.bits
    out = {"shape": [big.weight.shape[0], in_dims], "bits": big.bits}
    for rows in range(1, max_rows + 1):
        x = mx.random.normal((1, rows, in_dims)).astype(mx.bfloat16)
        fn = lambda: [big(x) for _ in range(10)]  # noqa: E731
        out[rows] = round(1e3 * timed(fn, 20) / 10, 4)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a folder under the layouts, e.g. Qwen3.5-27B")
    ap.add_argument("work", type=Path, help="scratch folder: raw/ and mlx/ are made here (reused if present)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--bits", type=int, default=4, help="backbone bits; 0 keeps the source dtype")
    ap.add_argument("--depth", type=int, action="append", help="MTP depth (repeat); default 1")
    ap.add_argument("--prompts", type=int, default=2, help="random prompts")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--alpha", type=float, action="append", help="acceptance rates to predict at (repeat)")
    ap.add_argument("--layouts", type=Path, default=synth.layouts.LAYOUTS)
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    depths = args.depth or [1]
    alphas = args.alpha or [0.6, 0.8, 0.9]

    raw, out = args.work / "raw", args.work / "mlx"
    result = {"model": args.model, "layers": args.layers, "bits": args.bits}
    if not (raw / "config.json").exists():
        t0 = time.perf_counter()
        result["synth"] = synth.write(args.model, raw, args.layers, 4.0, sparse=False, root=args.layouts)
        result["synth"]["seconds"] = round(time.perf_counter() - t0, 1)
    if not (out / "config.json").exists():
        cmd = [sys.executable, "-m", "mtpconvert", "convert", str(raw), str(out), "--no-smoke"]
        cmd += ["--bits", str(args.bits)] if args.bits else []
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True)
        result["convert_s"] = round(time.perf_counter() - t0, 1)

    import mlx.core as mx

    from mtpconvert.runtime.decoding.load import load
    from mtpconvert.runtime.measure.bench import bench

    m = load(out)
    vocab = m.backbone.vocab_size
    ids = mx.random.randint(0, vocab, (args.prompts, args.prompt_len), key=mx.random.key(0)).tolist()
    res = bench(out, max_tokens=args.max_tokens, depths=depths, hiddens=("post-norm",), model=m, prompt_ids=ids)
    result["device"] = str(mx.default_device())
    result["peak_memory_gb"] = round(mx.get_peak_memory() / 2**30, 2)
    rows = []
    print(f"{'k':>2} {'decode ms':>9} {'verify ms':>9} {'undo ms':>8} {'head ms':>8} {'beta':>5} {'delta':>5} "
          f"{'rho':>5} {'b+d':>5} "
          f"{'ovh':>5} {'mlx-lm tok/s':>12} {'loop tok/s':>10}  implied speedup at " + " ".join(f"a={a:g}" for a in alphas))
    for r in res.rows:
        c = r.costs
        implied = {f"{a:g}": round(implied_speedup(c.beta, c.delta, c.rho, a, r.depth), 3) for a in alphas}
        rows.append({**r.to_json(), "implied_speedup": implied})
        print(f"{r.depth:>2} {1e3 * c.decode_1:9.2f} {1e3 * c.verify:9.2f} {1e3 * c.undo:8.2f} {1e3 * c.head:8.2f} "
              f"{c.beta:5.2f} {c.delta:5.2f} {c.rho:5.2f} {c.beta + c.delta:5.2f} {r.overhead:5.1%} "
              f"{r.plain.decode_tps:12.1f} {r.plain_loop.decode_tps:10.1f}  "
              + " ".join(f"{v:5.2f}x" for v in implied.values()))
    result["rows"] = rows
    result["stock_forward_ms"] = stock_forward_ms(m, ids[0], max(depths) + 1)
    result["quantized_matmul_ms"] = quantized_matmul_ms(m, max(depths) + 1)
    print("stock forward (plain cache), ms by tokens per pass:", result["stock_forward_ms"])
    print("one quantized matmul, ms by rows:", result["quantized_matmul_ms"])
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
