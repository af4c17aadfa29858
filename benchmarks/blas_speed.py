"""How fast are the CPU kernels MLX runs the smoke with, under the BLAS this process has mapped?

    python -m benchmarks.blas_speed [--size 2048] [--rows 288] [--json]
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python -m benchmarks.blas_speed

Prints GFLOP/s of ``mx.matmul`` in float32 (BLAS ``sgemm``) and bfloat16 (MLX's own loop), of a 4-bit
``mx.quantized_matmul`` (MLX's own kernel: no BLAS under it) over ``--rows`` rows and over one row, and of
numpy's float32 matmul (numpy's bundled OpenBLAS) on the same matrices, with the BLAS libraries mapped
into the process (``/proc/self/maps``). ``mtpconvert.blas.describe()`` says what the CLI would preload.
"""

from __future__ import annotations

import argparse
import json
import time


def best_rate(fn, flop: float, repeat: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return flop / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=2048, help="n of the n x n x n float GEMMs")
    ap.add_argument("--rows", type=int, default=288, help="rows of the quantized matmul (the smoke's 3 x 96 tokens)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import mlx.core as mx
    import numpy as np

    from mtpconvert.blas import mapped_blas

    n = args.size
    a = mx.random.normal((n, n), key=mx.random.key(0))
    b = mx.random.normal((n, n), key=mx.random.key(1))
    out = {"mapped_blas": mapped_blas(), "size": n, "rows": args.rows}
    flop = 2.0 * n ** 3
    out["mx_f32_gflops"] = best_rate(lambda: mx.eval(a @ b), flop, args.repeat)
    a16, b16 = a.astype(mx.bfloat16), b.astype(mx.bfloat16)
    out["mx_bf16_gflops"] = best_rate(lambda: mx.eval(a16 @ b16), flop, args.repeat)
    wq, scales, biases = mx.quantize(b, group_size=64, bits=4)
    for rows, key in ((args.rows, "mx_q4_gflops"), (1, "mx_q4_1row_gflops")):
        x = a[:rows]
        out[key] = best_rate(lambda: mx.eval(mx.quantized_matmul(x, wq, scales, biases, transpose=True,
                                                                 group_size=64, bits=4)),
                             2.0 * rows * n * n, args.repeat)
    an, bn = np.array(a), np.array(b)
    out["numpy_f32_gflops"] = best_rate(lambda: an @ bn, flop, args.repeat)
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"BLAS mapped: {', '.join(out['mapped_blas']) or '(none)'}")
    print(f"mx.matmul float32 {n}^3      {out['mx_f32_gflops']:8.1f} GFLOP/s")
    print(f"mx.matmul bfloat16 {n}^3     {out['mx_bf16_gflops']:8.1f} GFLOP/s")
    print(f"quantized_matmul 4-bit {args.rows}x{n}x{n}  {out['mx_q4_gflops']:8.2f} GFLOP/s")
    print(f"quantized_matmul 4-bit 1x{n}x{n}  {out['mx_q4_1row_gflops']:8.2f} GFLOP/s")
    print(f"numpy float32 {n}^3          {out['numpy_f32_gflops']:8.1f} GFLOP/s")


if __name__ == "__main__":
    main()
