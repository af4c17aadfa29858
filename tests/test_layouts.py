"""Plans for every published Qwen3.5/3.6/3.8 layout, built from the real tensor tables (no data)."""

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
    assert len(MODELS) >= 12  # Qwen3.5 0.8B-397B, Qwen3.6 27B/35B, Qwen3.8-27B, Qwen3-Next: a fresh clone has them all
    assert "Qwen3.8-27B" in MODELS


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


# ---------------------------------------------------- Qwen3.8-27B (issue #27): qwen3_5, the 3.6-27B architecture

QWEN38 = "Qwen3.8-27B"
QWEN38_LAST = "model-00018-of-00018.safetensors"  # lm_head.weight and all 15 mtp.* (published)
QWEN38_HEAD_NORMS = {"mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
                     "mtp.layers.0.input_layernorm.weight", "mtp.layers.0.post_attention_layernorm.weight",
                     "mtp.layers.0.self_attn.q_norm.weight", "mtp.layers.0.self_attn.k_norm.weight"}


def test_qwen38_27b_table_is_the_published_release():
    """18 shards named model-000NN-of-00018, 1,199 BF16 tensors (A_log too), 15 of them mtp.*, all in the last shard
    beside lm_head; the config is Qwen3.6-27B's architecture under model_type qwen3_5."""
    import math

    ckpt = table_checkpoint(QWEN38)
    assert ckpt.shards == [f"model-{i:05d}-of-00018.safetensors" for i in range(1, 19)]
    assert len(ckpt.tensors) == 1199 and {t.dtype for t in ckpt.tensors.values()} == {"BF16"}
    assert sum(math.prod(t.shape) * 2 for t in ckpt.tensors.values()) == 55_562_855_904  # published data bytes
    mtp = {k for k in ckpt.tensors if k.startswith("mtp.")}
    assert len(mtp) == 15 and sum(math.prod(ckpt.tensors[k].shape) * 2 for k in mtp) == 849_398_784
    assert {k for k, t in ckpt.tensors.items() if t.file.name == QWEN38_LAST} == mtp | {"lm_head.weight"}
    assert ckpt.config["model_type"] == "qwen3_5" and ckpt.config["text_config"]["mtp_num_hidden_layers"] == 1
    assert {k: v for k, v in ckpt.config.items() if k != "transformers_version"} == {
        k: v for k, v in layouts.config("Qwen3.6-27B").items() if k != "transformers_version"}


@pytest.mark.parametrize("quant, outputs, quantized_head", [
    (dict(), 866, 0),  # the default: no quantization, float head
    (dict(bits=4), 1862, 0),  # the recipes: 4-bit backbone, float head
    (dict(bits=4, mtp="match"), 1876, 7),
    (dict(bits=4, mtp_bits=8), 1876, 7),
], ids=["default", "bits4", "bits4-match", "bits4-mtp-bits8"])
def test_qwen38_27b_keeps_exactly_its_15_mtp_tensors(quant, outputs, quantized_head):
    """Every plan of Qwen3.8-27B reads the 15 raw mtp.* and lm_head from the last shard and writes exactly those
    15 head tensors (with scales and biases where quantized) to the sidecar, with the +1 on the head's 7
    zero-centred norms; mtp.fc and the norms stay float."""
    from mtpconvert.io.checkpoint import MTP_FILE
    from mtpconvert.plan.steps import ShiftNorm

    ckpt = table_checkpoint(QWEN38)
    plan = build_plan(ckpt, ConvertOptions(quant=QuantOptions(**quant)))
    head = plan.head_items
    raw_mtp = {k for k in ckpt.tensors if k.startswith("mtp.")}
    assert sorted(s.key for it in head for s in it.sources) == sorted(raw_mtp) and len(head) == 15
    assert {it.name for it in head} == raw_mtp  # same names in the sidecar
    assert {s.file for it in head for s in it.sources} == {QWEN38_LAST} and {it.shard for it in head} == {MTP_FILE}
    lm_head = next(it for it in plan.items if it.name == "language_model.lm_head.weight")
    assert [(s.key, s.file) for s in lm_head.sources] == [("lm_head.weight", QWEN38_LAST)]
    assert lm_head.shard != MTP_FILE and (lm_head.quant is not None) == bool(quant.get("bits"))
    assert sum(len(it.outputs()) for it in plan.items) == outputs
    head_outputs = 15 + 2 * quantized_head  # .scales + .biases per quantized module
    assert sum(len(it.outputs()) for it in head) == head_outputs
    assert plan.config["mlx_lm_extra_tensors"] == {"mtp_file": MTP_FILE, "mtp_tensor_count": head_outputs}
    assert {it.name for it in head if any(isinstance(s, ShiftNorm) for s in it.steps)} == QWEN38_HEAD_NORMS
    assert sum(it.quant is not None for it in head) == quantized_head
    floats = {it.name for it in head if it.quant is None}
    assert {"mtp.fc.weight"} | QWEN38_HEAD_NORMS <= floats
    if quantized_head:
        assert {it.quant.bits for it in head if it.quant} == {quant.get("mtp_bits") or quant["bits"]}


def test_qwen38_27b_without_the_head_is_the_mlx_community_4bit_layout():
    """mlx-community/Qwen3.8-27B-4bit (published: 3 shards, 2,180 tensors, 333 vision_tower.*, no mtp.*) is what
    --bits 4 --keep-vision --mtp drop plans from this table: the folder add-mtp grafts the head onto."""
    plan = build_plan(table_checkpoint(QWEN38),
                      ConvertOptions(keep_vision=True, quant=QuantOptions(bits=4, mtp="drop")))
    keys = [o.key for it in plan.items for o in it.outputs()]
    assert len(keys) == 2180 and sum(k.startswith("vision_tower.") for k in keys) == 333
    assert not any(k.startswith("mtp.") for k in keys) and plan.mtp_layers == 0
    assert plan.shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
