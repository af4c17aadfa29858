import mlx.core as mx
import numpy as np
import pytest

from mtpconvert.execute import ops as T
from mtpconvert.plan.quant import QuantSpec


def test_stack_experts_keeps_order():
    experts = [mx.full((2, 3), float(e)) for e in range(4)]
    out = T.stack_experts(experts)
    assert out.shape == (4, 2, 3)
    assert [float(out[e, 0, 0]) for e in range(4)] == [0, 1, 2, 3]


def test_split_gate_up_halves():
    gate = mx.random.normal((3, 4, 5))
    up = mx.random.normal((3, 4, 5))
    fused = mx.concatenate([gate, up], axis=1)
    assert mx.array_equal(T.split_gate_up(fused, 0), gate)
    assert mx.array_equal(T.split_gate_up(fused, 1), up)


def test_conv_axis_moves_kernel_last_to_middle():
    w = mx.arange(2 * 4).reshape(2, 1, 4)
    out = T.conv_axis(w)
    assert out.shape == (2, 4, 1)
    assert np.array_equal(np.array(out)[:, :, 0], np.array(w)[:, 0, :])


def test_shift_norm_in_float32():
    w = mx.array([-0.25, 0.0, 0.5], dtype=mx.bfloat16)
    out = T.shift_norm(w)
    assert out.dtype == mx.float32
    assert np.allclose(np.array(out), [0.75, 1.0, 1.5])


def test_cast_and_quantize_shapes():
    w = mx.random.normal((8, 128))
    assert T.cast(w, "float16").dtype == mx.float16
    out = T.quantize(w, QuantSpec(4, 64))
    assert [a.shape for a in out] == [(8, 16), (8, 2), (8, 2)]
    spec = QuantSpec(4, 32, "mxfp4")
    out = T.quantize(w, spec)
    assert len(out) == 2 and out[1].dtype == mx.uint8
    assert out[0].shape == spec.packed_shape(w.shape) and out[1].shape == spec.scales_shape(w.shape)


def test_apply_steps_rejects_unknown():
    with pytest.raises(TypeError):
        T.apply_steps(mx.zeros((2,)), ["norm+1"])  # a label is not a step


def test_step_chain_runs_in_order():
    from mtpconvert.plan.steps import Cast, ConvAxis, Quantize, ShiftNorm

    w = mx.zeros((4, 1, 3))
    (out,) = T.apply_steps(w, (ConvAxis(), ShiftNorm(), Cast("float16")))
    assert out.shape == (4, 3, 1) and out.dtype == mx.float16 and float(out.sum()) == 12
    q = T.apply_steps(mx.ones((8, 64)), (Cast("float32"), Quantize(QuantSpec(4, 64))))
    assert len(q) == 3 and q[0].dtype == mx.uint32
