"""The CUDA multi-row quantized matvec (runtime/decoding/cuda_qmv.py), what can be checked without a GPU.

``mx.fast.cuda_kernel`` does not run on the CPU backend, so the kernel's arithmetic is checked on the
GPU (benchmarks/cuda_qmv_bench.py, and ``calibrate``, which refuses any candidate outside tolerance).
Here: the ``mma`` kernel's index mapping — which lane loads which weights and inputs, and how they
land in the ``mma.m16n8k16`` fragments — ported line by line to numpy with the PTX ISA's fragment
layout, must compute ``x @ dequantize(w).T`` for both nibble pairings, several K-splits and ragged N;
and ``FastQuantizedLinear`` must route exactly the planned (shape, rows) calls to ``qmv``.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mtpconvert.runtime.decoding import cuda_qmv
from mtpconvert.runtime.decoding.cuda_qmv import Config, FastQuantizedLinear


def nib(w, j):
    return (int(w) >> (4 * j)) & 0xF


def emulate_mma_kernel(x, wq, s, b, gs, ks, prmt):
    """numpy port of MMA_SOURCE: x [M, K] float, wq [N, K/8] uint32, s/b [N, K/gs]."""
    M, K = x.shape
    N = wq.shape[0]
    out = np.zeros((M, N))
    tiles = -(-N // 16)
    for blk in range(tiles):
        red = np.zeros((ks, 32, 4))
        for warp in range(ks):
            c = np.zeros((32, 4))
            for ch in range(warp, K // 128, ks):
                frags = []  # per lane: (a0, a1, a2, a3, xb0, xb1) for each of the 8 mmas; a pair = (lo, hi)
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    row0, row1 = blk * 16 + g, blk * 16 + g + 8
                    r0, r1 = (row0 if row0 < N else 0), (row1 if row1 < N else 0)
                    k = ch * 128 + t * 32
                    WA = wq[r0, k // 8: k // 8 + 4]
                    WB = wq[r1, k // 8: k // 8 + 4]
                    grp = k // gs
                    dq0 = lambda q: s[r0, grp] * q + b[r0, grp]  # noqa: E731
                    dq1 = lambda q: s[r1, grp] * q + b[r1, grp]  # noqa: E731
                    xr = x[g, k:k + 32] if g < M else np.zeros(32)
                    X = [(xr[2 * i], xr[2 * i + 1]) for i in range(16)]
                    lane_frags = []
                    for wd in range(4):
                        for h in range(2):
                            if prmt:
                                p0, p2 = 2 * h, 2 * h + 1  # pair_far(w, 8h) / pair_far(w, 8h + 4)
                                a0 = (dq0(nib(WA[wd], p0)), dq0(nib(WA[wd], p0 + 4)))
                                a1 = (dq1(nib(WB[wd], p0)), dq1(nib(WB[wd], p0 + 4)))
                                a2 = (dq0(nib(WA[wd], p2)), dq0(nib(WA[wd], p2 + 4)))
                                a3 = (dq1(nib(WB[wd], p2)), dq1(nib(WB[wd], p2 + 4)))
                                lo, hi = X[4 * wd + h], X[4 * wd + h + 2]
                                xb0, xb1 = (lo[0], hi[0]), (lo[1], hi[1])  # byte_perm 0x5410 / 0x7632
                            else:
                                p0, p2 = 4 * h, 4 * h + 2  # pair_next(w, 16h) / pair_next(w, 16h + 8)
                                a0 = (dq0(nib(WA[wd], p0)), dq0(nib(WA[wd], p0 + 1)))
                                a1 = (dq1(nib(WB[wd], p0)), dq1(nib(WB[wd], p0 + 1)))
                                a2 = (dq0(nib(WA[wd], p2)), dq0(nib(WA[wd], p2 + 1)))
                                a3 = (dq1(nib(WB[wd], p2)), dq1(nib(WB[wd], p2 + 1)))
                                xb0, xb1 = X[4 * wd + 2 * h], X[4 * wd + 2 * h + 1]
                            lane_frags.append((a0, a1, a2, a3, xb0, xb1))
                    frags.append(lane_frags)
                for i in range(8):  # the warp's mma i, with the PTX m16n8k16 fragment layouts
                    A, B = np.zeros((16, 16)), np.zeros((16, 8))
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        a0, a1, a2, a3, xb0, xb1 = frags[lane][i]
                        for e in range(2):
                            A[g, 2 * t + e] = a0[e]
                            A[g + 8, 2 * t + e] = a1[e]
                            A[g, 2 * t + 8 + e] = a2[e]
                            A[g + 8, 2 * t + 8 + e] = a3[e]
                            B[2 * t + e, g] = xb0[e]
                            B[2 * t + 8 + e, g] = xb1[e]
                    D = A @ B
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        c[lane] += [D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]]
            red[warp] = c
        c = red.sum(axis=0)
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            row0, row1 = blk * 16 + g, blk * 16 + g + 8
            for col, (ci, rowi) in ((2 * t, (0, row0)), (2 * t, (2, row1)), (2 * t + 1, (1, row0)),
                                    (2 * t + 1, (3, row1))):
                if col < M and rowi < N:
                    out[col, rowi] = c[lane][ci]
    return out


@pytest.mark.parametrize("prmt", [False, True])
@pytest.mark.parametrize("M,N,K,gs,ks", [(2, 32, 256, 64, 1), (3, 40, 384, 32, 2), (8, 16, 512, 128, 4),
                                         (1, 24, 256, 64, 2), (5, 48, 128, 64, 1)])
def test_mma_mapping_computes_the_matmul(M, N, K, gs, ks, prmt):
    rng = np.random.default_rng(M * 100 + N)
    w = mx.array(rng.standard_normal((N, K)).astype(np.float32))
    wq, s, b = mx.quantize(w, group_size=gs, bits=4)
    x = rng.standard_normal((M, K))
    ref = x @ np.array(mx.dequantize(wq, s, b, group_size=gs, bits=4)).astype(np.float64).T
    got = emulate_mma_kernel(x, np.array(wq), np.array(s).astype(np.float64), np.array(b).astype(np.float64), gs, ks,
                             prmt)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)  # float32 dequantize in ref


def test_quantize_packs_low_nibble_first():
    """The kernels read value j of a word from bits 4j..4j+3."""
    w = mx.array(np.tile(np.arange(16, dtype=np.float32), (1, 4)))  # one row 0..15 repeated, K = 64
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    deq = np.array(mx.dequantize(wq, s, b, group_size=64, bits=4))[0]
    q = np.array([nib(np.array(wq)[0, i // 8], i % 8) for i in range(64)])
    np.testing.assert_allclose(q * np.array(s)[0, 0] + np.array(b)[0, 0], deq, rtol=1e-6)


def test_default_ks_and_support():
    assert cuda_qmv.default_ks(248320, 5120) == 1
    assert cuda_qmv.default_ks(1024, 5120) == 8
    assert cuda_qmv.default_ks(48, 256) == 2  # one 128-wide chunk per warp
    assert cuda_qmv.default_ks(48, 128) == 1  # K too short to split
    w = mx.zeros((32, 16), dtype=mx.uint32)  # K = 128
    s = mx.zeros((32, 2), dtype=mx.bfloat16)
    assert cuda_qmv.supported(mx.bfloat16, w, s, s, 64, 4)
    assert not cuda_qmv.supported(mx.float32, w, s, s, 64, 4)
    assert not cuda_qmv.supported(mx.bfloat16, w, s, None, 64, 4)
    assert not cuda_qmv.supported(mx.bfloat16, w, s, s, 64, 8)


def test_fast_linear_routes_planned_shapes_only(monkeypatch):
    calls = []

    def stand_in(x, w, scales, biases, group_size, config):
        calls.append((x.shape, config.name))
        return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=4)

    monkeypatch.setattr(cuda_qmv, "qmv", stand_in)
    monkeypatch.setattr(cuda_qmv, "PLAN", {(32, 128, 64, 2): Config("mma", 2, True)})
    layer = nn.QuantizedLinear(128, 32, bias=False, group_size=64, bits=4)
    layer.update({"scales": layer.scales.astype(mx.bfloat16), "biases": layer.biases.astype(mx.bfloat16)})
    model = nn.Sequential(layer)
    assert cuda_qmv.enable(model, force=True) == []
    assert type(layer) is FastQuantizedLinear
    x2 = mx.random.normal((1, 2, 128)).astype(mx.bfloat16)
    stock = mx.quantized_matmul(x2, layer.weight, layer.scales, layer.biases, transpose=True, group_size=64, bits=4)
    assert mx.array_equal(layer(x2), stock)
    assert calls == [((2, 128), "mma-prmt-ks2")]
    layer(mx.random.normal((1, 1, 128)).astype(mx.bfloat16))  # 1 row: not planned
    layer(mx.random.normal((3, 128)).astype(mx.bfloat16))  # 3 rows: not planned
    layer(mx.random.normal((2, 128)))  # float32 input: stock
    assert len(calls) == 1
    cuda_qmv.disable(model)
    assert type(layer) is nn.QuantizedLinear


def test_enable_is_a_no_op_on_the_cpu():
    layer = nn.QuantizedLinear(128, 32, bias=False, group_size=64, bits=4)
    assert cuda_qmv.enable(nn.Sequential(layer)) == []
    assert type(layer) is nn.QuantizedLinear


def test_runtime_hook_is_off_by_default_and_off_the_gpu(monkeypatch):
    from types import SimpleNamespace

    layer = nn.QuantizedLinear(128, 32, bias=False, group_size=64, bits=4)
    m = SimpleNamespace(model=nn.Sequential(layer), head=nn.Sequential())
    cuda_qmv.auto(m)
    monkeypatch.setenv("MTPCONVERT_CUDA_QMV", "1")
    cuda_qmv.auto(m)  # no CUDA device here: nothing happens
    assert type(layer) is nn.QuantizedLinear
