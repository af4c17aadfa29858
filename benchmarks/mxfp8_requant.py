"""How much of a block-FP8 tensor survives MLX's ``mxfp8``: the question of whether a Qwen FP8 release can be kept
as MXFP8 without loss.

A release stores E4M3 codes and one inverse scale per 128x128 block (amax / 448: any bfloat16 value). MXFP8 stores
E4M3 codes and one power-of-two (E8M0) scale per 32 inputs. The release's exact values are requantized here with
``mx.quantize(..., mode="mxfp8")`` and read back: with the release's scales most values move; with the scales
rounded to powers of two none does (that form is carried as stored: DeepSeek-V4's E8M0 releases).

    python -m benchmarks.mxfp8_requant [--rows 512 --cols 1024 --seed 0] [--json OUT]
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
import numpy as np

BLOCK = 128


def block_fp8(weight: mx.array, scale_inv: mx.array) -> mx.array:
    """E4M3 codes of ``weight`` under one scale per 128x128 block, as a release stores them."""
    rows, cols = weight.shape
    blocks = weight.reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    return mx.to_fp8(blocks / scale_inv[:, None, :, None])


def values(codes: mx.array, scale_inv: mx.array) -> mx.array:
    """The exact float32 values the codes and block scales stand for."""
    decoded = mx.from_fp8(codes, dtype=mx.float32) * scale_inv[:, None, :, None]
    return decoded.reshape(codes.shape[0] * BLOCK, codes.shape[2] * BLOCK)


def mxfp8_change(exact: mx.array) -> dict:
    """Share of values an mxfp8 round trip changes, and their relative error."""
    packed, scales = mx.quantize(exact, group_size=32, bits=8, mode="mxfp8")
    back = mx.dequantize(packed, scales, group_size=32, bits=8, mode="mxfp8", dtype=mx.float32)
    exact_np, back_np = np.array(exact), np.array(back)
    changed = back_np != exact_np
    rel = np.abs(back_np - exact_np) / np.maximum(np.abs(exact_np), np.finfo(np.float32).tiny)
    return {"changed": float(changed.mean()),
            "median_rel_err_of_changed": float(np.median(rel[changed])) if changed.any() else 0.0,
            "max_rel_err": float(rel.max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the result here too")
    args = parser.parse_args()
    mx.random.seed(args.seed)
    weight = mx.random.normal((args.rows, args.cols)) * 0.02
    amax = mx.max(mx.abs(weight.reshape(args.rows // BLOCK, BLOCK, args.cols // BLOCK, BLOCK)), axis=(1, 3))
    release_scale = (amax / 448.0).astype(mx.bfloat16).astype(mx.float32)
    power_of_two_scale = mx.power(2.0, mx.ceil(mx.log2(amax / 448.0)))
    result = {}
    for name, scale in (("release_scales", release_scale), ("power_of_two_scales", power_of_two_scale)):
        result[name] = mxfp8_change(values(block_fp8(weight, scale), scale))
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
