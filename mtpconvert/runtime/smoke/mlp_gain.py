"""MLP gain: does the MTP layer's MLP help the head's drafts?

A head whose MLP weights are scrambled (experts stacked in the wrong order, gate and up swapped)
still drafts from its attention, ``fc`` and norms: on a small MoE it loses only the few points the
MLP carries, too few for any acceptance floor. So the head is scored twice over the same
teacher-forced positions, once intact and once with its decoder layer's MLP output removed
(``h + mlp(norm(h))`` becomes ``h``: routed and shared experts alike, no weight copied):

    mlp_gain = acceptance(intact) - acceptance(MLP removed)

A correct head's MLP is part of what it learned, so removing it costs acceptance (gain clearly
positive); a scrambled MLP adds noise, so removing it costs nothing or helps (gain <= 0). The
measured separation and the floor: docs/runtime.md ("The smoke floor").
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

Z95 = 1.959964


class _NoMLP(nn.Module):
    """Stands in for a decoder layer's MLP: contributes nothing to the residual stream."""

    def __call__(self, x: mx.array, *routing) -> mx.array:
        """``routing``: what else a layer hands its MLP (the token ids a hash-routed MoE reads)."""
        return mx.zeros_like(x)


@contextmanager
def mlp_removed(layer: nn.Module) -> Iterator[nn.Module]:
    """``layer`` (an mlx-lm ``DecoderLayer``) with its ``mlp`` swapped out for zeros while inside;
    the MLP module (and its weights) is put back untouched on exit."""
    mlp = layer.mlp
    layer.mlp = _NoMLP()
    try:
        yield layer
    finally:
        layer.mlp = mlp


@dataclass(frozen=True)
class PairedGain:
    """``intact`` minus ``removed`` agreement rates over the same positions, with a 95% normal
    interval of the paired per-position differences (each in {-1, 0, +1})."""

    gain: float
    low: float
    high: float
    positions: int
    helped: int  # positions the MLP turned into an agreement
    hurt: int  # positions it turned away from one

    def to_json(self) -> dict:
        return {"mlp_gain": round(self.gain, 4), "mlp_gain_ci95": [round(self.low, 4), round(self.high, 4)],
                "positions": self.positions, "mlp_helped": self.helped, "mlp_hurt": self.hurt}


def paired_gain(intact: Sequence[bool], removed: Sequence[bool]) -> PairedGain:
    """Paired difference of two agreement sequences over the same positions."""
    n = min(len(intact), len(removed))
    helped = sum(1 for a, b in zip(intact[:n], removed[:n]) if a and not b)
    hurt = sum(1 for a, b in zip(intact[:n], removed[:n]) if b and not a)
    if n == 0:
        return PairedGain(0.0, 0.0, 0.0, 0, 0, 0)
    gain = (helped - hurt) / n
    # variance of d in {-1, 0, 1}: E[d^2] - E[d]^2, with E[d^2] the discordant share
    var = max(0.0, (helped + hurt) / n - gain * gain)
    half = Z95 * math.sqrt(var / n)
    return PairedGain(gain, gain - half, gain + half, n, helped, hurt)


def matches(reference: Sequence[int], draft: Sequence[int]) -> Tuple[bool, ...]:
    """Per position: does ``draft`` equal ``reference`` (compared over the shorter of the two)."""
    return tuple(a == b for a, b in zip(reference, draft))
