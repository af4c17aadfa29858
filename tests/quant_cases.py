"""Quantizer inputs shared by the byte-identity tests and ``benchmarks/quantize_exact.py`` (no pytest here)."""

import mlx.core as mx
import numpy as np

MX_DTYPES = {"BF16": mx.bfloat16, "F16": mx.float16, "F32": mx.float32}
TARGETS = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


def edge_groups(cols: int, rng) -> np.ndarray:
    """Rows of values that stress each branch of the kernel's scale/bias rule."""
    rows = [
        np.zeros(cols),  # q0 == 0, zero span
        -np.zeros(cols),  # -0.0 everywhere
        np.full(cols, 0.5), np.full(cols, -0.3),  # constant groups: eps span, huge |edge/scale|
        np.full(cols, 1e-9), np.where(np.arange(cols) % 2, 1e-40, 0.0),  # tiny, subnormal
        rng.standard_normal(cols) * 100,  # wide
        -np.abs(rng.standard_normal(cols)), np.abs(rng.standard_normal(cols)),  # one-signed
        rng.standard_normal(cols) * 0.02,  # typical weights
        rng.standard_normal(cols) * 0.02 + 0.05,  # offset: small |edge/scale|, q0 near +-1
    ]
    # edge/scale = t exactly, for t in the rounding corners: min = -t * span/15, max = span - t*span/15
    for t in (0.5, 0.49, 0.51, 1.5, 1.49, 2.5, 7.5):
        row = np.linspace(0, 1, cols) * 15 - t
        rows.append(row * 0.01)
        rows.append(-row * 0.01)
    return np.stack(rows).astype(np.float32)
