"""GPU quantization gives the CPU kernel's bytes: ``ops.affine_quantize`` on the default device
(a GPU through MLX CUDA or Metal) against MLX's CPU ``mx.quantize``, and its cost there against
MLX's own GPU kernel.

Inputs: the edge-case groups of ``tests/quant_cases.py`` for every source/target dtype, width and
group size, then --blocks random bf16 blocks shaped like a conversion's ([1536, 5120], weights
~N(0, 0.02) with a few outliers). Exits 1 on any byte difference.

    python -m benchmarks.quantize_exact [--blocks 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import mlx.core as mx
import numpy as np
from tests.quant_cases import MX_DTYPES, TARGETS, edge_groups

from mtpconvert.execute.ops import affine_quantize


def as_bytes(arrays):
    return [np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes() for a in arrays]


def cpu_reference(w, bits, group):
    return mx.quantize(w, group_size=group, bits=bits, stream=mx.cpu)


def best_of(fn, n=5):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    report = {"device": str(mx.default_device()), "mlx": mx.__version__, "edge_cases": [], "blocks": []}
    differ = 0
    for source, target in itertools.product(MX_DTYPES, TARGETS):
        values = edge_groups(256, rng)
        if "float16" in (source, target) or source == "F16":
            values = np.clip(values, -6e4, 6e4)
        w = mx.array(values).astype(MX_DTYPES[source]).astype(TARGETS[target])
        for bits, group in itertools.product((2, 4, 8), (32, 64, 128)):
            same = as_bytes(affine_quantize(w, bits, group)) == as_bytes(cpu_reference(w, bits, group))
            mlx_gpu_same = as_bytes(mx.quantize(w, group_size=group, bits=bits)) == as_bytes(cpu_reference(w, bits, group))
            differ += not same
            report["edge_cases"].append({"source": source, "target": target, "bits": bits, "group": group,
                                         "exact": same, "mlx_default_device_exact": mlx_gpu_same})
    print(f"edge cases: {sum(c['exact'] for c in report['edge_cases'])}/{len(report['edge_cases'])} exact "
          f"(MLX's kernel on {mx.default_device()}: {sum(c['mlx_default_device_exact'] for c in report['edge_cases'])})")
    for i in range(args.blocks):
        v = rng.standard_normal((1536, 5120)).astype(np.float32) * 0.02
        v[rng.integers(0, 1536, 20), rng.integers(0, 5120, 20)] *= 50
        w = mx.array(v).astype(mx.bfloat16)
        for bits, group in ((4, 64), (8, 64), (2, 32), (4, 128)):
            same = as_bytes(affine_quantize(w, bits, group)) == as_bytes(cpu_reference(w, bits, group))
            differ += not same
            row = {"block": i, "bits": bits, "group": group, "exact": same}
            if i == 0:
                row["affine_quantize_ms"] = round(1e3 * best_of(lambda: affine_quantize(w, bits, group)), 3)
                row["mx_quantize_ms"] = round(1e3 * best_of(lambda: mx.quantize(w, group_size=group, bits=bits)), 3)
                print(json.dumps(row))
            report["blocks"].append(row)
    print(f"random blocks: {sum(b['exact'] for b in report['blocks'])}/{len(report['blocks'])} exact")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
