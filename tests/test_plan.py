"""The plan, from headers only: what each output tensor is and the rule that makes it."""

import json
import re

import pytest

from mtpconvert.plan.steps import ConvAxis, ShiftNorm
from mtpconvert.errors import ConfigError, LayoutError, OptionsError
from mtpconvert.options import ConvertOptions
from mtpconvert.plan import build_plan
from mtpconvert.options import QuantOptions
from mtpconvert.io.checkpoint import open_checkpoint


def plan_for(built, **kw):
    quant = kw.pop("quant", {})
    return build_plan(open_checkpoint(built.path), ConvertOptions(quant=QuantOptions(**quant), **kw))


def by_name(plan):
    return {it.name: it for it in plan.items}


SHIFTED = re.compile(r"(input_layernorm|post_attention_layernorm|q_norm|k_norm)\.weight$|"
                     r"model\.norm\.weight$|mtp\.(norm|pre_fc_norm_hidden|pre_fc_norm_embedding)\.weight$")


def test_shift_only_on_zero_centred_norms(raw_checkpoints):
    plan = plan_for(raw_checkpoints("moe-published35"))
    assert plan.raw
    for it in plan.items:
        assert (ShiftNorm() in it.steps) == bool(SHIFTED.search(it.name)), it.name
    items = by_name(plan)
    # the gated norm inside linear attention, A_log and dt_bias are never shifted
    for name in ("linear_attn.norm.weight", "linear_attn.A_log", "linear_attn.dt_bias"):
        it = items[f"language_model.model.layers.0.{name}"]
        assert ShiftNorm() not in it.steps
    assert items["language_model.model.layers.0.linear_attn.A_log"].dtype == "float32"
    assert ConvAxis() in items["language_model.model.layers.0.linear_attn.conv1d.weight"].steps
    # every MTP norm (head and layer) is shifted
    mtp_norms = [n for n, it in items.items() if n.startswith("mtp.") and ShiftNorm() in it.steps]
    assert len(mtp_norms) == 3 + 4


def test_experts_stacked_from_every_layout(raw_checkpoints):
    for layout, gather in [("moe-per-expert", "stack"), ("moe-fused", "gate_half"), ("moe-published35", "gate_half")]:
        items = by_name(plan_for(raw_checkpoints(layout)))
        gate = items["language_model.model.layers.0.mlp.switch_mlp.gate_proj.weight"]
        assert gate.gather == gather and gate.slot.shape == (4, 64, 64)
        up = items["language_model.model.layers.0.mlp.switch_mlp.up_proj.weight"]
        assert up.gather == ("stack" if gather == "stack" else "up_half")
        mtp_gate = items["mtp.layers.0.mlp.switch_mlp.gate_proj.weight"]
        if layout == "moe-published35":  # fused backbone, per-expert MTP
            assert mtp_gate.gather == "stack"
            assert [s.key for s in mtp_gate.sources] == [
                f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight" for e in range(4)]


def test_quantization_rules(raw_checkpoints):
    built = raw_checkpoints("moe-published35")
    for policy, quant in [("keep", dict(bits=4)), ("match", dict(bits=4, mtp="match")), ("bits", dict(bits=4, mtp_bits=8))]:
        plan = plan_for(built, quant=quant)
        items = by_name(plan)
        q = plan.config["quantization"]
        assert (q["bits"], q["group_size"], q["mode"]) == (4, 64, "affine")
        router = "language_model.model.layers.0.mlp.gate"
        assert items[router + ".weight"].quant.bits == 8 and q[router]["bits"] == 8
        assert q["language_model.model.layers.0.mlp.shared_expert_gate"]["bits"] == 8
        assert items["mtp.fc.weight"].quant is None
        assert q["mtp.fc"] is False
        mtp_proj = items["mtp.layers.0.self_attn.q_proj.weight"]
        if policy == "keep":
            assert mtp_proj.quant is None and q["mtp.layers.0.self_attn.q_proj"] is False
        elif policy == "match":
            assert mtp_proj.quant.bits == 4 and "mtp.layers.0.self_attn.q_proj" not in q
        else:
            assert mtp_proj.quant.bits == 8 and q["mtp.layers.0.self_attn.q_proj"]["bits"] == 8
        assert plan.config["quantization_config"] == q


def test_config_out_is_honest(raw_checkpoints):
    plan = plan_for(raw_checkpoints("dense-tie-top-level"), quant=dict(bits=4))
    tc = plan.config["text_config"]
    assert tc["tie_word_embeddings"] is True  # moved where mlx-lm reads it
    assert tc["mtp_num_hidden_layers"] == 1
    assert "vision_config" not in plan.config
    assert not any(it.name.endswith("lm_head.weight") for it in plan.items)
    dropped = build_plan(open_checkpoint(raw_checkpoints("dense-vlm").path),
                         ConvertOptions(quant=QuantOptions(mtp="drop")))
    assert dropped.config["text_config"]["mtp_num_hidden_layers"] == 0
    assert not any(".mtp." in it.name for it in dropped.items)
    text = plan_for(raw_checkpoints("dense-text"))
    assert text.config["model_type"] == "qwen3_5" and text.style == "raw-text"


def test_plan_orders_by_source_shard_and_shards_output(raw_checkpoints):
    built = raw_checkpoints("dense-sharded-tied")
    ckpt = open_checkpoint(built.path)
    assert len(ckpt.shards) == 3 and ckpt.shards[0].startswith("model.safetensors-00001-of-00003")
    plan = build_plan(ckpt, ConvertOptions(max_shard_bytes=64 << 10))
    last = [max(ckpt.shards.index(s.file) for s in it.sources) for it in plan.items]
    assert last == sorted(last)
    assert len(plan.model_shards) > 1
    assert all(re.match(r"model-\d{5}-of-\d{5}\.safetensors", s) for s in plan.model_shards)
    assert set(plan.shards) - set(plan.model_shards) == {"mtp.safetensors"}


def test_missing_mtp_under_config_claim(raw_checkpoints, tmp_path):
    from tests.checkpoints import build

    built = build(tmp_path / "nomtp", mtp_layers=0, config_mtp=1, tokenizer=False)
    with pytest.raises(LayoutError, match="promises mtp_num_hidden_layers=1") as e:
        plan_for(built)
    assert "--mtp drop" in str(e.value)
    assert plan_for(built, quant=dict(mtp="drop")).mtp_layers == 0


def test_mtp_weights_without_config(tmp_path):
    from tests.checkpoints import build

    built = build(tmp_path / "cfg0", mtp_layers=1, config_mtp=0, tokenizer=False)
    with pytest.raises(LayoutError, match="1 MTP layer.*mtp_num_hidden_layers=0"):
        plan_for(built)


def _without_mtp_count(folder):
    config = json.loads((folder / "config.json").read_text())
    config.get("text_config", config).pop("mtp_num_hidden_layers")
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("layers", [1, 2])
def test_a_config_without_the_mtp_count_takes_it_from_the_tensors(tmp_path, layers):
    """Some Qwen3.6 variants (and every Qwen3-Next config) omit mtp_num_hidden_layers while the head is
    there: the count comes from the tensors, the plan says so, the output config carries it, and
    verify warns about the source but accepts the converted folder."""
    from tests.checkpoints import build
    from mtpconvert.execute import execute
    from mtpconvert.verify import verify

    built = build(tmp_path / "src", mtp_layers=layers, tokenizer=False)
    _without_mtp_count(built.path)
    plan = plan_for(built)
    assert plan.mtp_layers == layers and len(plan.head_items) > 0
    assert plan.notes == [f"config.json has no mtp_num_hidden_layers: {layers} MTP layer(s) found in the "
                          "tensors, written into the output config"]
    assert plan.to_json()["notes"] == plan.notes
    assert plan.config["text_config"]["mtp_num_hidden_layers"] == layers
    assert plan_for(built, quant=dict(mtp="drop")).mtp_layers == 0

    source = verify(built.path)
    assert source.ok and source.mtp_layers_config is None and source.mtp_complete
    assert [f.code for f in source.findings] == ["mtp-count-missing"]
    execute(plan, open_checkpoint(built.path), tmp_path / "out")
    out = verify(tmp_path / "out")
    assert out.ok and out.mtp_layers_config == out.mtp_layers_found == layers and not out.findings


def test_a_config_without_the_mtp_count_and_no_head_keeps_none(tmp_path):
    from tests.checkpoints import build

    built = build(tmp_path / "src", mtp_layers=0, tokenizer=False)
    _without_mtp_count(built.path)
    plan = plan_for(built)
    assert plan.mtp_layers == 0 and plan.notes == [] and not plan.head_items
    assert plan.config["text_config"]["mtp_num_hidden_layers"] == 0


def _drop_key(folder, pattern):
    from safetensors.numpy import load_file, save_file

    for f in folder.glob("*.safetensors"):
        t = load_file(str(f))
        kept = {k: v for k, v in t.items() if not re.search(pattern, k)}
        if len(kept) != len(t):
            save_file(kept, str(f))
    idx = folder / "model.safetensors.index.json"
    if idx.exists():
        d = json.loads(idx.read_text())
        d["weight_map"] = {k: v for k, v in d["weight_map"].items() if not re.search(pattern, k)}
        idx.write_text(json.dumps(d))


def test_missing_expert_names_first_missing_key(tmp_path):
    from tests.checkpoints import build

    built = build(tmp_path / "m", moe=True, tokenizer=False)
    _drop_key(built.path, r"^mtp\.layers\.0\.mlp\.experts\.[12]\.up_proj")
    with pytest.raises(LayoutError, match="missing expert 1") as e:
        plan_for(built)
    assert e.value.key == "mtp.layers.0.mlp.experts.1.up_proj.weight"


def test_unexpected_and_bad_shape(tmp_path):
    from safetensors.numpy import load_file, save_file
    import numpy as np
    from tests.checkpoints import build

    built = build(tmp_path / "u", tokenizer=False)
    f = built.path / "model.safetensors"
    t = load_file(str(f))
    t["model.language_model.layers.0.mlp.extra.weight"] = np.zeros((2, 2), np.float32)
    save_file(t, str(f))
    with pytest.raises(LayoutError, match="unexpected tensor") as e:
        plan_for(built)
    assert e.value.key == "model.language_model.layers.0.mlp.extra.weight"
    del t["model.language_model.layers.0.mlp.extra.weight"]
    t["mtp.fc.weight"] = np.zeros((64, 64), np.float32)
    save_file(t, str(f))
    with pytest.raises(LayoutError, match=r"shape \[64, 64\].*expected \[64, 128\]"):
        plan_for(built)


def test_already_converted_folder_is_not_shifted_again(raw_checkpoints, tmp_path):
    from mtpconvert.execute import execute

    built = raw_checkpoints("dense-vlm")
    ckpt = open_checkpoint(built.path)
    execute(build_plan(ckpt, ConvertOptions(dtype="float32")), ckpt, tmp_path / "once")
    again = build_plan(open_checkpoint(tmp_path / "once"), ConvertOptions(dtype="float32"))
    assert not again.raw and again.style == "mlx"
    assert not any(ShiftNorm() in it.steps or ConvAxis() in it.steps for it in again.items)
    execute(again, open_checkpoint(tmp_path / "once"), tmp_path / "twice")
    from mtpconvert.io.reader import read_all
    import mlx.core as mx

    a = {}
    for f in sorted((tmp_path / "once").glob("model-*.safetensors")):
        a.update(read_all(f))
    b = {}
    for f in sorted((tmp_path / "twice").glob("model-*.safetensors")):
        b.update(read_all(f))
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]) for k in a)


def test_option_errors(raw_checkpoints):
    built = raw_checkpoints("dense-vlm")
    with pytest.raises(OptionsError):
        plan_for(built, quant=dict(bits=7))
    with pytest.raises(OptionsError):
        plan_for(built, quant=dict(bits=4, mode="mxfp4", group_size=64))
    with pytest.raises(OptionsError):
        plan_for(built, quant=dict(mtp="match"))
    with pytest.raises(OptionsError):
        plan_for(built, dtype="int8")
    assert plan_for(built, quant=dict(bits=4, mode="mxfp4")).config["quantization"]["group_size"] == 32


def test_unsupported_model_type(tmp_path):
    from mtpconvert.families import model_spec

    with pytest.raises(ConfigError, match="deepseek_v3"):
        model_spec({"model_type": "deepseek_v3"})
    with pytest.raises(ConfigError, match="unknown model_type"):
        model_spec({"model_type": "llama"})


@pytest.mark.parametrize("extra, fmt", [
    ({"weight_scale": ((8, 4), "float8_e4m3fn"), "weight_scale_2": ((), "float32"), "input_scale": ((), "float32")},
     "NVFP4 (NVIDIA ModelOpt)"),
    ({"weight_packed": ((64, 32), "uint8"), "weight_global_scale": ((1,), "float32")}, "FP4 (compressed-tensors)"),
])
def test_fp4_sources_are_refused_by_format(tmp_path, extra, fmt):
    """NVFP4/MXFP4 releases are not converted: the error names the format, the tensor and what to convert instead,
    from the plan (nothing read) and in verify. (ModelOpt's per-tensor FP8 with activation scales converts:
    tests/test_nemotron_h.py.)"""
    import torch
    from safetensors.torch import load_file, save_file

    from tests.checkpoints import build
    from mtpconvert.verify import verify

    built = build(tmp_path / "src", tokenizer=False)
    (path,) = built.path.glob("*.safetensors")
    tensors = load_file(str(path))
    module = next(k for k in sorted(tensors) if k.endswith("mlp.gate_proj.weight"))[: -len(".weight")]
    for name, (shape, dtype) in extra.items():
        tensors[f"{module}.{name}"] = torch.ones(shape, dtype=torch.float32).to(getattr(torch, dtype))
    save_file(tensors, str(path))
    with pytest.raises(LayoutError, match=re.escape(fmt)) as e:
        plan_for(built)
    assert e.value.key.startswith(module) and "BF16 release" in (e.value.hint or "")
    report = verify(built.path)
    assert not report.ok and any(f.code == "format-unsupported" and fmt in f.message for f in report.findings)


def test_a_per_tensor_scale_beside_a_float_weight_is_named(tmp_path):
    """Only an F8_E4M3 weight has a scale: a per-tensor ``weight_scale`` beside a BF16 weight is named (plan and
    verify) rather than read as a quantized format."""
    import torch
    from safetensors.torch import load_file, save_file

    from tests.checkpoints import build
    from mtpconvert.verify import verify

    built = build(tmp_path / "src", tokenizer=False)
    (path,) = built.path.glob("*.safetensors")
    tensors = load_file(str(path))
    module = next(k for k in sorted(tensors) if k.endswith("mlp.gate_proj.weight"))[: -len(".weight")]
    tensors[f"{module}.weight_scale"] = torch.ones((), dtype=torch.float32)
    save_file(tensors, str(path))
    with pytest.raises(LayoutError, match="a weight_scale beside a F32 weight") as e:
        plan_for(built)
    assert e.value.key == f"{module}.weight_scale"
    report = verify(built.path)
    assert not report.ok and any(f.code == "fp8-scale" and f.key == f"{module}.weight_scale" for f in report.findings)
