"""GLM nextn heads (glm4_moe_lite, glm_moe_dsa, glm4_moe): the published layouts plan, tiny raw checkpoints made
with transformers' own classes convert, stock mlx-lm matches transformers' logits, every nextn tensor is kept
unshifted, verify accepts the folder, and our runtime's greedy MTP output equals plain greedy."""

import json
import re

import mlx.core as mx
import numpy as np
import pytest
import torch

from tools import layouts
from tests.checkpoints import GLM, build_glm, convert_folder
from mtpconvert.cli import run
from mtpconvert.families import family_for
from mtpconvert.plan import build_plan
from mtpconvert.verify import verify

TYPES = ("glm4_moe_lite", "glm_moe_dsa", "glm4_moe")
IDS = [5, 17, 300, 42, 8, 99, 123, 7, 256, 31, 64, 11]


def test_families_lists_the_glm_families(capsys):
    assert run(["families", "--json"]) == 0
    listed = {f["family"]: f for f in json.loads(capsys.readouterr().out)}
    for model_type in TYPES:
        head = listed[model_type]["head"]
        assert head["forward"] == "nextn" and head["norms_zero_centred"] is False
        assert head["concat"] == ["enorm(embed(t+1))", "hnorm(h_t)"] and head["hidden_state"] == "post_norm"
    # GLM-5 borrows the backbone's embedding and lm_head; GLM-4.x ships its own in the nextn layer
    assert listed["glm_moe_dsa"]["head"]["shares"] == ["embed_tokens", "lm_head"]
    assert listed["glm4_moe_lite"]["head"]["shares"] == []
    assert listed["glm_moe_dsa"]["head_runtimes"] == ["mlx-vlm-drafter"]


@pytest.mark.parametrize("name, experts", [("GLM-4.7-Flash", 64), ("GLM-4.5-Air", 128)])
def test_published_table_plans_every_tensor_and_the_whole_nextn_layer(name, experts):
    from tests.test_layouts import table_checkpoint

    ckpt = table_checkpoint(name)
    plan = build_plan(ckpt)
    n = ckpt.config["num_hidden_layers"]
    used = {s.key for it in plan.items for s in it.sources}
    assert used == set(ckpt.tensors) and not plan.dropped
    assert not plan.raw and plan.mtp_layers == 1 and plan.style == "raw-text"
    head = [it for it in plan.items if it.slot.group == "mtp"]
    assert {it.shard for it in head} == {"mtp.safetensors"}
    nextn = {k for k in ckpt.tensors if k.startswith(f"model.layers.{n}.")}
    assert {s.key for it in head for s in it.sources} == nextn  # the whole nextn layer, nothing else
    stack = next(it for it in head if it.name == "mtp.mlp.switch_mlp.gate_proj.weight")
    assert stack.slot.shape[0] == experts and stack.gather == "stack"
    assert stack.sources[1].key == f"model.layers.{n}.mlp.experts.1.gate_proj.weight"
    assert not any("shift" in step.label for it in plan.items for step in it.steps)  # plain RMSNorm gains
    bias = next(it for it in head if it.name == "mtp.mlp.gate.e_score_correction_bias")
    assert bias.dtype == "float32"
    assert plan.config["num_nextn_predict_layers"] == 1 and "mtp_num_hidden_layers" not in plan.config


def test_flash_table_splits_kv_b_into_mlx_lms_per_head_matrices():
    from tests.test_layouts import table_checkpoint

    plan = build_plan(table_checkpoint("GLM-4.7-Flash"))
    by_name = {it.name: it for it in plan.items}
    embed_q, unembed = by_name["model.layers.1.self_attn.embed_q.weight"], by_name["mtp.self_attn.unembed_out.weight"]
    assert embed_q.slot.shape == (20, 512, 192) and embed_q.sources[0].key == "model.layers.1.self_attn.kv_b_proj.weight"
    assert unembed.slot.shape == (20, 256, 512) and unembed.sources[0].key == "model.layers.47.self_attn.kv_b_proj.weight"


@pytest.fixture(scope="module", params=TYPES)
def raw(request, tmp_path_factory):
    """The release layout in bf16; the torch reference holds the weights as stored. GLM-5's indexer stays dense
    (index_topk above the test's length): past it, transformers' and mlx-lm's sparse selections differ upstream."""
    extra = {"index_topk": 64} if request.param == "glm_moe_dsa" else {}
    built = build_glm(tmp_path_factory.mktemp(request.param) / "raw", request.param, **extra)
    with torch.no_grad():
        for p in built.model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    built.model_type = request.param
    return built


@pytest.fixture(scope="module")
def converted(raw, tmp_path_factory):
    out = {}
    base = tmp_path_factory.mktemp(raw.model_type + "-out")
    for name, quant in (("float", dict(dtype="float32")), ("bf16", dict(dtype="bfloat16")),
                        ("q4", dict(dtype="bfloat16", bits=4, group_size=32))):
        out[name] = base / name
        convert_folder(raw.path, out[name], **quant)
    return out


def test_stock_mlx_lm_backbone_matches_transformers(raw, converted):
    from mlx_lm.utils import load_model

    from mtpconvert.runtime.decoding.load import float32_experts_on_cpu

    model, _ = load_model(converted["float"])  # strict: the folder holds exactly mlx-lm's parameters
    float32_experts_on_cpu(model)
    ours = np.array(model(mx.array([IDS]))[0].astype(mx.float32))
    with torch.no_grad():
        ref = raw.model(input_ids=torch.tensor([IDS])).logits[0].float().numpy()
    # GLM-4.7-Flash: transformers' q_a/kv_a norms use eps 1e-6, mlx-lm's 1e-5 (~5e-5 here)
    np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=0)


@pytest.mark.parametrize("name", ["bf16", "q4"])
def test_backbone_is_what_mlx_lm_convert_makes(raw, converted, name, tmp_path):
    """The same tensors, byte for byte, as stock mlx_lm.convert's folder of the same source (which drops the head)."""
    from mlx_lm import convert as mlx_lm_convert

    quant = dict(quantize=True, q_bits=4, q_group_size=32) if name == "q4" else {}
    mlx_lm_convert(str(raw.path), mlx_path=str(tmp_path / "stock"), dtype="bfloat16", **quant)
    load = lambda folder: {k: v for f in sorted(folder.glob("model*.safetensors"))  # noqa: E731
                           for k, v in mx.load(str(f)).items()}
    ours, stock = load(converted[name]), load(tmp_path / "stock")
    assert set(ours) == set(stock)
    for k in stock:
        assert ours[k].dtype == stock[k].dtype and mx.array_equal(ours[k], stock[k]).item(), k


def test_every_nextn_tensor_is_kept_unshifted(raw, converted):
    """Each raw model.layers.N.* tensor is in the head as stored: experts stacked in order, kv_b_proj split per
    head as mlx-lm splits it, norms not shifted, the router bias float32; nothing else is in the head."""
    n = json.loads((raw.path / "config.json").read_text())["num_hidden_layers"]
    head = mx.load(str(converted["float"] / "mtp.safetensors"))
    nextn = {k[len(f"model.layers.{n}."):]: v for k, v in raw.raw.items() if k.startswith(f"model.layers.{n}.")}
    seen = set()
    for rest, w in nextn.items():
        if m := re.match(r"mlp\.experts\.(\d+)\.(\w+)\.weight", rest):
            got = np.array(head[f"mtp.mlp.switch_mlp.{m[2]}.weight"][int(m[1])])
            seen.add(f"mtp.mlp.switch_mlp.{m[2]}.weight")
        elif rest == "self_attn.kv_b_proj.weight":
            cfg = json.loads((raw.path / "config.json").read_text())
            per_head = w.reshape(cfg["num_attention_heads"], -1, w.shape[-1])
            nope = cfg["qk_nope_head_dim"]
            np.testing.assert_array_equal(np.array(head["mtp.self_attn.embed_q.weight"]),
                                          per_head[:, :nope].swapaxes(-1, -2))
            got, w = np.array(head["mtp.self_attn.unembed_out.weight"]), per_head[:, nope:]
            seen.update({"mtp.self_attn.embed_q.weight", "mtp.self_attn.unembed_out.weight"})
        else:
            name = "mtp." + {"shared_head.norm.weight": "shared_head_norm.weight"}.get(rest, rest)
            got = np.array(head[name])
            seen.add(name)
            if name.endswith("e_score_correction_bias"):
                assert head[name].dtype == mx.float32
        np.testing.assert_array_equal(got, w, err_msg=rest)
    assert seen == set(head)


def test_verify_accepts_the_folders_and_says_which_runtime_drafts(raw, converted):
    for name, folder in converted.items():
        report = verify(folder)
        assert report.ok, (name, [f.message for f in report.findings if f.severity == "error"])
        assert report.mtp_layers_found == 1
        drafter = next(r for r in report.runtimes if r.runtime == "mlx-vlm-drafter")
        assert drafter.head_usable.ok is (raw.model_type == "glm_moe_dsa"), drafter.head_usable.reason
        stock = next(r for r in report.runtimes if r.runtime == "mlx-lm>=0.32")
        assert stock.backbone_exact.ok


def test_the_drafter_folder_is_the_model_types_mlx_vlm_drafter(raw, converted):
    config = json.loads((converted["q4"] / "config.json").read_text())
    drafter = json.loads((converted["q4"] / "mtp" / "config.json").read_text())
    assert drafter["model_type"] == raw.model_type + "_mtp" and drafter["block_size"] == 2
    assert drafter["text_config"]["model_type"] == raw.model_type and "quantization" not in drafter["text_config"]
    assert drafter["quantization"] == config["quantization"]
    assert family_for(config).drafter_config(config) == drafter


@pytest.mark.parametrize("depth", [1, 2])
def test_our_runtime_greedy_mtp_equals_plain(converted, depth):
    from mtpconvert.runtime.decoding.load import load
    from mtpconvert.runtime.decoding.speculative import mtp_generate, plain_generate

    m = load(converted["float"])
    plain, _ = plain_generate(m, IDS[:8], 20)
    tokens, stats = mtp_generate(m, IDS[:8], 20, depth=depth, check_offsets=True)
    assert tokens == plain and stats.proposed[0] > 0


def test_a_wrong_nextn_layer_count_and_a_layer_past_it_are_refused(raw, tmp_path):
    from mtpconvert.errors import ConfigError, LayoutError
    from mtpconvert.io.checkpoint import open_checkpoint

    ckpt = open_checkpoint(raw.path)
    config = dict(ckpt.config, num_nextn_predict_layers=2)
    with pytest.raises(ConfigError, match="num_nextn_predict_layers=2"):
        family_for(config).spec(config)
    family = family_for(ckpt.config)
    n = ckpt.config["num_hidden_layers"]
    with pytest.raises(LayoutError, match="past the nextn layer"):
        family.contributions(f"model.layers.{n + 1}.enorm.weight")
    assert [m.target for m in family.contributions(f"model.layers.{n}.shared_head.norm.weight")] == \
        ["mtp.shared_head_norm.weight"]


def test_transformers_classes_exist_for_every_glm_type():
    import transformers

    for prefix, _, _ in GLM.values():
        assert hasattr(transformers, prefix + "ForCausalLM")
    assert {k for k, *_ in layouts.rows("GLM-4.7-Flash")} >= {"model.layers.47.shared_head.head.weight"}


@pytest.mark.parametrize("name", ["float", "q4"])
def test_layerwise_check_predicts_what_the_loaded_model_predicts(converted, name):
    """The streamed layerwise check (one layer at a time; a GLM-4.x head's own embedding and shared_head.head read
    in row blocks) gives the same tokens as the whole model loaded."""
    from mtpconvert.runtime.smoke.layerwise import layerwise_acceptance
    from mtpconvert.runtime.smoke.teacher_forced import teacher_forced_full
    from mtpconvert.runtime.decoding.load import load

    ids = [IDS, IDS[3:10]]
    layerwise = layerwise_acceptance(converted[name], token_ids=ids, exact=True)
    full = teacher_forced_full(load(converted[name]), ids)
    assert layerwise.backbone_next == full.backbone_next
    assert layerwise.head_next == full.head_next and layerwise.head_next_without_mlp == full.head_next_without_mlp


def test_batched_rows_equal_solo_greedy(converted, monkeypatch):
    """Batched MTP through the family's adapter (per-row twins of mlx-lm's caches: KVCache, GLM-5's CacheList):
    rows joining and leaving, plain and drafting rows in one step; every greedy row's tokens equal the plain
    batched engine's and its solo plain greedy decode. The heads' random weights draft nothing right, so each
    row's draft is replaced, at 70% of its positions, by the token its solo decode emits there (the head still
    runs, so its cache is what it always is): rows then keep different numbers of drafts in one step."""
    from mtpconvert.runtime.decoding.load import load
    from tests.test_batched import assert_batched_rows_equal_solo

    assert_batched_rows_equal_solo(load(converted["float"]), [IDS[: 5 + i] for i in range(6)], monkeypatch)


def test_the_card_says_which_drafter_route_mlx_vlm_takes(raw, converted):
    """mlx-vlm's splitter looks for a GLM head at model.layers.{num_hidden_layers}.* and finds none at the root of
    a folder that keeps it in mtp/: the card sends GLM-5 users to OUT/mtp, and offers GLM-4.x none (its runtime
    table gives no mlx-vlm drafter); the backbone is stock mlx-lm's."""
    from mtpconvert.hub.card import model_card

    card = model_card(converted["q4"], "me/tiny-4bit").split("## Use")[1]
    assert "Stock mlx-lm loads it" in card
    if raw.model_type == "glm_moe_dsa":
        assert "drafts with its MTP head (`--draft-model tiny-4bit/mtp`" in card
        assert "--draft-model tiny-4bit/mtp --draft-kind mtp" in card and "--draft-model tiny-4bit " not in card
    else:
        assert "--draft-model" not in card
