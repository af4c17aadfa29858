"""Pure tensor transforms, one job each. The plan names them as typed steps; ``apply_steps`` runs them."""

from __future__ import annotations

from typing import List, Sequence

import mlx.core as mx

from ..plan.quant import QuantSpec
from ..plan.steps import GATHER_STEPS, Cast, ConvAxis, Gather, Quantize, ShiftNorm, Step


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
    """-> [packed weight, scales] (+ biases for affine), as mlx.nn.QuantizedLinear stores them."""
    out = mx.quantize(w, group_size=q.group_size, bits=q.bits, mode=q.mode)
    return [a for a in out if a is not None]


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
