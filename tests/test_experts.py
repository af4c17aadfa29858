"""Float MoE experts on the CPU in float32 a bounded group at a time (runtime.decoding.experts): bit-identical
to casting the whole stack, and the layerwise check's results do not change."""

import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from mtpconvert.fixture import fixture_path
from mtpconvert.runtime.smoke import compute, shards
from mtpconvert.runtime.smoke.layerwise import layerwise_acceptance
from mtpconvert.runtime.smoke.decode import encode_prompts
from mtpconvert.runtime.decoding import experts
from mtpconvert.runtime.decoding.experts import BoundedSwitchGLU, BoundedSwitchMLP, bound_float_experts, expert_groups
from mtpconvert.runtime.decoding.load import float32_experts_on_cpu
from mtpconvert.demo import fixture_prompts

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the bounded path runs on mlx's CPU backend")


def _stored_glu(dims=64, hidden=32, n_experts=16, dtype=mx.bfloat16) -> SwitchGLU:
    mx.random.seed(0)
    glu = SwitchGLU(dims, hidden, n_experts)
    glu.update(tree_map(lambda v: v.astype(dtype), glu.parameters()))
    return glu


def _float32_copy(glu: SwitchGLU) -> SwitchGLU:
    """What float32_experts_on_cpu makes of it: the whole stack in float32."""
    ref = SwitchGLU(glu.gate_proj.input_dims, glu.gate_proj.output_dims, glu.gate_proj.num_experts)
    ref.update(tree_map(lambda v: v.astype(mx.float32), glu.parameters()))
    return ref


def _routing(tokens: int, n_experts: int, top_k: int) -> mx.array:
    scores = mx.random.normal((1, tokens, n_experts), key=mx.random.key(tokens))
    return mx.argpartition(scores, kth=-top_k, axis=-1)[..., -top_k:]


# tokens x top_k below 64 takes mlx-lm's unsorted path, above it the sorted one: both must match
@pytest.mark.parametrize("tokens", [5, 40])
@pytest.mark.parametrize("x_dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("budget", [1, 3 * 3 * 64 * 32 * 4, 1 << 30])  # 1 expert, 3 experts, all at once
def test_bounded_switch_glu_is_bit_identical_to_the_float32_stack(tokens, x_dtype, budget):
    glu = _stored_glu()
    x = mx.random.normal((1, tokens, 64), key=mx.random.key(1)).astype(x_dtype)
    indices = _routing(tokens, 16, 4)
    want = _float32_copy(glu)(x, indices)
    got = BoundedSwitchGLU(glu, budget)(x, indices)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert mx.array_equal(got, want).item()


@pytest.mark.parametrize("tokens", [5, 40])
@pytest.mark.parametrize("budget", [1, 2 * 64 * 32 * 4 * 3, 1 << 30])  # 1 expert, 3 experts, all at once
def test_bounded_switch_mlp_is_bit_identical_to_the_float32_stack(tokens, budget):
    """mlx-lm's non-gated SwitchMLP (Nemotron-H's relu² experts: fc1, activation, fc2) the same way."""
    import mlx.nn as nn

    mx.random.seed(0)
    mlp = SwitchMLP(64, 32, 16, activation=nn.ReLU2())
    mlp.update(tree_map(lambda v: v.astype(mx.bfloat16), mlp.parameters()))
    ref = SwitchMLP(64, 32, 16, activation=nn.ReLU2())
    ref.update(tree_map(lambda v: v.astype(mx.float32), mlp.parameters()))
    x = mx.random.normal((1, tokens, 64), key=mx.random.key(1))
    indices = _routing(tokens, 16, 4)
    got, want = BoundedSwitchMLP(mlp, budget)(x, indices), ref(x, indices)
    assert got.shape == want.shape and got.dtype == want.dtype and mx.array_equal(got, want).item()
    holder = nn.Module()
    holder.experts = mlp
    assert bound_float_experts(holder) == 1 and isinstance(holder.experts, BoundedSwitchMLP)


def test_experts_per_group_follows_the_budget():
    glu = _stored_glu()
    per_expert = 3 * 64 * 32 * 4
    assert BoundedSwitchGLU(glu, 1).group == 1
    assert BoundedSwitchGLU(glu, 3 * per_expert + per_expert // 2).group == 3
    assert experts.expert_float32_bytes(glu) == per_expert


def test_expert_groups_cover_every_pair_once_with_at_most_group_experts():
    flat = np.array([3, 1, 3, 0, 7, 1, 7, 7, 2, 5])
    order, groups = expert_groups(flat, 2)
    assert sorted(order.tolist()) == list(range(flat.size))
    assert [g[0].tolist() for g in groups] == [[0, 1], [2, 3], [5, 7]]
    for ids, lo, hi in groups:
        assert set(flat[order[lo:hi]].tolist()) == set(ids.tolist())
    assert groups[0][1] == 0 and groups[-1][2] == flat.size
    assert all(a[2] == b[1] for a, b in zip(groups, groups[1:]))


def test_bound_float_experts_keeps_the_stack_as_stored_and_skips_float32():
    holder = shards._Holder("switch_mlp", _stored_glu())
    assert bound_float_experts(holder) == 1
    assert isinstance(holder.switch_mlp, BoundedSwitchGLU)
    assert holder.switch_mlp.gate_proj["weight"].dtype == mx.bfloat16  # not cast
    f32 = shards._Holder("switch_mlp", _stored_glu(dtype=mx.float32))
    assert bound_float_experts(f32) == 0 and type(f32.switch_mlp) is SwitchGLU


@pytest.fixture(scope="module")
def moe_bf16(tmp_path_factory):
    """The MoE text fixture converted as published with --mtp keep and no --bits: bf16 experts in
    the backbone's layers and in the head."""
    out = tmp_path_factory.mktemp("experts") / "moe-bf16"
    subprocess.run([sys.executable, "-m", "mtpconvert", "convert", str(fixture_path("moe")), str(out), "--no-smoke"],
                   check=True, capture_output=True)
    return out


def test_layerwise_result_is_identical_to_casting_the_whole_stack(moe_bf16, monkeypatch):
    ids = encode_prompts(moe_bf16, fixture_prompts(3, length=40))
    # before: every float expert stack cast to float32, as the check did until the bounded path
    with monkeypatch.context() as m:
        m.setattr(compute, "bound_float_experts", float32_experts_on_cpu)
        before = layerwise_acceptance(moe_bf16, token_ids=ids)  # the default, as CI runs it
    swapped = []

    def bound_one_expert_at_a_time(module):
        swapped.append(bound_float_experts(module, budget_bytes=1))
        return swapped[-1]

    monkeypatch.setattr(compute, "bound_float_experts", bound_one_expert_at_a_time)
    after = layerwise_acceptance(moe_bf16, token_ids=ids)
    assert sum(swapped) > 0  # the bounded path ran (backbone layers and head)
    assert (after.agreed, after.compared) == (before.agreed, before.compared)
    assert after.backbone_next == before.backbone_next
    assert after.head_next == before.head_next
    assert after.head_next_without_mlp == before.head_next_without_mlp
    # the head's experts stay bf16: its resident stage is the stored size, not the float32 one
    head_stage = dict(after.stages)["mtp head (fc, norms, layer 0)"]
    assert head_stage < dict(before.stages)["mtp head (fc, norms, layer 0)"]


def test_recipes_size_runners_with_the_smokes_float32_budget():
    from mtpconvert.recipes import BUNDLED, SMOKE_FLOAT32_EXPERT_BYTES, load_recipe

    assert SMOKE_FLOAT32_EXPERT_BYTES == experts.FLOAT32_EXPERT_BUDGET_BYTES  # recipes.py cannot import mlx
    float_moe = load_recipe(BUNDLED / "Qwen3.5-122B-A10B-4bit-bf16.toml")  # --mtp keep: bf16 experts
    quantized_moe = load_recipe(BUNDLED / "Qwen3.5-397B-A17B-4bit-bf16.toml")  # --mtp match
    dense = load_recipe(BUNDLED / "Qwen3.5-27B-4bit-bf16.toml")
    assert float_moe.mtp == "keep" and quantized_moe.mtp == "match"
    assert float_moe.head_gb < float_moe.head_cpu_gb <= float_moe.head_gb + 1.5 * SMOKE_FLOAT32_EXPERT_BYTES / 1e9
    assert quantized_moe.head_cpu_gb == quantized_moe.head_gb  # quantized experts run as stored: nothing cast
    assert dense.head_cpu_gb == dense.head_gb  # no experts: nothing cast
