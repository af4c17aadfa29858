"""A multi-row 4-bit quantized matvec for MLX's CUDA backend: 2-8 rows, every weight read once.

MLX 0.32's CUDA ``qmv`` runs one thread block per input row, so a ``(k+1)``-token verify pass reads
each weight matrix ``k+1`` times and costs ~``k+1`` decode steps in the memory-bound matmuls (β 1.55
at k = 1 on a 27B shape, docs/performance.md). ``qmv(x, w, scales, biases)`` here computes
``x @ dequantize(w).T`` for up to 8 rows of ``x`` with one pass over ``w`` (``mx.fast.cuda_kernel``):

``mma``   one warp per 16 output features, tensor cores: each lane loads 32 consecutive 4-bit
          weights of two output rows (16 bytes each), dequantizes them to bf16 (``s·q + b``, one
          rounding, as MLX's own kernel does) and feeds ``mma.m16n8k16`` with the up-to-8 input rows
          as the n = 8 columns (rows ≥ M are zeros), accumulating in float32. The dot product's k order
          is permuted inside each 128-wide chunk so that every lane's A and B fragments come from
          its own contiguous weights and inputs (``PRMT``: a cheaper nibble extraction with the
          input pairs permuted to match). ``KS`` warps of a block split K and add their partial
          sums through shared memory (small matrices need more warps to keep the memory busy).
``simt``  a plain fallback: a warp per ``R`` output rows, lanes striding over K, float32 FMAs.

Which one runs is measured, not assumed: ``calibrate`` times every candidate against
``mx.quantized_matmul`` for each (N, K, group size, rows) the model has, checks its error against a
float32 reference is within ``TOLERANCE`` of the stock kernel's, and ``plan`` keeps the fastest
correct one, or none (then the stock kernel runs). ``enable(model)`` swaps the model's 4-bit affine
``QuantizedLinear`` layers to ``FastQuantizedLinear``, whose ``__call__`` looks the call's shape up in
the plan. Only on a CUDA device; elsewhere ``enable`` does nothing (the CPU tests never reach it).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

HEADER = r"""
__device__ __forceinline__ void mtpc_mma(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// bf16x2 of s*q + b for two 4-bit values q already placed in the low mantissa bits of 0x4300 (= 128.0)
__device__ __forceinline__ uint32_t mtpc_dq(uint32_t r, __nv_bfloat162 s, __nv_bfloat162 b) {
  r |= 0x43004300u;
  __nv_bfloat162 q = *reinterpret_cast<__nv_bfloat162*>(&r);
  q = __hsub2(q, __float2bfloat162_rn(128.0f));  // exact: 0..15
  __nv_bfloat162 v = __hfma2(q, s, b);
  return *reinterpret_cast<uint32_t*>(&v);
}

// nibbles (j, j+1) of w, j = shift / 4 -> (lo, hi)
__device__ __forceinline__ uint32_t mtpc_pair_next(uint32_t w, int shift) {
  uint32_t t = w >> shift;
  return (t & 0xFu) | ((t << 12) & 0xF0000u);
}

// nibbles (j, j+4) of w, j = shift / 4 -> (lo, hi)
__device__ __forceinline__ uint32_t mtpc_pair_far(uint32_t w, int shift) {
  return (w >> shift) & 0x000F000Fu;
}

__device__ __forceinline__ float mtpc_lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float mtpc_hi(uint32_t u) { return __uint_as_float(u & 0xFFFF0000u); }
"""

# Both kernels: w [N, K/8] packed 4-bit, x [M, K], one group of GS columns per scale/bias.
PROLOGUE = r"""
  const int N = w_shape[0];
  const int K = x_shape[1];
  const int KW = K >> 3;
  const int KG = K / GS;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
"""

MMA_SOURCE = r"""
  // template: M (rows of x, 1..8), GS (group size), KS (warps splitting K), PRMT (nibble pairing)
""" + PROLOGUE + r"""  const int g = lane >> 2;
  const int t = lane & 3;
  const int row0 = blockIdx.x * 16 + g;
  const int row1 = row0 + 8;
  const bool ok0 = row0 < N;
  const bool ok1 = row1 < N;
  const uint4* wp0 = reinterpret_cast<const uint4*>(w + (size_t)(ok0 ? row0 : 0) * KW);
  const uint4* wp1 = reinterpret_cast<const uint4*>(w + (size_t)(ok1 ? row1 : 0) * KW);
  const __nv_bfloat16* sp0 = reinterpret_cast<const __nv_bfloat16*>(scales) + (size_t)(ok0 ? row0 : 0) * KG;
  const __nv_bfloat16* sp1 = reinterpret_cast<const __nv_bfloat16*>(scales) + (size_t)(ok1 ? row1 : 0) * KG;
  const __nv_bfloat16* bp0 = reinterpret_cast<const __nv_bfloat16*>(biases) + (size_t)(ok0 ? row0 : 0) * KG;
  const __nv_bfloat16* bp1 = reinterpret_cast<const __nv_bfloat16*>(biases) + (size_t)(ok1 ? row1 : 0) * KG;
  const uint4* xp = reinterpret_cast<const uint4*>(x) + (size_t)(g < M ? g : 0) * (K >> 3);
  float c[4] = {0.f, 0.f, 0.f, 0.f};
  const int chunks = K >> 7;
  for (int ch = warp; ch < chunks; ch += KS) {
    const int k = (ch << 7) + (t << 5);  // this lane's 32 inputs: k .. k+31, one quantization group
    const uint4 wa = wp0[k >> 5];
    const uint4 wb = wp1[k >> 5];
    const int grp = k / GS;
    const __nv_bfloat162 s0 = __bfloat162bfloat162(sp0[grp]);
    const __nv_bfloat162 b0 = __bfloat162bfloat162(bp0[grp]);
    const __nv_bfloat162 s1 = __bfloat162bfloat162(sp1[grp]);
    const __nv_bfloat162 b1 = __bfloat162bfloat162(bp1[grp]);
    uint4 x0 = make_uint4(0u, 0u, 0u, 0u), x1 = x0, x2 = x0, x3 = x0;
    if (g < M) {
      x0 = xp[(k >> 3) + 0];
      x1 = xp[(k >> 3) + 1];
      x2 = xp[(k >> 3) + 2];
      x3 = xp[(k >> 3) + 3];
    }
    const uint32_t X[16] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w,
                            x2.x, x2.y, x2.z, x2.w, x3.x, x3.y, x3.z, x3.w};
    const uint32_t WA[4] = {wa.x, wa.y, wa.z, wa.w};
    const uint32_t WB[4] = {wb.x, wb.y, wb.z, wb.w};
#pragma unroll
    for (int wd = 0; wd < 4; ++wd) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t a0, a1, a2, a3, xb0, xb1;
        if (PRMT) {
          a0 = mtpc_dq(mtpc_pair_far(WA[wd], 8 * h), s0, b0);
          a1 = mtpc_dq(mtpc_pair_far(WB[wd], 8 * h), s1, b1);
          a2 = mtpc_dq(mtpc_pair_far(WA[wd], 8 * h + 4), s0, b0);
          a3 = mtpc_dq(mtpc_pair_far(WB[wd], 8 * h + 4), s1, b1);
          xb0 = __byte_perm(X[4 * wd + h], X[4 * wd + h + 2], 0x5410);
          xb1 = __byte_perm(X[4 * wd + h], X[4 * wd + h + 2], 0x7632);
        } else {
          a0 = mtpc_dq(mtpc_pair_next(WA[wd], 16 * h), s0, b0);
          a1 = mtpc_dq(mtpc_pair_next(WB[wd], 16 * h), s1, b1);
          a2 = mtpc_dq(mtpc_pair_next(WA[wd], 16 * h + 8), s0, b0);
          a3 = mtpc_dq(mtpc_pair_next(WB[wd], 16 * h + 8), s1, b1);
          xb0 = X[4 * wd + 2 * h];
          xb1 = X[4 * wd + 2 * h + 1];
        }
        mtpc_mma(c, a0, a1, a2, a3, xb0, xb1);
      }
    }
  }
  if (KS > 1) {
    __shared__ float red[KS * 128];
#pragma unroll
    for (int i = 0; i < 4; ++i) red[warp * 128 + lane * 4 + i] = c[i];
    __syncthreads();
    if (warp == 0) {
      for (int v = 1; v < KS; ++v) {
#pragma unroll
        for (int i = 0; i < 4; ++i) c[i] += red[v * 128 + lane * 4 + i];
      }
    }
  }
  if (warp == 0) {
    __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(out);
    const int m0 = 2 * t;
    const int m1 = 2 * t + 1;
    if (m0 < M) {
      if (ok0) o[(size_t)m0 * N + row0] = __float2bfloat16(c[0]);
      if (ok1) o[(size_t)m0 * N + row1] = __float2bfloat16(c[2]);
    }
    if (m1 < M) {
      if (ok0) o[(size_t)m1 * N + row0] = __float2bfloat16(c[1]);
      if (ok1) o[(size_t)m1 * N + row1] = __float2bfloat16(c[3]);
    }
  }
"""

SIMT_SOURCE = r"""
  // template: M (rows of x), GS (group size), R (output rows per warp), WPB (warps per block)
""" + PROLOGUE + r"""  const int rbase = (blockIdx.x * WPB + warp) * R;
  const __nv_bfloat16* sc = reinterpret_cast<const __nv_bfloat16*>(scales);
  const __nv_bfloat16* bi = reinterpret_cast<const __nv_bfloat16*>(biases);
  float acc[R][M];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
  for (int wi = lane; wi < KW; wi += 32) {
    const int k = wi << 3;
    const int grp = k / GS;
    float xf[M][8];
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const uint4 v = reinterpret_cast<const uint4*>(x)[((size_t)m * K + k) >> 3];
      xf[m][0] = mtpc_lo(v.x); xf[m][1] = mtpc_hi(v.x); xf[m][2] = mtpc_lo(v.y); xf[m][3] = mtpc_hi(v.y);
      xf[m][4] = mtpc_lo(v.z); xf[m][5] = mtpc_hi(v.z); xf[m][6] = mtpc_lo(v.w); xf[m][7] = mtpc_hi(v.w);
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int row = rbase + r;
      if (row < N) {
        const uint32_t q = w[(size_t)row * KW + wi];
        const float s = __bfloat162float(sc[(size_t)row * KG + grp]);
        const float b = __bfloat162float(bi[(size_t)row * KG + grp]);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float wv = fmaf((float)((q >> (4 * j)) & 15u), s, b);
#pragma unroll
          for (int m = 0; m < M; ++m) acc[r][m] = fmaf(xf[m][j], wv, acc[r][m]);
        }
      }
    }
  }
  __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(out);
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float v = acc[r][m];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
      const int row = rbase + r;
      if (lane == 0 && row < N) o[(size_t)m * N + row] = __float2bfloat16(v);
    }
  }
"""

# error against a float32 reference, relative to the reference's largest magnitude: a candidate is
# "within tolerance" when its error is at most the stock kernel's times FACTOR, or below FLOOR (one
# bf16 unit at the largest output: the output's own rounding is half of that)
TOLERANCE = {"factor": 1.5, "floor": 2.0**-7}
MAX_ROWS = 8


@dataclass(frozen=True)
class Config:
    kind: str  # "mma" or "simt"
    ks: int = 1  # mma: warps splitting K
    prmt: bool = False  # mma: nibble pairing
    r: int = 2  # simt: output rows per warp
    wpb: int = 4  # simt: warps per block

    @property
    def name(self) -> str:
        if self.kind == "mma":
            return f"mma{'-prmt' if self.prmt else ''}-ks{self.ks}"
        return f"simt-r{self.r}"


_KERNELS: Dict[str, object] = {}


def _kernel(kind: str):
    if kind not in _KERNELS:
        _KERNELS[kind] = mx.fast.cuda_kernel(
            name=f"mtpc_qmv_{kind}", input_names=["x", "w", "scales", "biases"], output_names=["out"],
            source=MMA_SOURCE if kind == "mma" else SIMT_SOURCE, header=HEADER)
    return _KERNELS[kind]


def supported(x_dtype, w: mx.array, scales: mx.array, biases: Optional[mx.array], group_size: int, bits: int,
              mode: str = "affine") -> bool:
    """Shapes and types the kernels handle: 4-bit affine, groups 32/64/128, bf16, K a multiple of 128."""
    return (mode == "affine" and bits == 4 and group_size in (32, 64, 128) and biases is not None
            and w.ndim == 2 and x_dtype == mx.bfloat16 and scales.dtype == mx.bfloat16
            and biases.dtype == mx.bfloat16 and (w.shape[1] * 8) % 128 == 0)


def default_ks(n: int, k: int) -> int:
    """Warps per 16-row tile: enough warps in flight for a small matrix (~2048 warps on the GPU)."""
    tiles = -(-n // 16)
    ks = 1
    while ks < 8 and tiles * ks < 2048 and (k // 128) >= 2 * ks:
        ks *= 2
    return ks


def qmv(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, config: Config) -> mx.array:
    """``x [M, K] @ dequantize(w, scales, biases).T`` -> [M, N] (bf16), M <= 8, on the CUDA device."""
    M, K = x.shape
    N = w.shape[0]
    if config.kind == "mma":
        tiles = -(-N // 16)
        threads = 32 * config.ks
        return _kernel("mma")(
            inputs=[x, w, scales, biases],
            template=[("M", M), ("GS", group_size), ("KS", config.ks), ("PRMT", config.prmt)],
            grid=(tiles * threads, 1, 1), threadgroup=(threads, 1, 1),
            output_shapes=[(M, N)], output_dtypes=[x.dtype])[0]
    rows_per_block = config.r * config.wpb
    blocks = -(-N // rows_per_block)
    threads = 32 * config.wpb
    return _kernel("simt")(
        inputs=[x, w, scales, biases],
        template=[("M", M), ("GS", group_size), ("R", config.r), ("WPB", config.wpb)],
        grid=(blocks * threads, 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=[(M, N)], output_dtypes=[x.dtype])[0]


# ---------------------------------------------------------------------------------------------- plan

Key = Tuple[int, int, int, int]  # (N, K, group size, rows)
PLAN: Dict[Key, Config] = {}
REPORT: List[dict] = []  # one entry per calibrated key: every candidate's time and error


def candidates(n: int, k: int) -> List[Config]:
    ks = default_ks(n, k)
    out = [Config("mma", ks, False), Config("mma", ks, True)]
    if ks > 1:
        out.append(Config("mma", max(1, ks // 2), True))
    out.append(Config("simt", r=2))
    return out


def _time(fn, reps: int = 10, rounds: int = 3) -> float:
    """Seconds per call: ``reps`` calls in one graph, best of ``rounds`` (after a warm call)."""
    mx.eval(fn())
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(reps)])
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def _rel_err(y: mx.array, ref: mx.array) -> float:
    return (mx.abs(y.astype(mx.float32) - ref).max() / mx.maximum(mx.abs(ref).max(), 1e-30)).item()


def calibrate_one(w: mx.array, scales: mx.array, biases: mx.array, group_size: int, rows: int,
                  configs: Optional[Sequence[Config]] = None, seed: int = 0) -> dict:
    """Time and check every candidate for one (weight, rows); return the report entry (``best``: a
    Config or None when the stock kernel is at least as fast or no candidate is within tolerance)."""
    n, k = w.shape[0], w.shape[1] * 8
    x = (mx.random.normal((rows, k), key=mx.random.key(seed)) * 0.5).astype(mx.bfloat16)
    ref = x.astype(mx.float32) @ mx.dequantize(w, scales, biases, group_size, 4).astype(mx.float32).T
    def stock():
        return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=4)
    entry = {"n": n, "k": k, "group_size": group_size, "rows": rows, "stock_ms": round(1e3 * _time(stock), 4),
             "stock_err": _rel_err(stock(), ref), "candidates": {}}
    limit = max(TOLERANCE["factor"] * entry["stock_err"], TOLERANCE["floor"])
    y_stock = stock()
    best, best_t = None, entry["stock_ms"] / 1e3
    for cfg in configs or candidates(n, k):
        try:
            fn = lambda cfg=cfg: qmv(x, w, scales, biases, group_size, cfg)  # noqa: E731
            y = fn()
            err = _rel_err(y, ref)
            vs_stock = _rel_err(y, y_stock.astype(mx.float32))
            t = _time(fn)
        except Exception as e:  # noqa: BLE001 - a kernel that fails to build or run is simply not used
            entry["candidates"][cfg.name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            continue
        ok = err <= limit
        entry["candidates"][cfg.name] = {"ms": round(1e3 * t, 4), "err": err, "diff_vs_stock": vs_stock,
                                         "within_tolerance": ok}
        if ok and t < best_t:
            best, best_t = cfg, t
    entry["best"] = best.name if best else "stock"
    entry["best_config"] = best
    return entry


def quantized_linears(model: nn.Module) -> List[nn.QuantizedLinear]:
    return [mod for _, mod in model.named_modules() if isinstance(mod, nn.QuantizedLinear)]


def calibrate(modules: Iterable[nn.Module], rows: Sequence[int] = tuple(range(2, MAX_ROWS + 1)),
              configs: Optional[Sequence[Config]] = None) -> List[dict]:
    """Fill ``PLAN`` for every distinct supported 4-bit layer shape in ``modules`` and each row count."""
    seen = {}
    for module in modules:
        for q in quantized_linears(module):
            if supported(mx.bfloat16, q.weight, q.scales, q.get("biases"), q.group_size, q.bits, q.mode):
                seen.setdefault((q.weight.shape[0], q.weight.shape[1] * 8, q.group_size), q)
    entries = []
    for (n, k, gs), q in sorted(seen.items()):
        for r in rows:
            if (n, k, gs, r) in PLAN:
                continue
            e = calibrate_one(q.weight, q.scales, q["biases"], gs, r, configs)
            cfg = e.pop("best_config")
            if cfg is not None:
                PLAN[(n, k, gs, r)] = cfg
            entries.append(e)
    REPORT.extend(entries)
    return entries


class FastQuantizedLinear(nn.QuantizedLinear):
    """``QuantizedLinear`` whose calls of 2-8 rows run ``qmv`` where ``PLAN`` says it wins."""

    def __call__(self, x):
        rows = x.size // x.shape[-1] if x.ndim else 0
        cfg = PLAN.get((self["weight"].shape[0], x.shape[-1], self.group_size, rows)) if rows <= MAX_ROWS else None
        if cfg is None or x.dtype != mx.bfloat16:
            return super().__call__(x)
        y = qmv(x.reshape(rows, x.shape[-1]), self["weight"], self["scales"], self["biases"], self.group_size, cfg)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        if "bias" in self:
            y = y + self["bias"]
        return y


def available() -> bool:
    """A CUDA device is the default and MLX has ``fast.cuda_kernel``."""
    try:
        return mx.default_device() == mx.gpu and mx.cuda.is_available() and hasattr(mx.fast, "cuda_kernel")
    except AttributeError:
        return False


def enable(*modules: nn.Module, rows: Sequence[int] = tuple(range(2, MAX_ROWS + 1)),
           configs: Optional[Sequence[Config]] = None, force: bool = False) -> List[dict]:
    """Calibrate and swap the modules' 4-bit affine ``QuantizedLinear`` layers to ``FastQuantizedLinear``.

    Does nothing (returns []) off CUDA unless ``force`` (the tests route a stand-in through it).
    Returns the calibration entries (time and error of every candidate and the stock kernel)."""
    if not (force or available()):
        return []
    entries = calibrate(modules, rows, configs) if not force or available() else []
    for module in modules:
        for q in quantized_linears(module):
            if type(q) is nn.QuantizedLinear:
                q.__class__ = FastQuantizedLinear
    return entries


_AUTO_DONE = set()  # id() of the backbones ``auto`` enabled


def auto(m) -> None:
    """The runtime's hook (``speculative.prepare_speculative``): with ``MTPCONVERT_CUDA_QMV=1`` on a CUDA
    device, calibrate and enable once per model. Off by default: the kernels win in isolation (2-row
    matmuls 2.6-4.2x faster on an H200), but a whole verify pass gained less than that on the
    launch-bound 27B-shaped model (docs/cuda.md "The verify pass on CUDA")."""
    if os.environ.get("MTPCONVERT_CUDA_QMV", "0") != "1" or id(m.model) in _AUTO_DONE or not available():
        return
    _AUTO_DONE.add(id(m.model))
    enable(m.model, m.head)


def disable(*modules: nn.Module) -> None:
    for module in modules:
        for q in quantized_linears(module):
            if type(q) is FastQuantizedLinear:
                q.__class__ = nn.QuantizedLinear
