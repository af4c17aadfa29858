"""How the layerwise check computes with a layer it has loaded (``runtime.checks.layerwise``).

With ``exact`` a layer runs as loaded: mlx-lm's modules and mlx's quantized kernels, the predictions
the fully loaded model makes. Without it every affine-quantized ``Linear`` (and every float one not
in the compute dtype) runs as a ``BlockLinear``, dequantized a block of rows at a time and multiplied
in floating point, because mlx's CPU backend multiplies quantized matrices by many rows slowly;
``fast_float_dtype`` picks float32 where this machine's float32 GEMM is faster. Either way, on the
CPU, float MoE experts stay as stored and run in float32 a bounded group at a time
(``runtime.decoding.experts``).
"""

from __future__ import annotations

import time
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from ..decoding.experts import bound_float_experts

# Rows of a weight matrix turned to floating point at once by BlockLinear.
LINEAR_BLOCK_BYTES = 64 << 20


class BlockLinear(nn.Module):
    """``nn.Linear``'s forward in ``dtype`` for a quantized (affine) or float ``Linear``, a block
    of output rows at a time: each block is dequantized (or cast), multiplied and evaluated before
    the next, so a layer's resident memory stays its stored weights plus one block of
    ``LINEAR_BLOCK_BYTES``, however large its matrices are."""

    def __init__(self, m: nn.Module, dtype, block_bytes: Optional[int] = None):
        super().__init__()
        self.quantized = isinstance(m, nn.QuantizedLinear)
        for k in ("weight", "scales", "biases", "bias"):
            if m.get(k) is not None:
                setattr(self, k, m[k])
        if self.quantized:
            self.group_size, self.bits, self.mode = m.group_size, m.bits, m.mode
            in_dims = m["weight"].shape[1] * 32 // m.bits
        else:
            in_dims = m["weight"].shape[1]
        self.dtype = dtype
        self.rows = max(1, (block_bytes or LINEAR_BLOCK_BYTES) // (in_dims * dtype.size))

    def _block(self, a: int, b: int) -> mx.array:
        if self.quantized:
            biases = self.get("biases")
            return mx.dequantize(self["weight"][a:b], self["scales"][a:b], biases[a:b] if biases is not None else None,
                                 group_size=self.group_size, bits=self.bits, mode=self.mode, dtype=self.dtype)
        return self["weight"][a:b].astype(self.dtype)

    def __call__(self, x):
        x = x.astype(self.dtype)
        out = self["weight"].shape[0]
        parts = []
        for a in range(0, out, self.rows):
            y = x @ self._block(a, min(out, a + self.rows)).T
            mx.eval(y)
            parts.append(y)
        y = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
        return y + self["bias"].astype(self.dtype) if "bias" in self else y


def dequantize_linears(module: nn.Module, dtype) -> int:
    """Swap every affine ``QuantizedLinear`` under ``module``, and every float ``Linear`` whose
    weight is not ``dtype``, for a ``BlockLinear`` computing in ``dtype``. Returns the count."""
    n = 0

    def swap(m):
        nonlocal n
        if (isinstance(m, nn.QuantizedLinear) and m.mode == "affine") or (
                type(m) is nn.Linear and m["weight"].dtype != dtype):
            n += 1
            return BlockLinear(m, dtype)
        return m

    module.update_modules(tree_map(swap, module.leaf_modules(), is_leaf=nn.Module.is_module))
    return n


def fast_float_dtype(model_dtype=mx.bfloat16, size: int = 384):
    """The float type whose GEMM is faster here: float32 when it beats ``model_dtype`` by 1.5x.

    mlx's Linux CPU wheel (mlx[cpu]) links the reference BLAS: float32 GEMM ran at ~1 GFLOP/s on
    this project's machine and bfloat16 (mlx's own loop) at ~2; with an optimized BLAS preloaded
    (``LD_PRELOAD=.../openblas-pthread/libblas.so.3``) float32 runs at ~25-40. Measured once
    (~0.1 s with the reference BLAS)."""
    if model_dtype == mx.float32:
        return mx.float32
    global _FAST_DTYPE
    if _FAST_DTYPE is None:
        a = mx.random.normal((size, size), key=mx.random.key(0))
        times = {}
        for dt in (mx.float32, model_dtype):
            x, w = a.astype(dt), a.astype(dt)
            mx.eval(x @ w)
            t = time.perf_counter()
            for _ in range(2):
                mx.eval(x @ w)
            times[dt] = time.perf_counter() - t
        _FAST_DTYPE = mx.float32 if times[mx.float32] * 1.5 < times[model_dtype] else model_dtype
    return _FAST_DTYPE


_FAST_DTYPE = None


def _finish_layer(module: nn.Module, exact: bool, dtype) -> None:
    bound_float_experts(module)  # float experts stay as stored: float32 a group at a time, not the stack
    if not exact:
        dequantize_linears(module, dtype)
        if dtype == mx.float32:  # vectors too (norms, A_log, dt_bias): matrices are promoted per call
            module.update(tree_map(lambda v: v.astype(mx.float32) if v.ndim <= 1 and
                                   mx.issubdtype(v.dtype, mx.floating) else v, module.parameters()))
