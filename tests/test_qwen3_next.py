"""Qwen3-Next: the published layout converts, stock mlx-lm matches transformers' own Qwen3NextForCausalLM,
the head is every raw ``mtp.*`` tensor shifted once with experts in order, and our runtime decodes with it."""

import json

import mlx.core as mx
import numpy as np
import pytest
import torch

from tools import layouts
from tests.checkpoints import build_next, convert_folder
from mtpconvert.errors import OptionsError
from mtpconvert.families import family_for
from mtpconvert.families.qwen3_next import FAMILY
from mtpconvert.io.reader import read_all
from mtpconvert.options import ConvertOptions
from mtpconvert.io.checkpoint import open_checkpoint
from mtpconvert.plan import build_plan

IDS = [5, 17, 300, 42, 8, 99, 123, 7, 256, 31, 64, 11]


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    """The release's layout and dtype (every tensor BF16, A_log too): two shards, the head in the last. The torch
    reference holds the weights as stored, so a float32 conversion compares tightly."""
    built = build_next(tmp_path_factory.mktemp("next") / "raw", dtype="bfloat16")
    with torch.no_grad():
        for p in built.model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    return built


@pytest.fixture(scope="module")
def converted(raw, tmp_path_factory):
    out = {}
    base = tmp_path_factory.mktemp("next-out")
    for name, quant in (("float", dict(dtype="float32")), ("bf16", dict(dtype="bfloat16")),
                        ("q4", dict(dtype="bfloat16", bits=4, group_size=32))):
        out[name] = base / name
        convert_folder(raw.path, out[name], **quant)
    return out


def torch_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float().numpy()


def mlx_logits(folder, ids):
    from mlx_lm.utils import load_model

    from mtpconvert.runtime.decoding.load import float32_experts_on_cpu

    model, _ = load_model(folder)
    float32_experts_on_cpu(model)  # the CPU's gather_mm is float32-only; stored bf16 values are unchanged
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def test_the_published_layout_is_what_the_builder_writes(raw):
    """The tiny source has the release's shape: flat keys, per-expert experts, fused in_proj_qkvz / in_proj_ba,
    every mtp.* tensor in the last shard, no MTP count in config.json."""
    published = {k for k, *_ in layouts.rows("Qwen3-Next-80B-A3B-Instruct")}
    config = json.loads((raw.path / "config.json").read_text())
    assert not {"mtp_num_hidden_layers", "num_nextn_predict_layers"} & set(config)
    index = json.loads((raw.path / "model.safetensors.index.json").read_text())["weight_map"]
    assert {index[k] for k in index if k.startswith("mtp.")} == {"model-00002-of-00002.safetensors"}
    # every tiny key names a published one once layer / expert numbers are normalised
    norm = lambda k: __import__("re").sub(r"\.(\d+)\.", ".N.", k)  # noqa: E731
    assert {norm(k) for k in index} == {norm(k) for k in published}


def test_family_is_listed_and_found():
    from mtpconvert.api import families

    assert "qwen3_next" in {f["family"] for f in families()}
    assert family_for({"model_type": "qwen3_next"}) is FAMILY


def test_published_table_plans_the_whole_head_from_the_tensors():
    from tests.test_layouts import table_checkpoint

    plan = build_plan(table_checkpoint("Qwen3-Next-80B-A3B-Instruct"))
    assert plan.raw and plan.mtp_layers == 1 and plan.style == "raw-text"
    assert any("no mtp_num_hidden_layers" in n for n in plan.notes)
    head = [it for it in plan.items if it.name.startswith("mtp.")]
    assert {it.shard for it in head} == {"mtp.safetensors"}
    # 1,553 raw mtp.* tensors: 512 experts x 3 stacked into 3, the rest one to one
    assert sum(len(it.sources) for it in head) == 1553
    stack = next(it for it in head if it.name == "mtp.layers.0.mlp.switch_mlp.gate_proj.weight")
    assert stack.slot.shape == (512, 512, 2048) and stack.gather == "stack"
    assert [s.key for s in stack.sources[:2]] == ["mtp.layers.0.mlp.experts.0.gate_proj.weight",
                                                  "mtp.layers.0.mlp.experts.1.gate_proj.weight"]
    assert plan.config["mtp_num_hidden_layers"] == 1 and "text_config" not in plan.config
    qkvz = next(it for it in plan.items if it.name == "model.layers.0.linear_attn.in_proj_qkvz.weight")
    assert qkvz.slot.shape == (12288, 2048)


def test_stock_mlx_lm_backbone_matches_transformers(raw, converted):
    np.testing.assert_allclose(mlx_logits(converted["float"], IDS), torch_logits(raw.model, IDS), atol=2e-4, rtol=0)


@pytest.fixture(scope="module")
def stock(raw, tmp_path_factory):
    """What mlx_lm.convert makes of the same source (it drops the head): the backbone reference for bf16 / 4-bit."""
    from mlx_lm import convert as mlx_lm_convert

    out = {}
    base = tmp_path_factory.mktemp("next-stock")
    for name, quant in (("bf16", dict(dtype="bfloat16")),
                        ("q4", dict(dtype="bfloat16", quantize=True, q_bits=4, q_group_size=32))):
        out[name] = base / name
        mlx_lm_convert(str(raw.path), mlx_path=str(out[name]), **quant)
    return out


@pytest.mark.parametrize("name", ["bf16", "q4"])
def test_bf16_and_4bit_backbones_are_what_mlx_lm_convert_makes(converted, stock, name):
    """Stored bf16 / 4-bit: the same logits as stock mlx_lm.convert's folder (whose 4-bit routers are 8-bit, as ours)."""
    np.testing.assert_array_equal(mlx_logits(converted[name], IDS), mlx_logits(stock[name], IDS))


def test_add_mtp_onto_a_stock_mlx_lm_folder(raw, stock, tmp_path):
    import shutil

    from typer.testing import CliRunner

    from mtpconvert.cli import app
    from mtpconvert.verify import verify

    folder = tmp_path / "q4"
    shutil.copytree(stock["q4"], folder)
    assert not verify(folder).mtp_complete
    result = CliRunner().invoke(app, ["add-mtp", str(raw.path), str(folder), "--no-smoke"])  # an untrained head
    assert result.exit_code == 0, result.output
    report = verify(folder)
    assert report.ok and report.mtp_complete, report
    from mtpconvert.runtime.decoding.load import load
    from mtpconvert.runtime.decoding.speculative import mtp_generate, plain_generate

    m = load(folder)
    assert mtp_generate(m, IDS, 16)[0] == plain_generate(m, IDS, 16)[0]


def test_the_head_is_every_raw_tensor_shifted_once_experts_in_order(raw, converted):
    out = read_all(converted["float"] / "mtp.safetensors")
    raw_head = {k: v for k, v in raw.raw.items() if k.startswith("mtp.")}
    used = set()
    for name, got in out.items():
        got = np.array(got)
        if ".switch_mlp." in name:
            mlp, proj = name.split(".switch_mlp.")
            keys = [f"{mlp}.experts.{e}.{proj}" for e in range(got.shape[0])]
            want = np.stack([raw_head[k] for k in keys])
        elif FAMILY.is_zero_centred_norm(name):
            keys, want = [name], raw_head[name] + 1.0  # in float32: the float32 output keeps every bit
        else:
            keys, want = [name], raw_head[name]
        used.update(keys)
        np.testing.assert_array_equal(got, want, err_msg=name)
    assert used == set(raw_head)


def test_in_model_layout_is_refused_naming_the_option(raw):
    with pytest.raises(OptionsError, match="--mtp-layout in-model"):
        build_plan(open_checkpoint(raw.path), ConvertOptions(mtp_layout="in-model"))


def test_a_transformers_saved_config_gets_the_rope_keys_mlx_lm_needs(tmp_path):
    built = build_next(tmp_path / "raw", rope="transformers", mtp_layers=1, dtype="float32")
    assert "rope_theta" not in json.loads((built.path / "config.json").read_text())
    convert_folder(built.path, tmp_path / "out", dtype="float32")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["rope_theta"] == 10000.0 and config["partial_rotary_factor"] == 0.25
    np.testing.assert_allclose(mlx_logits(tmp_path / "out", IDS), torch_logits(built.model, IDS), atol=2e-4, rtol=0)


@pytest.mark.parametrize("depth", [1, 2])
def test_greedy_mtp_output_is_plain_greedy(converted, depth):
    from mtpconvert.runtime.decoding.load import load
    from mtpconvert.runtime.decoding.speculative import mtp_generate, plain_generate

    m = load(converted["q4"])
    plain, _ = plain_generate(m, IDS, 32)
    spec, stats = mtp_generate(m, IDS, 32, depth=depth, check_offsets=True)
    assert spec == plain and stats.steps > 0


def test_rollback_restores_the_linear_attention_state(converted):
    """Qwen3-Next's fused GatedDeltaNet records its pass: undoing to each prefix gives the state a pass of
    only that prefix would have left."""
    from mtpconvert.runtime.decoding.load import load
    from mtpconvert.runtime.decoding.rollback import RollbackArraysCache, rollback

    m = load(converted["bf16"])
    m.backbone.enable_rollback()
    extra = [5, 17, 42]
    for keep in (1, 2, 3):
        cache = m.backbone.rollback_cache(max_pass=16)
        m.backbone.forward(mx.array([IDS]), cache)
        m.backbone.forward(mx.array([extra]), cache)
        rollback(cache, keep, len(extra))
        ref = m.backbone.rollback_cache(max_pass=16)
        m.backbone.forward(mx.array([IDS]), ref)
        m.backbone.forward(mx.array([extra[:keep]]), ref)
        linear = [(c, r) for c, r in zip(cache, ref) if isinstance(c, RollbackArraysCache)]
        assert linear
        for c, r in linear:
            for a, b in ((c[0], r[0]), (c[1], r[1])):
                np.testing.assert_allclose(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)),
                                           atol=1e-5)


def test_layerwise_predictions_equal_the_loaded_model(converted):
    from mtpconvert.runtime.smoke.layerwise import layerwise_acceptance
    from mtpconvert.runtime.smoke.teacher_forced import teacher_forced_full
    from mtpconvert.runtime.decoding.load import load

    ids = [IDS, IDS[::-1]]
    lw = layerwise_acceptance(converted["q4"], token_ids=ids, exact=True, vocab_block_bytes=4096)
    ref = teacher_forced_full(load(converted["q4"]), ids, "post-norm")
    assert lw.backbone_next == ref.backbone_next
    assert lw.head_next == ref.head_next


# ------------------------------------------------------------------ the runtime table (docs/interop.md)


def test_verify_table_says_which_runtime_drafts_with_the_head(converted):
    from mtpconvert.compat import check_folder

    report = check_folder(converted["q4"])
    assert report.layout == "sidecar"
    assert all(r.backbone_exact.ok for r in report.runtimes)
    usable = {r.runtime for r in report.runtimes if r.head_usable.ok}
    assert usable == {"mtplx"} == set(FAMILY.head_runtimes)
    assert "hidden states" in report.get("mlx-vlm").head_usable.reason
    config = json.loads((converted["q4"] / "config.json").read_text())
    # the head's RoPE as mtplx and mlx-vlm's drafter read it: the model's own base
    assert config["rope_parameters"] == {"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                         "mrope_section": [2, 0, 0]}


def test_an_mtp_key_in_the_shards_is_predicted_and_refused_by_stock_mlx_lm(converted, tmp_path):
    """The table's backbone rule against the real loader: a converted folder with the head copied into its shard."""
    import shutil

    from mlx_lm.utils import load_model

    from mtpconvert.compat import check_folder

    folder = tmp_path / "in-shard"
    shutil.copytree(converted["float"], folder)
    (shard,) = folder.glob("model-*.safetensors")
    merged = dict(mx.load(str(shard)), **mx.load(str(folder / "mtp.safetensors")))
    mx.save_safetensors(str(shard), merged, metadata={"format": "mlx"})
    report = check_folder(folder)
    assert report.get("mlx-lm>=0.32").backbone_exact.ok is False
    assert "strict load" in report.get("mlx-lm>=0.32").backbone_exact.reason
    with pytest.raises(ValueError, match="parameters not in model"):
        load_model(folder)


# ------------------------------------------------------------------ the trained fixture in our runtime


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from mtpconvert.fixture.text import text_fixture_path

    out = tmp_path_factory.mktemp("next-text") / "q4"
    convert_folder(text_fixture_path("next"), out, dtype="float32", bits=4, group_size=32)
    return out


def test_batched_rows_match_plain_batched_and_solo(trained):
    """Batched MTP over the trained Qwen3-Next head: rows joining and leaving, plain and drafting rows in one
    step, every row's tokens the plain engine's (and solo plain greedy's)."""
    from tests.test_batched import Alternate, assert_not_degenerate, mixed_streams

    from mtpconvert.fixture.text import heldout_prompts, text_fixture_path
    from mtpconvert.runtime.decoding.batched import run_batch
    from mtpconvert.runtime.decoding.load import load
    from mtpconvert.runtime.decoding.speculative import plain_generate

    m = load(trained)
    _, prompts, _ = heldout_prompts(text_fixture_path("next"), per_file=1, prompt_tokens=24, files=4)
    join_at = [0, 0, 1, 1]
    mtp = mixed_streams(prompts, 4)
    engine = run_batch(m, mtp, 2, "mtp", join_at=join_at, policy=Alternate())
    assert_not_degenerate(engine)
    plain = mixed_streams(prompts, 4)
    run_batch(m, plain, 2, "plain", join_at=join_at)
    for a, b in zip(mtp, plain):
        assert a.out == b.out
        assert a.out == plain_generate(m, a.prompt, len(a.out))[0]


def test_layerwise_smoke_accepts_the_trained_head(trained):
    from mtpconvert.gate import GateRecord, Gate, smoke_folder

    result = smoke_folder(trained, Gate(smoke_mode="layerwise"), GateRecord())
    assert result.ok and result.acceptance >= 0.3, result.to_json()
