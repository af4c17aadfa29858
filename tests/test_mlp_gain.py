"""The MLP gain's pieces: the paired difference and the MLP swapped out for zeros and back."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from mtpconvert.runtime.smoke.mlp_gain import matches, mlp_removed, paired_gain


def test_paired_gain_counts_discordant_positions():
    intact = [True, True, True, False, False, True]
    removed = [True, False, False, True, False, True]
    g = paired_gain(intact, removed)
    assert (g.helped, g.hurt, g.positions) == (2, 1, 6)
    assert g.gain == pytest.approx(1 / 6)
    assert g.low < g.gain < g.high and g.high - g.gain == pytest.approx(g.gain - g.low)


def test_paired_gain_of_identical_drafts_is_exactly_zero():
    g = paired_gain([True, False, True], [True, False, True])
    assert (g.gain, g.low, g.high) == (0.0, 0.0, 0.0)


def test_matches_compares_over_the_shorter():
    assert matches([1, 2, 3], [1, 5]) == (True, False)


class _Layer(nn.Module):
    """DecoderLayer's shape: out = h + mlp(norm(h))."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.Linear(4, 4)

    def __call__(self, x):
        return x + self.mlp(x)


def test_mlp_removed_zeroes_the_mlp_and_puts_it_back():
    layer = _Layer()
    x = mx.random.normal((2, 4), key=mx.random.key(1))
    mlp = layer.mlp
    with mlp_removed(layer):
        assert mx.array_equal(layer(x), x)
    assert layer.mlp is mlp and not mx.array_equal(layer(x), x)
