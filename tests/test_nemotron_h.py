"""Nemotron-H with its MTP head (Nemotron-3 Super / Ultra): tiny raw releases made with transformers' own classes
(Super's pattern ``"*E"``, and Ultra's legacy block lists with another head pattern) convert at float32, bf16 and
4-bit; stock mlx-lm loads the backbone and matches transformers' logits; every head tensor is kept unshifted with the
experts in order; our head's forward equals one built from transformers' modules; mlx-vlm's splitter loads
``OUT/mtp`` strictly into its drafter and MTP-decodes to plain greedy's output; our runtime's greedy MTP equals plain
greedy and the Mamba2 rollback is exact; ``bench --concurrency`` runs batched MTP on it; ModelOpt FP8 converts
exactly and NVFP4 is refused by name."""

import json
import re
import shutil

import mlx.core as mx
import numpy as np
import pytest
import torch

from tests.checkpoints import convert_folder
from tests.nemotron import build_nemotron, modelopt_twin
from mtpconvert.errors import LayoutError, OptionsError
from mtpconvert.families import family_for
from mtpconvert.io.checkpoint import open_checkpoint
from mtpconvert.options import ConvertOptions
from mtpconvert.plan import build_plan
from mtpconvert.verify import verify

IDS = [5, 17, 300, 42, 8, 99, 123, 7, 256, 31, 64, 11]
# (backbone pattern, head pattern, config spelling): Super's, and Ultra's spelling with a head whose first block is
# MoE and whose two attention blocks share the head's cache entry
VARIANTS = {"super": ("M*ME-E", "*E", "release"), "other": ("ME*M*E", "E**", "ultra")}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def raw(request, tmp_path_factory):
    pattern, mtp_pattern, style = VARIANTS[request.param]
    built = build_nemotron(tmp_path_factory.mktemp(request.param) / "raw", pattern=pattern, mtp_pattern=mtp_pattern,
                           config_style=style)
    built.name = request.param
    return built


@pytest.fixture(scope="module")
def converted(raw, tmp_path_factory):
    out = {}
    base = tmp_path_factory.mktemp(raw.name + "-out")
    for name, quant in (("float", dict(dtype="float32")), ("bf16", dict(dtype="bfloat16")),
                        ("q4", dict(dtype="bfloat16", bits=4, group_size=32)),
                        ("q4-match", dict(dtype="float32", bits=4, group_size=32, mtp="match"))):
        out[name] = base / name
        convert_folder(raw.path, out[name], **quant)
    return out


def mlx_logits(folder, ids=IDS):
    from mlx_lm.utils import load_model

    from mtpconvert.runtime.decoding.load import float32_experts_on_cpu

    model, _ = load_model(folder)  # strict: the folder holds exactly mlx-lm's parameters
    float32_experts_on_cpu(model)  # the CPU's gather_mm is float32-only; stored values are unchanged
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def test_families_lists_nemotron_h(capsys):
    from mtpconvert.cli import run

    assert run(["families", "--json"]) == 0
    listed = {f["family"]: f for f in json.loads(capsys.readouterr().out)}["nemotron_h"]
    assert listed["head"]["forward"] == "nemotron-h-mtp" and listed["head"]["norms_zero_centred"] is False
    assert listed["head"]["concat"] == ["enorm(embed(t+1))", "hnorm(h_t)"]
    assert listed["head"]["shares"] == ["embeddings", "lm_head"] and listed["mtp_count_key"] == "num_nextn_predict_layers"
    assert listed["backbone_modules"] == ["mlx_lm.models.nemotron_h"]
    assert listed["head_runtimes"] == ["mlx-vlm", "mlx-vlm-drafter"]


def test_the_super_table_plans_every_tensor_and_the_whole_prediction_module():
    """Nemotron-3 Super's reconstructed table (tests/data/layouts/SOURCE.md: it meets the published totals): every
    tensor is used, the 1,040 mtp.* ones go to the 18 head slots of one MTP layer, experts stacked in order."""
    from tests.test_layouts import table_checkpoint

    ckpt = table_checkpoint("NVIDIA-Nemotron-3-Super-120B-A12B-BF16")
    plan = build_plan(ckpt)
    assert {s.key for it in plan.items for s in it.sources} == set(ckpt.tensors) and not plan.dropped
    assert plan.mtp_layers == 1 and plan.style == "raw-text" and not plan.raw
    head = [it for it in plan.items if it.slot.group == "mtp"]
    assert len(head) == 18 and sum(len(it.sources) for it in head) == 1040
    assert {it.shard for it in head} == {"mtp.safetensors"}
    fc1 = next(it for it in head if it.name == "mtp.layers.1.mixer.switch_mlp.fc1.weight")
    assert fc1.slot.shape == (512, 2688, 1024) and [s.key for s in fc1.sources[:2]] == [
        "mtp.layers.1.mixer.experts.0.up_proj.weight", "mtp.layers.1.mixer.experts.1.up_proj.weight"]
    conv = next(it for it in plan.items if it.name == "backbone.layers.0.mixer.conv1d.weight")
    assert conv.slot.shape == (10240, 4, 1) and [s.label for s in conv.steps][0] == "conv_axis"
    assert plan.config["num_nextn_predict_layers"] == 1 and plan.config["mtp_hybrid_override_pattern"] == "*E"


def test_the_plan_keeps_every_head_tensor_and_moves_only_the_conv(raw):
    plan = build_plan(open_checkpoint(raw.path))
    used = {s.key for it in plan.items for s in it.sources}
    assert used == set(raw.raw) and not plan.dropped and plan.mtp_layers == 1 and not plan.raw
    head = [it for it in plan.items if it.slot.group == "mtp"]
    assert {it.shard for it in head} == {"mtp.safetensors"}
    assert {s.key for it in head for s in it.sources} == {k for k in raw.raw if k.startswith("mtp.")}
    steps = {it.name: [s.label for s in it.steps] for it in plan.items}
    assert all(labels[0] == "conv_axis" for n, labels in steps.items() if n.endswith("conv1d.weight"))
    assert not any("shift" in label for labels in steps.values() for label in labels)  # plain RMSNorm gains
    pattern, mtp_pattern, _ = VARIANTS[raw.name]
    assert plan.config["hybrid_override_pattern"] == pattern and plan.config["mtp_hybrid_override_pattern"] == mtp_pattern
    assert "layers_block_type" not in plan.config and plan.config["num_nextn_predict_layers"] == 1


def test_stock_mlx_lm_backbone_matches_transformers(raw, converted):
    with torch.no_grad():
        ref = raw.model(input_ids=torch.tensor([IDS])).logits[0].float().numpy()
    np.testing.assert_allclose(mlx_logits(converted["float"]), ref, atol=2e-4, rtol=0)


@pytest.mark.parametrize("name", ["bf16", "q4"])
def test_backbone_is_what_mlx_lm_convert_makes(raw, converted, name, tmp_path):
    """The same tensors, byte for byte, as stock mlx_lm.convert's folder of the same source (which drops the head),
    but A_log: float32 here (the value stored, computed in float32 as transformers does), the source's bf16 there."""
    from mlx_lm import convert as mlx_lm_convert

    quant = dict(quantize=True, q_bits=4, q_group_size=32) if name == "q4" else {}
    mlx_lm_convert(str(raw.path), mlx_path=str(tmp_path / "stock"), dtype="bfloat16", **quant)
    load = lambda folder: {k: v for f in sorted(folder.glob("model*.safetensors"))  # noqa: E731
                           for k, v in mx.load(str(f)).items()}
    ours, stock = load(converted[name]), load(tmp_path / "stock")
    assert set(ours) == set(stock)
    for k in stock:
        if k.endswith("A_log"):
            assert ours[k].dtype == mx.float32 and mx.array_equal(ours[k], stock[k].astype(mx.float32)).item()
        else:
            assert ours[k].dtype == stock[k].dtype and mx.array_equal(ours[k], stock[k]).item(), k


def test_every_head_tensor_is_kept_unshifted_experts_in_order(raw, converted):
    head = mx.load(str(converted["float"] / "mtp.safetensors"))
    seen = set()
    for key, w in ((k, v) for k, v in raw.raw.items() if k.startswith("mtp.")):
        if m := re.match(r"^(.+\.mixer)\.experts\.(\d+)\.(up|down)_proj\.weight$", key):
            name = f"{m[1]}.switch_mlp.{'fc1' if m[3] == 'up' else 'fc2'}.weight"
            got = np.array(head[name][int(m[2])])
        else:
            name, got = key, np.array(head[key])
            assert head[key].dtype == mx.float32
        seen.add(name)
        np.testing.assert_array_equal(got, w, err_msg=key)
    assert seen == set(head)


def transformers_head(raw, hidden: np.ndarray, tokens) -> np.ndarray:
    """The head's logits from transformers' own modules: a NemotronHModel over the head's pattern (its layers the
    mtp.layers.{j}, its norm_f the last block's final_layernorm) fed eh_proj(cat[enorm(embed), hnorm(h)])."""
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHModel

    cfg = raw.model.config
    blocks = NemotronHConfig(**{**cfg.to_dict(), "layers_block_type": list(cfg.mtp_layers_block_type)})
    module = NemotronHModel(blocks).float().eval()
    head = {k[len("mtp."):]: torch.from_numpy(v) for k, v in raw.raw.items() if k.startswith("mtp.")}
    last = len(cfg.mtp_layers_block_type) - 1
    state = {"embeddings.weight": raw.model.model.embeddings.weight.detach(),
             "norm_f.weight": head.pop(f"layers.{last}.final_layernorm.weight")}
    first = {n: head.pop(f"layers.0.{n}.weight") for n in ("enorm", "hnorm", "eh_proj")}
    experts = {}
    for k, v in head.items():
        if m := re.match(r"^(layers\.\d+\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$", k):
            experts.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = v
        else:
            state[k] = v
    state.update({k: torch.stack([d[e] for e in sorted(d)]) for k, d in experts.items()})
    module.load_state_dict(state, strict=True)

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.layer_norm_epsilon)

    with torch.no_grad():
        e = raw.model.model.embeddings(torch.tensor([tokens]))
        x = torch.cat([rms(e, first["enorm"]), rms(torch.from_numpy(hidden), first["hnorm"])], -1) @ first["eh_proj"].T
        return raw.model.lm_head(module(inputs_embeds=x, use_cache=False).last_hidden_state)[0].numpy()


def test_our_head_forward_is_transformers_modules(raw, converted):
    """Our head over the backbone's post-norm states equals the same head built from transformers' own modules."""
    from mtpconvert.runtime.decoding.load import load

    m = load(converted["float"])
    hidden = m.backbone.forward(mx.array([IDS]), m.backbone.make_cache())[1][:, :-1]
    ours = np.array(m.draft_logits(m.head(hidden, m.embed(mx.array([IDS[1:]])), m.head.make_cache()))[0])
    ref = transformers_head(raw, np.array(hidden), IDS[1:])
    np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=0)


@pytest.mark.parametrize("name, depth", [("float", 1), ("float", 2), ("q4", 2)])
def test_our_runtime_greedy_mtp_equals_plain(converted, name, depth):
    from mtpconvert.runtime.decoding.load import load
    from mtpconvert.runtime.decoding.speculative import mtp_generate, plain_generate

    m = load(converted[name])
    plain, _ = plain_generate(m, IDS[:8], 20)
    tokens, stats = mtp_generate(m, IDS[:8], 20, depth=depth, check_offsets=True)
    assert tokens == plain and stats.proposed[0] > 0


def test_mamba_rollback_is_exact(converted):
    """The recording Mamba2 mixer undoes a pass to each prefix: the conv window and SSM state a stock pass over only
    that prefix leaves (conv window bit for bit; the scan's state to float32 rounding)."""
    from mtpconvert.families.nemotron_h.backbone import MambaRollbackCache
    from mtpconvert.runtime.decoding.load import load
    from mtpconvert.runtime.decoding.rollback import rollback

    m = load(converted["float"])
    m.backbone.enable_rollback()
    extra = [5, 17, 42, 300]
    for keep in (1, 2, 3):
        cache = m.backbone.rollback_cache(max_pass=16)
        m.backbone.forward(mx.array([IDS]), cache)
        m.backbone.forward(mx.array([extra]), cache)
        rollback(cache, keep, len(extra))
        ref = m.backbone.make_cache()  # the library's own caches and its stock forward
        m.backbone(mx.array([IDS]), cache=ref)
        m.backbone(mx.array([extra[:keep]]), cache=ref)
        mamba = [(c, r) for c, r in zip(cache, ref) if isinstance(c, MambaRollbackCache)]
        assert len(mamba) == 2
        for c, r in mamba:
            assert mx.array_equal(c[0], r[0]).item()
            np.testing.assert_allclose(np.array(c[1]), np.array(r[1]), atol=1e-6, rtol=0)
        attention = [(c, r) for c, r in zip(cache, ref) if not isinstance(c, MambaRollbackCache)]
        assert all(c.offset == r.offset == len(IDS) + keep for c, r in attention)


def test_verify_accepts_the_folders_and_names_the_drafting_runtimes(converted):
    for name, folder in converted.items():
        report = verify(folder)
        assert report.ok, (name, [f.message for f in report.findings if f.severity == "error"])
        assert report.mtp_layers_found == 1
        rows = {r.runtime: r for r in report.runtimes}
        assert rows["mlx-lm>=0.32"].backbone_exact.ok and rows["mlx-vlm"].backbone_exact.ok
        assert {r for r, row in rows.items() if row.head_usable.ok} == {"mlx-vlm", "mlx-vlm-drafter"}, name
        # transformers 5 saves time_step_limit's infinity as {"__float__": "Infinity"}: mlx-lm 0.31.3 passes that dict
        # to mx.clip (measured: ValueError: Invalid type dict), 0.32 decodes it
        assert not rows["mlx-lm<0.32"].backbone_exact.ok and "time_step_limit" in rows["mlx-lm<0.32"].backbone_exact.reason


def test_the_drafter_folder_is_the_models_config_beside_the_head(converted):
    config = json.loads((converted["q4-match"] / "config.json").read_text())
    assert json.loads((converted["q4-match"] / "mtp" / "config.json").read_text()) == config
    assert family_for(config).drafter_config(config) == config


@pytest.mark.parametrize("name", ["float", "q4-match"])
def test_mlx_vlm_drafts_from_out_mtp_with_plain_greedys_output(raw, converted, name):
    """mlx-vlm 0.7.10's splitter loads OUT/mtp strictly into its nemotron_h_mtp drafter (a float head, and one
    quantized at the backbone's bits); its draft logits are our head's, and its MTP decode is plain greedy's."""
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.speculative.drafters import load_drafter
    from mlx_vlm.utils import load_model

    from mtpconvert.runtime.decoding.load import load

    folder = converted[name]
    target = load_model(folder)
    drafter, kind = load_drafter(str(folder / "mtp"), kind="mtp")
    assert type(drafter).__name__ == "NemotronHMTPDraftModel" and kind == "mtp"
    ours = load(folder)
    hidden = ours.backbone.forward(mx.array([IDS]), ours.backbone.make_cache())[1][:, :-1]
    mine = ours.draft_logits(ours.head(hidden, ours.embed(mx.array([IDS[1:]])), ours.head.make_cache()))
    drafter.bind(target)
    state, _ = drafter._forward_hidden(target.language_model.backbone.embeddings(mx.array([IDS[1:]])), hidden, None,
                                       drafter.make_cache())
    np.testing.assert_allclose(np.array(drafter._lm_head_fn(state)), np.array(mine), atol=1e-4, rtol=0)
    prompt = mx.array([IDS[:8]])
    plain = [int(t) for t, _ in generate_step(prompt, target, None, None, max_tokens=16, temperature=0.0)]
    spec = [int(t) for t, _ in generate_step(prompt, target, None, None, max_tokens=16, temperature=0.0,
                                             draft_model=drafter, draft_kind=kind, draft_block_size=3)]
    assert spec == plain and sum(drafter.draft_lens) > 0


@pytest.mark.parametrize("name", ["float", "q4"])
def test_layerwise_check_predicts_what_the_loaded_model_predicts(converted, name):
    from mtpconvert.runtime.decoding.load import load
    from mtpconvert.runtime.smoke.layerwise import layerwise_acceptance
    from mtpconvert.runtime.smoke.teacher_forced import teacher_forced_full

    ids = [IDS, IDS[3:10]]
    layerwise = layerwise_acceptance(converted[name], token_ids=ids, exact=True)
    full = teacher_forced_full(load(converted[name]), ids)
    assert layerwise.backbone_next == full.backbone_next
    assert layerwise.head_next == full.head_next and layerwise.head_next_without_mlp == full.head_next_without_mlp
    assert full.head_next != full.head_next_without_mlp  # the MoE blocks were taken out


def test_bench_concurrency_runs_it_and_batched_mtp_is_the_plain_engines_greedy(converted):
    """Batched MTP through the family's row caches (both head patterns: one attention block, and two sharing a
    CacheList); the trained fixture's rows are checked token for token in tests/test_nemotron_h_batched.py."""
    from mtpconvert.api import bench
    from mtpconvert.options import BenchOptions

    report = bench(converted["float"], BenchOptions(concurrency=(1, 2), max_tokens=5)).to_json()
    assert [r["concurrency"] for r in report["rows"]] == [1, 2]
    for row in report["rows"]:
        assert row["decoders"]["mtp"]["generated"] == 4 * row["concurrency"]
        identical = row["greedy_identical_to_plain_engine"]
        # not BatchGenerator's: it right-pads shorter prompts, and mlx-lm 0.32.2's Mamba2 scan there gets the padding
        # mask without the row lengths (nemotron_h.py `_ssm`), so a shorter row's state loses its prompt
        assert identical["mtp"] and identical["auto"], identical


def test_in_model_layout_is_refused_naming_the_option(raw):
    with pytest.raises(OptionsError, match="--mtp-layout in-model"):
        build_plan(open_checkpoint(raw.path), ConvertOptions(mtp_layout="in-model"))


# ------------------------------------------------------------------ config spellings and bad input


def test_a_transformers_saved_config_converts_to_pattern_strings(tmp_path):
    """transformers 5 saves the blocks as linear_attention / full_attention lists (mlx-vlm cannot read those names):
    the output states them as Super's pattern strings."""
    built = build_nemotron(tmp_path / "raw", config_style="transformers", shards=1)
    config = json.loads((built.path / "config.json").read_text())
    assert "linear_attention" in config["layers_block_type"] and "hybrid_override_pattern" not in config
    convert_folder(built.path, tmp_path / "out", dtype="float32")
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (out["hybrid_override_pattern"], out["mtp_hybrid_override_pattern"]) == ("M*ME-E", "*E")
    with torch.no_grad():
        ref = built.model(input_ids=torch.tensor([IDS])).logits[0].numpy()
    np.testing.assert_allclose(mlx_logits(tmp_path / "out"), ref, atol=2e-4, rtol=0)


@pytest.mark.parametrize("edit, match", [
    (dict(num_nextn_predict_layers=2), "num_nextn_predict_layers=2"),
    (dict(hybrid_override_pattern="M*MX-E"), "hybrid_override_pattern must be a string"),
    (dict(num_hidden_layers=5), "num_hidden_layers=5 but the block pattern has 6"),
    (dict(tie_word_embeddings=True), "always builds its own lm_head"),
])
def test_bad_configs_are_named(raw, edit, match):
    from mtpconvert.errors import ConfigError

    config = dict(open_checkpoint(raw.path).config, **edit)
    with pytest.raises(ConfigError, match=match):
        family_for(config).spec(config)


def test_a_head_block_out_of_place_is_refused(raw, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(raw.path, src)
    shard = src / "model-00002-of-00002.safetensors"
    tensors = load_file(str(shard))
    tensors["mtp.layers.5.norm.weight"] = tensors["mtp.layers.0.norm.weight"].clone()
    save_file(tensors, str(shard))
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["mtp.layers.5.norm.weight"] = shard.name
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(LayoutError, match="unexpected tensor") as e:
        build_plan(open_checkpoint(src))
    assert e.value.key == "mtp.layers.5.norm.weight"


# ------------------------------------------------------------------ NVIDIA ModelOpt releases


def test_modelopt_fp8_converts_exactly_and_drops_its_activation_and_kv_scales(raw, tmp_path):
    """Per-tensor FP8 (backbone and head): every weight is e4m3(q) * weight_scale, stacked in expert order; the
    input_scale / k_scale / v_scale scalars are dropped with their reason; stock mlx-lm loads the output."""
    exact = modelopt_twin(raw.path, tmp_path / "fp8", head=True)
    plan = convert_folder(tmp_path / "fp8", tmp_path / "out", dtype="float32")
    reasons = dict(plan.dropped)
    assert {k for k in reasons} == {k for k in open_checkpoint(tmp_path / "fp8").tensors
                                    if k.endswith((".input_scale", ".k_scale", ".v_scale"))}
    assert any("KV-cache" in r for r in reasons.values()) and any("activation" in r for r in reasons.values())
    out = {k: v for f in [*(tmp_path / "out").glob("model*.safetensors"), tmp_path / "out" / "mtp.safetensors"]
           for k, v in mx.load(str(f)).items()}
    for key, value in exact.items():
        if m := re.match(r"^(.+\.mixer)\.experts\.(\d+)\.(up|down)_proj\.weight$", key):
            got = out[f"{m[1]}.switch_mlp.{'fc1' if m[3] == 'up' else 'fc2'}.weight"][int(m[2])]
        else:
            got = out[key]
        np.testing.assert_array_equal(np.array(got), value, err_msg=key)
    assert verify(tmp_path / "fp8").ok and verify(tmp_path / "out").ok
    assert not (tmp_path / "out" / "hf_quant_config.json").exists()  # mlx-lm would read it as the model's quantization
    mlx_logits(tmp_path / "out")


def test_modelopt_nvfp4_is_refused_by_name(raw, tmp_path):
    modelopt_twin(raw.path, tmp_path / "nvfp4", algo="NVFP4")
    with pytest.raises(LayoutError, match=re.escape("NVFP4 (NVIDIA ModelOpt)")) as e:
        build_plan(open_checkpoint(tmp_path / "nvfp4"))
    assert e.value.key.endswith(".weight_scale_2") and "BF16 release" in e.value.hint
    report = verify(tmp_path / "nvfp4")
    assert [f.code for f in report.findings if f.severity == "error"] == ["format-unsupported"]
