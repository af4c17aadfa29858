"""MTP at a set acceptance on a 27B-shaped 4-bit model, and the CUDA multi-row quantized matvec.

Stages (``--stage``, repeatable, run in this order in one process; each writes its JSON as soon as
it is done, so a timeout keeps the finished ones):

``kernel``   ``cuda_qmv.calibrate_one`` on the 27B shapes (random 4-bit weights, no model): the stock
             ``mx.quantized_matmul`` and every kernel candidate at 1/2/3/4/8 rows, time and error
             against a float32 reference                                         -> kernel.json
``single``   ``mtpconvert.runtime.measure.bench`` with ``oracle=P...`` on an in-memory 27B-shaped
             model (``synth_mlx.build``): single-stream MTP vs mlx-lm's ``generate_step``, β, δ, ρ,
             predicted and measured speedup; with ``--cuda-qmv both`` once with the stock kernels,
             then again with ``cuda_qmv.enable`` (the kernel where calibration says it wins), plus
             the step costs with the kernel at 1 row too                         -> single.json
``batched``  ``oracle_batch.bench_concurrency_oracle``: batched MTP vs ``BatchGenerator`` at the
             given concurrencies                                                 -> batched.json

    python -m benchmarks.oracle_27b --stage kernel --stage single --out /tmp/o27 --cuda-qmv both
    python -m benchmarks.oracle_27b --stage batched --out /tmp/o27 --concurrency 1,2,4,8

Random weights: the oracle sets acceptance (docs/cuda.md "`bench --oracle-acceptance P`").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

from benchmarks import synth_mlx
from mtpconvert.runtime.decoding import cuda_qmv

# (name, N, K) of the 4-bit matmuls of a Qwen3.5-27B decoder layer and its LM head
SHAPES_27B = [("lm_head", 248320, 5120), ("mlp.gate_proj/up_proj", 17408, 5120), ("mlp.down_proj", 5120, 17408),
              ("self_attn.q_proj", 12288, 5120), ("self_attn.k_proj/v_proj", 1024, 5120),
              ("linear_attn.in_proj_qkv", 10240, 5120), ("linear_attn.out_proj", 5120, 6144),
              ("linear_attn.in_proj_a/b", 48, 5120)]


def TINY(tc):
    """--tiny: the same architecture at toy width, for a CPU smoke of this script."""
    tc.update(hidden_size=256, intermediate_size=512, vocab_size=1024, num_attention_heads=4, num_key_value_heads=2,
              head_dim=64, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=64,
              linear_value_head_dim=64)


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def stage_kernel(args) -> dict:
    entries = []
    for name, n, k in SHAPES_27B:
        w = (mx.random.normal((n, k), key=mx.random.key(n)) * 0.02).astype(mx.bfloat16)
        wq, s, b = mx.quantize(w, group_size=64, bits=4)
        mx.eval(wq, s, b)
        del w
        for rows in args.kernel_rows:
            ks = cuda_qmv.default_ks(n, k)
            configs = [cuda_qmv.Config("mma", ks, False), cuda_qmv.Config("mma", ks, True),
                       cuda_qmv.Config("simt", r=2)]
            if ks > 1:
                configs.append(cuda_qmv.Config("mma", ks // 2, True))
            if ks < 8 and n <= 20000:
                configs.append(cuda_qmv.Config("mma", ks * 2, True))
            e = cuda_qmv.calibrate_one(wq, s, b, 64, rows, configs)
            e.pop("best_config")
            e["name"] = name
            entries.append(e)
            c = {kk: v.get("ms", v.get("error")) for kk, v in e["candidates"].items()}
            log(f"{name} [{n}x{k}] rows={rows} stock {e['stock_ms']} ms (err {e['stock_err']:.2e}) -> {e['best']} {c}")
    return {"device": str(mx.default_device()), "device_info": _info(), "entries": entries,
            "tolerance": cuda_qmv.TOLERANCE}


def _info():
    try:
        return {k: str(v) for k, v in mx.device_info().items()}
    except Exception:  # noqa: BLE001
        return {}


def build(args):
    t0 = time.perf_counter()
    m = synth_mlx.build(args.model, args.layers, 4, root=args.layouts, config_edit=TINY if args.tiny else None)
    log(f"built {args.model} {args.layers or 'all'} layers 4-bit in {time.perf_counter() - t0:.1f} s; "
        f"backbone {synth_mlx.nbytes(m.model) / 1e9:.2f} GB, head {synth_mlx.nbytes(m.head) / 1e9:.2f} GB")
    vocab = m.backbone.vocab_size
    ids = mx.random.randint(0, vocab, (args.prompts, args.prompt_len), key=mx.random.key(1)).tolist()
    return m, ids


def _timed(label: str, run) -> dict:
    """``run()``'s result as JSON, labelled with the kernel it ran on and its wall time."""
    t0 = time.perf_counter()
    out = run().to_json()
    out["kernel"] = label
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def run_single(args, m, ids, label) -> dict:
    from mtpconvert.runtime.measure.bench import bench

    out = _timed(label, lambda: bench(Path(f"synthetic:{args.model}"), max_tokens=args.max_tokens,
                                      depths=args.depth, hiddens=("post-norm",), model=m, prompt_ids=ids,
                                      oracle=args.oracle))
    for r in out["rows"]:
        c = r["costs"]
        log(f"[{label}] k={r['depth']} oracle P={r['oracle_acceptance']}: acceptance {r['mtp']['acceptance']:.3f} "
            f"tok/step {r['mtp']['tokens_per_step']} mlx-lm {r['plain']['decode_tok_per_s']} tok/s, MTP "
            f"{r['mtp']['decode_tok_per_s']} tok/s, speedup {r['speedup']} (pred {r['predicted_speedup']}), "
            f"β {c['beta']} δ {c['delta']} ρ {c['rho']} (decode {c['decode_1_ms']} ms, verify {c['verify_ms']} ms), "
            f"misses {r['oracle']['reference_misses']}, identical {r.get('greedy_identical_to_mlx_lm')}")
    return out


def stage_single(args, m, ids) -> dict:
    from mtpconvert.runtime.measure.bench import measure_step_costs

    out = {"model": args.model, "layers": args.layers or "all", "bits": 4, "prompts": args.prompts,
           "prompt_len": args.prompt_len, "runs": []}
    if args.cuda_qmv in ("off", "both"):
        out["runs"].append(run_single(args, m, ids, "stock"))
        _write(args, "single.json", out)
    if args.cuda_qmv in ("on", "both") and cuda_qmv.available():
        t0 = time.perf_counter()
        rows = sorted({d + 1 for d in args.depth})
        entries = cuda_qmv.enable(m.model, m.head, rows=rows)
        out["calibration_s"] = round(time.perf_counter() - t0, 1)
        out["calibration"] = entries
        log(f"calibrated rows {rows} in {out['calibration_s']} s: "
            + ", ".join(f"{e['n']}x{e['k']}@{e['rows']}={e['best']}" for e in entries))
        out["runs"].append(run_single(args, m, ids, "cuda_qmv"))
        _write(args, "single.json", out)
        # the same step costs with the kernel at one row too (decode steps), where it wins there
        entries1 = cuda_qmv.calibrate([m.model, m.head], rows=(1,))
        out["calibration_rows1"] = entries1
        ctx = ids[0] + [1] * (args.max_tokens // 2)
        out["costs_kernel_all_rows"] = [measure_step_costs(m, ctx, d).to_json() for d in args.depth]
        log("kernel at 1 row too:", out["costs_kernel_all_rows"])
        cuda_qmv.PLAN.clear()
        cuda_qmv.disable(m.model, m.head)
    return out


def stage_batched(args, m, ids) -> dict:
    from mtpconvert.runtime.measure.oracle_batch import bench_concurrency_oracle

    out = {"model": args.model, "layers": args.layers or "all", "bits": 4, "runs": []}
    kernels = {"off": ["stock"], "on": ["cuda_qmv"], "both": ["stock", "cuda_qmv"]}[args.batched_cuda_qmv]
    for label in kernels:
        if label == "cuda_qmv":
            if not cuda_qmv.available():
                continue
            out["calibration"] = cuda_qmv.enable(m.model, m.head, rows=list(range(2, 9)))
        done, start = [], time.perf_counter()  # rows so far, logged and written as each ends: a cut run keeps them

        def on_row(row, label=label, done=done):
            r = row.to_json()
            d = r["decoders"]
            log(f"[{label}] k={r['depth']} C={r['concurrency']} P={r['oracle_acceptance']}: BatchGenerator "
                f"{d['batchgen']['aggregate_tok_per_s']} plain {d['plain']['aggregate_tok_per_s']} MTP "
                f"{d['mtp']['aggregate_tok_per_s']} tok/s, speedup {r['speedup_mtp']} (pred {r['predicted_speedup']}),"
                f" β {r['costs']['beta']} δ {r['costs']['delta']}, accept {d['mtp']['acceptance_by_stream']}; auto "
                f"{d['auto']['aggregate_tok_per_s']} tok/s ({d['auto']['drafted_steps']}/{d['auto']['steps']} drafted), "
                f"auto / best {r['auto_vs_best']} (paired {r.get('auto_vs_best_paired')}), plain / BatchGenerator "
                f"paired {r.get('plain_vs_batchgen_paired')}, calibration {r['calibration_s']} s "
                f"{d['auto']['policy_calibration_ms']}, policy {d['auto']['policy_step_ms']} "
                f"tokens/row {d['auto']['policy_tokens_per_row']} ({time.perf_counter() - start:.0f} s)")
            done.append(r)
            _write(args, "batched.json", dict(out, runs=out["runs"] + [{"kernel": label, "rows": done, "partial": True}]))

        j = _timed(label, lambda: bench_concurrency_oracle(m, f"synthetic:{args.model}", ids, args.concurrency,
                                                           args.oracle, max_tokens=args.max_tokens,
                                                           depths=args.depth, on_row=on_row, rounds=args.rounds))
        out["runs"].append(j)
        _write(args, "batched.json", out)
    return out


def _write(args, name, obj):
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / name).write_text(json.dumps(obj, indent=1, default=str))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", action="append", choices=["kernel", "single", "batched"], required=True)
    ap.add_argument("--model", default="Qwen3.5-27B")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: all, 64 for 27B)")
    ap.add_argument("--layouts", type=Path, default=None)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--depth", type=int, action="append", help="MTP depth (repeat); default 1")
    ap.add_argument("--oracle", type=float, action="append", help="oracle acceptance P (repeat); default 0.6 0.8 0.9")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=1, help="batched stage: timed runs per decoder (balanced order)")
    ap.add_argument("--cuda-qmv", choices=["off", "on", "both"], default="both", help="single stage")
    ap.add_argument("--batched-cuda-qmv", choices=["off", "on", "both"], default="off")
    ap.add_argument("--kernel-rows", default="1,2,3,4,8")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--tiny", action="store_true", help="toy widths (a CPU smoke of the script)")
    args = ap.parse_args(argv)
    args.depth = args.depth or [1]
    args.oracle = args.oracle or [0.6, 0.8, 0.9]
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.kernel_rows = [int(c) for c in args.kernel_rows.split(",")]
    log("device", mx.default_device(), _info())
    m = ids = None
    for stage in args.stage:
        t0 = time.perf_counter()
        if stage == "kernel":
            _write(args, "kernel.json", stage_kernel(args))
        else:
            if m is None:
                m, ids = build(args)
            if stage == "single":
                _write(args, "single.json", stage_single(args, m, ids))
            else:
                _write(args, "batched.json", stage_batched(args, m, ids))
        log(f"stage {stage} done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
