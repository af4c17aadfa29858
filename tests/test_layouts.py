"""Plans for every published Qwen3.5/3.6 layout, built from the real tensor tables (no data)."""

import re
from pathlib import Path

import layouts

import pytest

from mtpconvert.errors import ConfigError
from mtpconvert.options import ConvertOptions
from mtpconvert.plan import build_plan
from mtpconvert.options import QuantOptions
from mtpconvert.io.header import TensorInfo
from mtpconvert.io.checkpoint import Checkpoint

MODELS = layouts.models()


def test_the_vendored_tables_are_all_there():
    assert len(MODELS) >= 11  # Qwen3.5 0.8B-397B, Qwen3.6 27B/35B, Qwen3-Next: a fresh clone has them all


def table_checkpoint(name: str) -> Checkpoint:
    folder = layouts.LAYOUTS / name
    tensors = {}
    shards = []
    for key, shape, dtype, shard in layouts.rows(name):
        shard = shard if shard.endswith(".safetensors") else "unknown.safetensors"
        if shard not in shards:
            shards.append(shard)
        tensors[key] = TensorInfo(key, dtype, shape, Path(folder / shard), 0, 0)
    return Checkpoint(root=folder, config=layouts.config(name), shards=sorted(shards), headers={}, tensors=tensors)


@pytest.mark.parametrize("name", MODELS)
def test_published_layout_plans_cleanly(name):
    ckpt = table_checkpoint(name)
    if name.startswith("Qwen3-Next"):
        with pytest.raises(ConfigError, match="qwen3_next"):
            build_plan(ckpt)
        return
    plan = build_plan(ckpt, ConvertOptions(quant=QuantOptions(bits=4)))
    # every text tensor is consumed; only the vision tower is dropped
    used = {s.key for it in plan.items for s in it.sources}
    dropped = {k for k, _ in plan.dropped}
    assert used | dropped == set(ckpt.tensors)
    assert all(k.startswith("model.visual.") for k in dropped)
    assert plan.raw and plan.mtp_layers == 1
    names = {it.name for it in plan.items}
    assert "mtp.fc.weight" in names
    spec = plan.spec
    assert ("language_model.lm_head.weight" in names) == (not spec.tie_word_embeddings)
    if spec.is_moe:
        assert "mtp.layers.0.mlp.switch_mlp.gate_proj.weight" in names
        assert not any(".experts." in n for n in names)
    # A_log: F32 in Qwen3.5, BF16 in Qwen3.6 - always float32 out
    a_log = next(it for it in plan.items if it.name.endswith("layers.0.linear_attn.A_log"))
    assert a_log.dtype == "float32"


def test_qwen35_shard_names_and_fused_backbone():
    ckpt = table_checkpoint("Qwen3.5-35B-A3B")
    assert any(re.fullmatch(r"model\.safetensors-000\d\d-of-00014\.safetensors", s) for s in ckpt.shards)
    plan = build_plan(ckpt)
    items = {it.name: it for it in plan.items}
    assert items["language_model.model.layers.0.mlp.switch_mlp.gate_proj.weight"].gather == "gate_half"
    assert items["mtp.layers.0.mlp.switch_mlp.gate_proj.weight"].gather == "stack"
    assert items["mtp.layers.0.mlp.switch_mlp.gate_proj.weight"].slot.shape == (256, 512, 2048)


@pytest.mark.parametrize("name", ["Qwen3.5-35B-A3B", "Qwen3.5-122B-A10B", "Qwen3.5-397B-A17B", "Qwen3.6-35B-A3B"])
@pytest.mark.parametrize("mtp, mtp_bits", [("match", None), ("bits", 4)])
def test_a_quantized_moe_head_is_one_width_for_the_runtimes_that_dequantize_it(name, mtp, mtp_bits):
    """--mtp match / --mtp-bits on a real MoE release (hidden a multiple of 64, so mlx-lm's 8-bit router rule
    would apply): the head's routers stay float and every quantized head module has the backbone's
    bits/group, so mtplx and vllm-mlx (which dequantize the head with the top-level bits) can use it."""
    from mtpconvert.compat import compat, planned_folder

    ckpt = table_checkpoint(name)
    plan = build_plan(ckpt, ConvertOptions(quant=QuantOptions(bits=4, group_size=64, mtp=mtp, mtp_bits=mtp_bits)))
    head = {it.name: it for it in plan.items if it.name.startswith("mtp.")}
    routers = [n for n in head if n.endswith(("mlp.gate.weight", "shared_expert_gate.weight"))]
    assert routers and all(head[n].quant is None for n in routers)
    quantized = {(it.quant.bits, it.quant.group_size) for it in head.values() if it.quant is not None}
    assert quantized == {(4, 64)} and head["mtp.fc.weight"].quant is None
    backbone_routers = [it for it in plan.items if it.name.endswith("layers.0.mlp.gate.weight")
                        and not it.name.startswith("mtp.")]
    assert backbone_routers and all(it.quant.bits == 8 for it in backbone_routers)  # mlx-lm's rule, kept
    report = compat(planned_folder(plan))
    for runtime in ("mlx-vlm", "mtplx", "vllm-mlx"):
        assert report.get(runtime).head_usable.ok, (runtime, report.get(runtime).head_usable.reason)
    assert not report.get("rapid-mlx").head_usable.ok  # fc stays float: rapid-mlx wants it like the rest
