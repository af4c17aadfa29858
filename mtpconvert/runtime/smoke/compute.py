"""How the layerwise check computes with a layer it has loaded (``runtime.smoke.layerwise``).

With ``exact`` a layer runs as loaded: mlx-lm's modules and mlx's quantized kernels, the predictions
the fully loaded model makes. Without it every affine-quantized ``Linear`` (and every float one not
in the compute dtype) runs as a ``BlockLinear``, dequantized a block of rows at a time and multiplied
in floating point, because mlx's CPU backend multiplies quantized matrices by many rows slowly;
``fast_float_dtype`` picks float32 where this machine's float32 GEMM is faster. Either way, on the
CPU, float MoE experts stay as stored and run in float32 a bounded group at a time
(``runtime.decoding.experts``). ``fitted_prompt_tokens`` sizes the check to the GEMM rate measured
here: where MLX computes on the reference BLAS a large model's prompts are cut (docs/smoke.md, "Work
that fits the backend").
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from ...io.checkpoint import load_json
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


def gemm_gflops(dtype, size: int = 384) -> float:
    """GFLOP/s of mlx's ``size``-cubed matmul in ``dtype`` on the default device, measured once per dtype
    (two multiplies after a warm-up: ~0.1 s at the reference BLAS's ~1 GFLOP/s)."""
    key = (str(dtype), size, str(mx.default_device()))
    if key not in _RATES:
        a = mx.random.normal((size, size), key=mx.random.key(0)).astype(dtype)
        mx.eval(a @ a)
        t = time.perf_counter()
        for _ in range(2):
            mx.eval(a @ a)
        _RATES[key] = 2 * 2 * size ** 3 / max(time.perf_counter() - t, 1e-9) / 1e9
    return _RATES[key]


_RATES: Dict[tuple, float] = {}


def fast_float_dtype(model_dtype=mx.bfloat16, size: int = 384):
    """The float type whose GEMM is faster here: float32 when it beats ``model_dtype`` by 1.5x.

    mlx's Linux CPU wheel (mlx[cpu]) links the reference BLAS: float32 GEMM ran at ~1 GFLOP/s on
    this project's machine and bfloat16 (mlx's own loop) at ~2; with an optimized BLAS under it (the
    command line preloads one where installed: ``mtpconvert.blas``) float32 runs at ~25-100. Measured
    once (~0.1 s with the reference BLAS)."""
    if model_dtype == mx.float32:
        return mx.float32
    global _FAST_DTYPE
    if _FAST_DTYPE is None:
        fast = gemm_gflops(mx.float32, size) > 1.5 * gemm_gflops(model_dtype, size)
        _FAST_DTYPE = mx.float32 if fast else model_dtype
    return _FAST_DTYPE


_FAST_DTYPE = None


# ------------------------------------------------------------------ the check's work against this backend

# The layerwise check's estimated GEMM time past which it reads fewer tokens of each prompt (a 27B-shaped
# default convert then finishes in ~15 minutes on a 2-core CPU whose MLX computes on the reference BLAS);
# never below MIN_PROMPT_TOKENS: 3 prompts x 32 tokens compare ~93 positions, where a working head scores
# 60-90% and a broken one 0-5% (docs/smoke.md).
LAYERWISE_BUDGET_S = 480.0
MIN_PROMPT_TOKENS = 32


def model_dtype_of(folder: Path):
    """The folder's float dtype: that of its embedding (its scales when quantized), bfloat16 if unknown."""
    from ...io.header import read_header
    from .sizing import folder_family, unit_of, weight_files

    family = folder_family(folder)
    for f in weight_files(Path(folder)):
        for k, t in read_header(f).tensors.items():
            if unit_of(k, family) == "embed_tokens" and t.dtype in ("BF16", "F16", "F32"):
                return {"BF16": mx.bfloat16, "F16": mx.float16, "F32": mx.float32}[t.dtype]
    return mx.bfloat16


def active_params(folder: Path) -> Dict[str, float]:
    """Parameters of each unit (``sizing.unit_of``) a token multiplies by, from the headers: float
    matrices by their size, quantized ones by their packed size x 32 / bits, routed experts by the share
    ``num_experts_per_tok / num_experts`` a token uses. ``embed_tokens`` is a gather (no multiply) unless
    tied to the output, when it is counted as ``lm_head``."""
    from ...io.header import read_header
    from .sizing import folder_family, unit_of, weight_files

    family = folder_family(folder)
    config = load_json(Path(folder) / "config.json", "config.json")
    spec = family.spec(config)
    tc = config.get("text_config", config)
    tied = spec.tie_word_embeddings
    quant = config.get("quantization") or {}
    experts = spec.num_experts
    share = (tc.get("num_experts_per_tok") or experts) / experts if experts else 1.0
    units: Dict[str, float] = {}
    for f in weight_files(Path(folder)):
        for k, t in read_header(f).tensors.items():
            if len(t.shape) < 2 or not k.endswith(".weight"):
                continue
            unit = unit_of(k, family)
            if unit == "embed_tokens":
                if not tied:
                    continue
                unit = "lm_head"
            n = float(math.prod(t.shape))
            if t.dtype == "U32":
                path = quant.get(k[: -len(".weight")])
                n *= 32 / int((path if isinstance(path, dict) else quant).get("bits", 4))
            elif t.dtype not in ("BF16", "F16", "F32"):
                continue
            if len(t.shape) == 3 or "experts" in k:
                n *= share
            units[unit] = units.get(unit, 0.0) + n
    return units


def layerwise_flops(units: Dict[str, float], tokens: Sequence[int]) -> float:
    """GEMM FLOPs of the layerwise check over prompts of ``tokens`` tokens: every decoder layer once over
    every position, the head twice (with and without its layer's MLP: counted whole both times), lm_head
    over three states of every position (the backbone's, the head's, the head's without its MLP)."""
    rows = float(sum(tokens))
    body = sum(v for k, v in units.items() if k.startswith("layer ") or k == "other")
    return 2 * rows * (body + 2 * units.get("mtp", 0.0) + 3 * units.get("lm_head", 0.0))


def fitted_prompt_tokens(folder: Path, max_tokens: int, prompts: int = 3,
                         budget_s: float = LAYERWISE_BUDGET_S) -> Tuple[int, Optional[str]]:
    """Tokens of each prompt the layerwise check reads here: ``max_tokens`` unless its GEMMs, at the rate
    measured for the dtype the check computes in (``fast_float_dtype``), would take longer than
    ``budget_s``; then as many as fit, at least ``MIN_PROMPT_TOKENS``. Returns the count and, when it was
    cut, why (one line for the output). On a GPU: ``max_tokens``."""
    if mx.default_device() != mx.cpu or max_tokens <= MIN_PROMPT_TOKENS:
        return max_tokens, None
    dtype = fast_float_dtype(model_dtype_of(folder))
    rate = gemm_gflops(dtype)
    seconds = layerwise_flops(active_params(folder), [max_tokens] * prompts) / (rate * 1e9)
    if seconds <= budget_s:
        return max_tokens, None
    tokens = max(MIN_PROMPT_TOKENS, int(max_tokens * budget_s / seconds))
    from ... import blas

    name = str(dtype).replace("mlx.core.", "")
    where = " (MLX on the reference BLAS)" if blas.state() == blas.REFERENCE else ""
    return tokens, (f"{tokens} tokens of each prompt, not {max_tokens}: {name} GEMM runs at {rate:.1f} GFLOP/s "
                    f"here{where}, ~{seconds / 60:.0f} min of it at {max_tokens}")


def _finish_layer(module: nn.Module, exact: bool, dtype) -> None:
    bound_float_experts(module)  # float experts stay as stored: float32 a group at a time, not the stack
    if not exact:
        dequantize_linears(module, dtype)
        if dtype == mx.float32:  # vectors too (norms, A_log, dt_bias): matrices are promoted per call
            module.update(tree_map(lambda v: v.astype(mx.float32) if v.ndim <= 1 and
                                   mx.issubdtype(v.dtype, mx.floating) else v, module.parameters()))
