"""Pure tensor transforms, one job each. The plan names them as typed steps; ``apply_steps`` runs them."""

from __future__ import annotations

import functools
from typing import List, Sequence

import mlx.core as mx

from ..plan.quant import QuantSpec
from .npquant import e4m3_table
from ..plan.steps import GATHER_STEPS, Cast, ConvAxis, Gather, Quantize, ShiftNorm, Step


@functools.lru_cache(maxsize=1)
def e4m3_values() -> mx.array:
    """The float32 value of each of the 256 float8_e4m3fn codes (``npquant.e4m3_table``)."""
    return mx.array(e4m3_table())


def dequant_fp8(codes: mx.array, scale: mx.array, block: int, row_offset: int = 0) -> mx.array:
    """FP8 -> float32: ``W[i, j] = e4m3(codes[i, j]) * scale[i // block, j // block]`` over the
    last two axes (leading axes, experts, are matched one to one); ``block`` 0: ``scale`` is one value for
    every code. ``codes`` may start ``row_offset`` rows into the first scale row. Exact: an e4m3 value
    times a bf16/f16/f32 scale fits float32."""
    if block == 0:
        return mx.take(e4m3_values(), codes.astype(mx.uint32)) * scale.astype(mx.float32).reshape(())
    rows, cols = codes.shape[-2:]
    grid = mx.repeat(mx.repeat(scale.astype(mx.float32), block, axis=-2), block, axis=-1)
    grid = grid[..., row_offset:row_offset + rows, :cols]
    return mx.take(e4m3_values(), codes.astype(mx.uint32)) * grid


def scale_values(stored: mx.array, st_dtype: str) -> mx.array:
    """A scale tensor as read (``io.header.DTYPES``) -> its float32 values. F8_E8M0 bytes are exponents: ``2^(b -
    127)``, built from their bits (b << 23; b = 0 is the subnormal 2^-127; 255 is NaN, as the OCP format says)."""
    if st_dtype != "F8_E8M0":
        return stored.astype(mx.float32)
    b = stored.astype(mx.uint32)
    bits = mx.where(b == 0, mx.array(1 << 22, mx.uint32), mx.where(b == 255, mx.array(0x7FC00000, mx.uint32), b << 23))
    return bits.view(mx.float32)


# the E2M1 value of each 4-bit code (bit 3: the sign)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequant_mxfp4(codes: mx.array, scale: mx.array) -> mx.array:
    """MXFP4 -> float32: ``codes`` [..., N, K/2] (two E2M1 codes a byte, element 2j in the low nibble), ``scale``
    [..., N, K/32] the float32 values of their E8M0 scales. Exact: a code's value times a power of two fits float32."""
    b = codes.view(mx.uint8).astype(mx.uint32)
    nibbles = mx.stack([b & 0xF, b >> 4], axis=-1).reshape(*b.shape[:-1], 2 * b.shape[-1])
    values = mx.take(mx.array(E2M1, mx.float32), nibbles)
    return values * mx.repeat(scale, 32, axis=-1)


def carry_mx(codes: mx.array, exponents: mx.array, mode: str, row_offset: int = 0) -> List[mx.array]:
    """A source MLX holds as stored -> [weight uint32, scales uint8] of ``mode``: mxfp4's codes (two a byte) and
    per-32 E8M0 bytes as they are; mxfp8's E4M3 bytes with each 128x128 block's E8M0 byte repeated over its rows
    (from ``row_offset`` into the first block's) and its four 32-wide groups."""
    weight = codes.view(mx.uint8).view(mx.uint32)
    if mode == "mxfp4":
        return [weight, exponents.astype(mx.uint8)]
    rows, cols = codes.shape[-2:]
    grid = mx.repeat(exponents.astype(mx.uint8), 128, axis=-2)[..., row_offset:row_offset + rows, :]
    return [weight, mx.contiguous(mx.repeat(grid, 4, axis=-1)[..., : cols // 32])]


def stack_experts(experts: Sequence[mx.array]) -> mx.array:
    """[E] x [out, in] -> [E, out, in], expert e at row e (SwitchLinear layout)."""
    return mx.stack(list(experts), axis=0)


def split_gate_up(gate_up: mx.array, half: int) -> mx.array:
    """Fused [E, 2I, H] -> gate (half 0) or up (half 1), each [E, I, H]."""
    mid = gate_up.shape[-2] // 2
    return gate_up[..., :mid, :] if half == 0 else gate_up[..., mid:, :]


def conv_axis(w: mx.array) -> mx.array:
    """Depthwise conv1d weight, PyTorch [C, 1, K] -> MLX [C, K, 1]."""
    return mx.moveaxis(w, 2, 1)


def shift_norm(w: mx.array) -> mx.array:
    """Zero-centred RMSNorm weight (y = x * (1 + w)) -> MLX RMSNorm weight (y = x * w).

    Computed in float32 so a bf16 source does not lose the low bits of w before the
    final cast.
    """
    return w.astype(mx.float32) + 1.0


def patch_channels_last(w: mx.array) -> mx.array:
    """Vision patch-embed Conv3d [O, C, T, H, W] -> MLX channels-last [O, T, H, W, C]."""
    return w.transpose(0, 2, 3, 4, 1)


def cast(w: mx.array, dtype: str) -> mx.array:
    target = getattr(mx, dtype)
    return w if w.dtype == target else w.astype(target)


def quantize(w: mx.array, q: QuantSpec) -> List[mx.array]:
    """-> [packed weight, scales] (+ biases for affine), as mlx.nn.QuantizedLinear stores them.

    On a GPU backend affine 2/4/8-bit goes through ``affine_quantize``: MLX's CUDA kernel does
    not give its CPU kernel's bytes, and a conversion's shards must not depend on where it ran.
    """
    out = mx.quantize(w, group_size=q.group_size, bits=q.bits, mode=q.mode)
    out = [a for a in out if a is not None]
    if q.mode == "affine" and q.bits in AFFINE_BITS and w.dtype in FLOAT_DTYPES and kernel_differs_from_cpu():
        exact = affine_quantize(w, q.bits, q.group_size)
        # a non-finite group keeps MLX's own result (lazy select: no host sync in the pipeline)
        finite = mx.all(mx.isfinite(exact[1])) & mx.all(mx.isfinite(exact[2]))
        out = [mx.where(finite, a, b) for a, b in zip(exact, out)]
    return out


def kernel_differs_from_cpu() -> bool:
    """Whether MLX's ``mx.quantize`` here may not give its CPU kernel's bytes (any GPU backend)."""
    return mx.default_device().type != mx.DeviceType.cpu


AFFINE_BITS = (2, 4, 8)  # widths whose codes tile a 32-bit word
FLOAT_DTYPES = (mx.bfloat16, mx.float16, mx.float32)


def affine_quantize(w: mx.array, bits: int, group_size: int) -> List[mx.array]:
    """MLX's CPU affine quantization as elementwise MLX ops: ``[packed uint32, scales, biases]``.

    The scale/bias rule and the code rounding are the CPU kernel's float32 operations in its
    order (as in ``npquant``); each is an exactly rounded op, so the bytes do not depend on the
    backend (``tests/test_ops.py`` compares them with the CPU kernel; the GPU check is
    ``benchmarks/quantize_exact.py``). Non-finite groups are not reproduced.
    """
    *lead, cols = w.shape
    x = w.astype(mx.float32).reshape(-1, cols // group_size, group_size)
    n_bins = float((1 << bits) - 1)
    w_max = mx.max(x, axis=-1, keepdims=True)
    w_min = mx.min(x, axis=-1, keepdims=True)
    mask = mx.abs(w_min) > mx.abs(w_max)
    span = mx.maximum((w_max - w_min) / n_bins, 1e-7)
    scale = mx.where(mask, span, -span)
    edge = mx.where(mask, w_min, w_max)
    q0 = mx.round(edge / scale)
    nonzero = q0 != 0
    scale = mx.where(nonzero, edge / mx.where(nonzero, q0, 1.0), scale)
    bias = mx.where(nonzero, edge, 0.0)
    codes = mx.clip(mx.round((x - bias) / scale), 0.0, n_bins).astype(mx.uint32)
    per_word = 32 // bits
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
    packed = mx.sum(codes.reshape(-1, cols // per_word, per_word) << shifts, axis=-1)  # disjoint fields: sum = OR
    shape = (*lead, -1)
    return [packed.reshape(shape), scale.astype(w.dtype).reshape(shape), bias.astype(w.dtype).reshape(shape)]


def split_kv_b(w: mx.array, how: Gather, heads: int, own: int) -> mx.array:
    """kv_b_proj rows of ``heads`` heads [heads*(nope+v), kv_lora] -> embed_q [heads, kv_lora, nope]
    (``own`` = nope) or unembed_out [heads, v, kv_lora] (``own`` = v), as mlx-lm's sanitize splits it."""
    per_head = w.reshape(heads, -1, w.shape[-1])
    nope = own if how is Gather.EMBED_Q else per_head.shape[1] - own
    if how is Gather.EMBED_Q:
        return mx.contiguous(per_head[:, :nope, :].swapaxes(-1, -2))
    return mx.contiguous(per_head[:, nope:, :])


def gather(sources: Sequence[mx.array], how: Gather) -> mx.array:
    if how is Gather.LOAD:
        (w,) = sources
        return w
    if how is Gather.STACK:
        return stack_experts(sources)
    if how in (Gather.GATE_HALF, Gather.UP_HALF):
        return split_gate_up(sources[0], how.half)
    if how is Gather.VISION_PATCH:
        return patch_channels_last(sources[0])
    raise TypeError(f"unknown gather {how!r}")


def apply_steps(w: mx.array, steps: Sequence[Step]) -> List[mx.array]:
    """Run the plan's step chain after gathering; returns the output tensors in order."""
    for step in steps:
        if isinstance(step, GATHER_STEPS):
            continue  # done by gather()
        if isinstance(step, ConvAxis):
            w = conv_axis(w)
        elif isinstance(step, ShiftNorm):
            w = shift_norm(w)
        elif isinstance(step, Cast):
            w = cast(w, step.dtype)
        elif isinstance(step, Quantize):
            return quantize(w, step.spec)
        else:
            raise TypeError(f"unknown step {step!r}")
    return [w]
