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
