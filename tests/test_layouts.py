"""Plans for every published Qwen3.5/3.6/3.8 layout, built from the real tensor tables (no data)."""

import re
from pathlib import Path

import numpy as np
import pytest

from tests import fp8
from tools import layouts

from mtpconvert.errors import ConfigError
from mtpconvert.options import ConvertOptions
from mtpconvert.plan import build_plan
from mtpconvert.options import QuantOptions
from mtpconvert.io.header import TensorInfo
from mtpconvert.io.checkpoint import Checkpoint

MODELS = layouts.models()
# the GLM tables: tests/test_glm.py; Nemotron-3 Super's: tests/test_nemotron_h.py; DeepSeek-V4-Flash's below
QWEN = [m for m in MODELS if not m.startswith(("GLM-", "DeepSeek-", "NVIDIA-Nemotron-"))]


def test_the_vendored_tables_are_all_there():
    assert len(MODELS) >= 15  # Qwen3.5 0.8B-397B, Qwen3.6 27B/35B, Qwen3.8-27B, the FP8 releases, Qwen3-Next
    assert {"Qwen3.8-27B", *FP8_TWINS} <= set(MODELS)


def table_checkpoint(name: str) -> Checkpoint:
    """A release's published layout as a checkpoint (headers only); a release with no vendored table whose numbers
    are derived from another's (``DERIVED_FP8``) is that table stored the block-FP8 way (``fp8_rows``)."""
    if name in DERIVED_FP8:
        bf16 = DERIVED_FP8[name]
        config = dict(layouts.config(bf16), quantization_config=fp8.quantization_config([]))
        return rows_checkpoint(layouts.LAYOUTS / bf16, fp8_rows(bf16), config)
    return rows_checkpoint(layouts.LAYOUTS / name, layouts.rows(name), layouts.config(name))


def rows_checkpoint(folder: Path, rows, config: dict) -> Checkpoint:
    tensors = {}
    shards = []
    for key, shape, dtype, shard in rows:
        shard = shard if shard.endswith(".safetensors") else "unknown.safetensors"
        if shard not in shards:
            shards.append(shard)
        tensors[key] = TensorInfo(key, dtype, shape, Path(folder / shard), 0, 0)
    return Checkpoint(root=folder, config=config, shards=sorted(shards), headers={}, tensors=tensors)


@pytest.mark.parametrize("name", QWEN)
def test_published_layout_plans_cleanly(name):
    ckpt = table_checkpoint(name)
    plan = build_plan(ckpt, ConvertOptions(quant=QuantOptions(bits=4)))
    # every text tensor is consumed (an FP8 weight's block scale with it); only the vision tower is dropped
    used = {r.key for it in plan.items for s in it.sources for r in (s, s.scale) if r is not None}
    dropped = {k for k, _ in plan.dropped}
    assert used | dropped == set(ckpt.tensors)
    assert all(k.startswith("model.visual.") for k in dropped)
    assert plan.raw and plan.mtp_layers == 1
    names = {it.name for it in plan.items}
    assert "mtp.fc.weight" in names
    spec = plan.spec
    assert (plan.family.lm_head in names) == (not spec.tie_word_embeddings)
    if spec.is_moe:
        assert "mtp.layers.0.mlp.switch_mlp.gate_proj.weight" in names
        assert not any(".experts." in n for n in names)
    # A_log: F32 in Qwen3.5, BF16 in Qwen3.6 - always float32 out
    a_log = next(it for it in plan.items if it.name.endswith("layers.0.linear_attn.A_log"))
    assert a_log.dtype == "float32"


@pytest.mark.parametrize("bits", [None, 4])
def test_deepseek_v4_flash_table_plans_cleanly(bits):
    """Every tensor of the DeepSeek-V4-Flash table (weights, FP8 and MXFP4 scales) is consumed by the plan, none
    dropped; at 4 bits the routed experts of the 43 layers and of the head are carried as mxfp4 and nothing else
    is; in float they and every FP8 matrix are dequantized to the dtype asked."""
    ckpt = table_checkpoint("DeepSeek-V4-Flash")
    quant = QuantOptions(bits=bits, mtp="match" if bits else "keep")
    plan = build_plan(ckpt, ConvertOptions(dtype="bfloat16", quant=quant))
    used = {r.key for it in plan.items for s in it.sources for r in (s, s.scale) if r is not None}
    assert used == set(ckpt.tensors) and not plan.dropped and plan.mtp_layers == 1
    experts = [it for it in plan.items if ".switch_mlp." in it.name and it.name.endswith(".weight")]
    assert len(experts) == 3 * 44
    assert sum(it.name.startswith("mtp.") for it in experts) == 3
    modes = {it.name: it.quant.mode if it.quant else None for it in plan.items}
    if bits:
        assert {modes[it.name] for it in experts} == {"mxfp4"}
        assert {m for n, m in modes.items() if ".switch_mlp." not in n} <= {"affine", None}
    else:
        assert set(modes.values()) == {None}


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


# ---------------------------------------------------- Qwen's block-FP8 releases (issue #27): one file per layer

FP8_TWINS = {"Qwen3.6-27B-FP8": "Qwen3.6-27B", "Qwen3.8-27B-FP8": "Qwen3.8-27B",
             "Qwen3.6-35B-A3B-FP8": "Qwen3.6-35B-A3B"}  # the BF16 release of each
# published FP8 releases with no vendored table (the recipes size them): the BF16 table, stored as fp8_rows says
DERIVED_FP8 = {"Qwen3.5-397B-A17B-FP8": "Qwen3.5-397B-A17B"}
F8 = "F8_E4M3"


def fp8_rows(name: str):
    """The rows of BF16 release ``name`` as Qwen's block-FP8 releases store them (the rule tests/fp8.py writes twins
    by): experts one by one; F8_E4M3 with a BF16 weight_scale_inv per 128x128 block where ``fp8.is_fp8_linear``;
    everything else as stored. The shard column is "?": an FP8 release's files are not derived."""
    for key, shape, dtype, _ in layouts.rows(name):
        views = fp8.split_fused_experts({key: np.broadcast_to(np.float32(0), shape)})  # shapes only: no memory
        for k, v in sorted(views.items()):
            if fp8.is_fp8_linear(k):
                yield from ((k, v.shape, F8, "?"), (k + "_scale_inv", fp8.grid(v.shape), "BF16", "?"))
            else:
                yield k, v.shape, dtype, "?"


@pytest.mark.parametrize("name", sorted(FP8_TWINS))
def test_the_fp8_storage_rule_makes_each_fp8_table_from_its_bf16_table(name):
    """Key for key, shape and dtype: so a release whose table is not vendored (DERIVED_FP8) is sized and planned from
    its BF16 table by a rule the published FP8 releases follow (Qwen3.6-27B-FP8 reproduces every published file size)."""
    assert sorted((k, tuple(s), d) for k, s, d, _ in fp8_rows(FP8_TWINS[name])) == sorted(
        (k, s, d) for k, s, d, _ in layouts.rows(name))


def outputs(plan) -> list:
    return sorted((o.key, o.dtype, tuple(o.shape)) for it in plan.items for o in it.outputs())


@pytest.mark.parametrize("name, tensors, data_bytes, head_tensors", [
    ("Qwen3.6-27B-FP8", 1606, 30_866_663_264, 22),
    ("Qwen3.8-27B-FP8", 1606, 30_866_663_264, 22),
    ("Qwen3.6-35B-A3B-FP8", 64196, 37_454_789_472, 1560),
])
def test_fp8_table_is_the_published_release(name, tensors, data_bytes, head_tensors):
    """layers-{i}.safetensors per decoder layer, mtp.safetensors (every mtp.* and nothing else), outside.safetensors;
    the published tensor count; the table's data bytes (27B: every published file size follows from them); every
    F8_E4M3 weight beside its BF16 weight_scale_inv in its file."""
    import math

    ckpt = table_checkpoint(name)
    text = ckpt.config["text_config"]
    assert ckpt.config["quantization_config"]["quant_method"] == "fp8"
    assert ckpt.shards == sorted([f"layers-{i}.safetensors" for i in range(text["num_hidden_layers"])]
                                 + ["mtp.safetensors", "outside.safetensors"])
    size = {"F8_E4M3": 1, "BF16": 2, "F32": 4}
    assert len(ckpt.tensors) == tensors
    assert sum(math.prod(t.shape) * size[t.dtype] for t in ckpt.tensors.values()) == data_bytes
    head = {k for k in ckpt.tensors if k.startswith("mtp.")}
    assert {k for k, t in ckpt.tensors.items() if t.file.name == "mtp.safetensors"} == head and len(head) == head_tensors
    f8 = {k for k, t in ckpt.tensors.items() if t.dtype == F8}
    scales = {k for k in ckpt.tensors if k.endswith(".weight_scale_inv")}
    assert f8 and scales == {k + "_scale_inv" for k in f8}
    assert all(ckpt.tensors[k + "_scale_inv"].dtype == "BF16" and ckpt.tensors[k + "_scale_inv"].file
               == ckpt.tensors[k].file for k in f8)
    assert ckpt.tensors["mtp.fc.weight"].dtype == "BF16"


QUANTS = {"bits4": dict(bits=4), "match": dict(bits=4, mtp="match"), "float": dict()}


@pytest.mark.parametrize("name, quant", [(n, q) for n in sorted(FP8_TWINS) for q in QUANTS]
                         + [(n, "match") for n in sorted(DERIVED_FP8)])  # 397B: its recipe's options (6 s a plan)
def test_fp8_release_plans_like_its_bf16_release(name, quant):
    """Every F8_E4M3 tensor is read by exactly one item, through a dequant step that comes first, with its own scale
    (name, file, 128-block grid); no other item dequantizes; mtp.fc is read BF16 as stored. What comes out is the
    BF16 release's plan: the same output tensors (keys, dtypes, shapes), config and head."""
    from mtpconvert.plan.items import SourceRef
    from mtpconvert.plan.steps import DequantFP8

    ckpt = table_checkpoint(name)
    options = ConvertOptions(quant=QuantOptions(**QUANTS[quant]))
    plan, bf16 = build_plan(ckpt, options), build_plan(table_checkpoint({**FP8_TWINS, **DERIVED_FP8}[name]), options)
    read = []
    for it in plan.items:
        f8 = [s for s in it.sources if s.dtype == F8]
        dequant = [s for s in it.steps if isinstance(s, DequantFP8)]
        assert (dequant == [DequantFP8(128)] and it.steps[0] == dequant[0]) if f8 else not dequant, it.name
        assert len(f8) in (0, len(it.sources)), it.name  # an item reads FP8 or float sources, never both
        for s in it.sources:
            grid = tuple(-(-d // 128) for d in s.shape)
            want = SourceRef(s.key + "_scale_inv", s.file, grid, "BF16") if s.dtype == F8 else None
            assert s.scale == want and (want is None or s.file == ckpt.tensors[s.key].file.name), s.key
        read += [s.key for s in f8]
    assert sorted(read) == sorted(k for k, t in ckpt.tensors.items() if t.dtype == F8)
    fc = next(it for it in plan.items if it.name == "mtp.fc.weight")
    raw_fc = ckpt.tensors["mtp.fc.weight"]
    assert fc.sources == (SourceRef("mtp.fc.weight", raw_fc.file.name, raw_fc.shape, "BF16"),)
    assert fc.quant is None and not any(isinstance(s, DequantFP8) for s in fc.steps)
    head_files = {t.file.name for k, t in ckpt.tensors.items() if k.startswith("mtp.")}  # mtp.safetensors
    assert {r.file for it in plan.head_items for s in it.sources for r in (s, s.scale) if r} == head_files
    assert sum(len(it.outputs()) for it in plan.items) == sum(len(it.outputs()) for it in bf16.items)
    assert outputs(plan) == outputs(bf16) and plan.config == bf16.config and plan.mtp_layers == bf16.mtp_layers == 1


def test_fp8_35b_a3b_stacks_its_experts_one_fp8_expert_at_a_time():
    """Qwen3.6-35B-A3B-FP8 stores every routed expert by itself (the BF16 release fuses them), the head's 256 too:
    each stacked projection reads expert e's F8_E4M3 weight and its own scale at row e, from the layer's file."""
    from mtpconvert.families.base import Gather

    ckpt = table_checkpoint("Qwen3.6-35B-A3B-FP8")
    plan = build_plan(ckpt, ConvertOptions(quant=QuantOptions(bits=4)))
    items = {it.name: it for it in plan.items}
    for out, raw, file in (("mtp.layers.0.mlp", "mtp.layers.0.mlp", "mtp.safetensors"),
                           ("language_model.model.layers.39.mlp", "model.language_model.layers.39.mlp",
                            "layers-39.safetensors")):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            it = items[f"{out}.switch_mlp.{proj}.weight"]
            keys = [f"{raw}.experts.{e}.{proj}.weight" for e in range(256)]
            assert it.gather is Gather.STACK and [s.key for s in it.sources] == keys, it.name
            assert [s.scale.key for s in it.sources] == [k + "_scale_inv" for k in keys]
            assert {(s.dtype, s.file, s.scale.file) for s in it.sources} == {(F8, file, file)}
            assert it.slot.shape == (256, *ckpt.tensors[keys[0]].shape)
            assert (it.quant is None) == out.startswith("mtp."), it.name  # --mtp keep: the head stays float
    head = {r.key for it in plan.head_items for s in it.sources for r in (s, s.scale) if r}
    assert head == {k for k in ckpt.tensors if k.startswith("mtp.")} and len(head) == 1560
