"""Qwen3.8-Flash-Next (``qwen4_exp``): tiny releases made with transformers' own classes (``tests.checkpoints_qwen4_exp``)
converted, then checked against the consumers: mlx-vlm 0.7.10 loads the backbone and matches transformers'
float32 logits, its own splitter makes of the raw source exactly the head the folder holds, its drafter loads
``OUT/mtp`` strictly and MTP-decodes equal to plain greedy, and the FP8 release converts to what its exact
dequantization converts to."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch

from mtpconvert import api
from mtpconvert.gate import Gate
from mtpconvert.options import ConvertOptions, QuantOptions
from tests.checkpoints_qwen4_exp import build, reference_logits


IDS = [5, 17, 1, 42, 99, 7, 3, 200, 11, 64, 13, 8, 77, 21]
NO_CHECKS = Gate(verify=True, smoke=False)
OPTIONS = {
    "float32": ConvertOptions(dtype="float32"),
    "q4": ConvertOptions(dtype="float32", quant=QuantOptions(bits=4, group_size=32)),
    "q4-match": ConvertOptions(dtype="float32", quant=QuantOptions(bits=4, group_size=32, mtp="match")),
}


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen4_exp")
    # the fused release is the per-expert one's model (same seed) with its experts fused
    return {"per-expert": build(root / "per-expert"), "fused": build(root / "fused", experts="fused"),
            "fp8": build(root / "fp8", seed=2, fp8=True)}


@pytest.fixture(scope="module")
def converted(releases, tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen4_exp_out")
    out = {}
    for name, built in releases.items():
        for option, opts in OPTIONS.items():
            if name == "fused" and option != "float32":
                continue
            out[name, option] = api.convert(built.path, root / f"{name}-{option}", opts, checks=NO_CHECKS).out
    for option in ("float32", "q4"):
        out["fp8-dequantized", option] = api.convert(releases["fp8"].reference, root / f"deq-{option}",
                                                     OPTIONS[option], checks=NO_CHECKS).out
    return out


def vlm_model(path: Path):
    from mlx_vlm.utils import load_model

    return load_model(Path(path))


def vlm_logits(model, ids) -> np.ndarray:
    out = model.language_model(mx.array([ids]))
    return np.array(getattr(out, "logits", out))


def test_mlx_vlm_loads_the_backbone_and_matches_transformers(releases, converted):
    reference, _, _ = reference_logits(releases["per-expert"], torch.tensor([IDS]))
    logits = vlm_logits(vlm_model(converted["per-expert", "float32"]), IDS)
    assert np.abs(logits - reference).max() < 1e-4
    assert (logits.argmax(-1) == reference.argmax(-1)).all()


def test_fused_experts_convert_to_the_per_expert_releases_bytes(converted):
    """``experts.gate_up_proj`` [E, 2I, H] (gate rows first) and ``experts.down_proj``, backbone and head: the same
    stacked ``switch_mlp`` tensors as the per-expert form of the same model."""
    from tests.checkpoints import tree_digest

    a, b = (converted[name, "float32"] for name in ("per-expert", "fused"))
    index = "model.safetensors.index.json"  # its metadata records the source folder's name
    assert {k: v for k, v in tree_digest(a).items() if k != index} == {k: v for k, v in tree_digest(b).items()
                                                                        if k != index}
    assert json.loads((a / index).read_text())["weight_map"] == json.loads((b / index).read_text())["weight_map"]


def test_the_4bit_backbone_loads_and_stays_near_the_float_one(converted):
    reference = vlm_logits(vlm_model(converted["per-expert", "float32"]), IDS)
    logits = vlm_logits(vlm_model(converted["per-expert", "q4"]), IDS)
    config = json.loads((converted["per-expert", "q4"] / "config.json").read_text())
    shards = [k for k in config["quantization"] if "ngram_embedding.shards" in k]
    # the n-gram rows (32 wide) take group 32 beside the backbone's 32 here, and are listed where they differ
    assert np.isfinite(logits).all() and np.corrcoef(logits.ravel(), reference.ravel())[0, 1] > 0.95
    assert all(config["quantization"][k] != {"bits": 4, "group_size": 32, "mode": "affine"} for k in shards)


def test_the_norms_stay_zero_centred_and_a_shifted_one_is_caught(releases, converted, tmp_path):
    """mlx-vlm adds 1 to every qwen4_exp RMSNorm when it runs: the folder keeps the release's values, and a
    conversion that shifted them (as Qwen3.5's must) would give other logits."""
    from safetensors.numpy import load_file, save_file

    out = converted["per-expert", "float32"]
    raw = releases["per-expert"].tensors
    stored = {}
    for f in sorted(out.glob("model-*.safetensors")):
        stored.update(load_file(str(f)))
    norm = "language_model.model.layers.0.attn_hyper_connection.hc_norm.weight"
    assert np.array_equal(stored[norm], raw["model.language_model.layers.0.attn_hyper_connection.hc_norm.weight"]
                          .numpy())
    broken = tmp_path / "shifted"
    shutil.copytree(out, broken)
    for f in sorted(broken.glob("model-*.safetensors")):
        tensors = load_file(str(f))
        tensors = {k: (v + 1 if k.endswith("norm.weight") and v.ndim == 1 else v) for k, v in tensors.items()}
        save_file(tensors, str(f), metadata={"format": "mlx"})
    reference, _, _ = reference_logits(releases["per-expert"], torch.tensor([IDS]))
    assert np.abs(vlm_logits(vlm_model(broken), IDS) - reference).max() > 1e-2


def _drafter_parameters(model) -> dict:
    from mlx.utils import tree_flatten

    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


@pytest.mark.parametrize("name", ["per-expert", "fused"])
def test_the_head_is_what_mlx_vlms_splitter_makes_of_the_raw_source(releases, converted, name):
    from mlx_vlm.speculative.drafters import load_drafter

    ours, _ = load_drafter(str(converted[name, "float32"] / "mtp"), kind="mtp")
    theirs, _ = load_drafter(str(releases[name].path), kind="mtp")
    mine, reference = _drafter_parameters(ours), _drafter_parameters(theirs)
    assert sorted(mine) == sorted(reference)
    assert all(np.array_equal(mine[k], reference[k]) for k in mine)


@pytest.mark.parametrize("route", ["mtp", "root"])
@pytest.mark.parametrize("option", ["float32", "q4", "q4-match"])
def test_mlx_vlm_drafts_with_the_folder_equal_to_plain_greedy(converted, route, option):
    from mlx_vlm.generate import generate_step
    from mlx_vlm.speculative.drafters import load_drafter

    out = converted["per-expert", option]
    model = vlm_model(out)
    drafter, kind = load_drafter(str(out / "mtp" if route == "mtp" else out), kind="mtp")
    prompt = mx.array([IDS])
    drafted = [int(t) for t, _ in generate_step(prompt, model, None, None, max_tokens=24, temperature=0.0,
                                                 draft_model=drafter, draft_kind=kind)]
    plain = [int(t) for t, _ in generate_step(prompt, model, None, None, max_tokens=24, temperature=0.0)]
    assert drafter.draft_lens, "mlx-vlm fell back to plain decoding: the drafter did not run"
    assert drafted == plain


@pytest.mark.parametrize("option", ["float32", "q4"])
def test_the_fp8_release_converts_to_what_its_exact_dequantization_converts_to(converted, option):
    """Experts in 128x128-block FP8, n-gram tables under one per-tensor scale: the output is byte for byte the
    conversion of the same codes dequantized in float32 beforehand."""
    from safetensors.numpy import load_file

    fp8, reference = converted["fp8", option], converted["fp8-dequantized", option]
    for name in ["mtp.safetensors"] + sorted(p.name for p in reference.glob("model-*.safetensors")):
        a, b = load_file(str(fp8 / name)), load_file(str(reference / name))
        assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a), name


def test_the_fp8_plan_reads_every_scale(releases):
    plan = api.plan(releases["fp8"].path, OPTIONS["float32"])
    scaled = {it.name: it for it in plan.items if it.sources[0].scale is not None}
    table = [n for n in scaled if ".ngram_embedding.shards." in n]
    experts = [n for n in scaled if ".switch_mlp." in n]
    assert table and all(scaled[n].sources[0].scale.key.endswith("ngram_embedding.weight_scale") for n in table)
    assert experts and all(s.scale.key.endswith("weight_scale_inv") for n in experts for s in scaled[n].sources)
    assert {step.label for n in table for step in scaled[n].steps} >= {"dequant:fp8e4m3/tensor"}
    buffers = [it for it in plan.items if it.slot.kind == "buffer"]
    assert buffers and all(it.dtype == "int64" and it.quant is None for it in buffers)


def test_verify_accepts_source_and_output_and_says_which_runtimes_use_it(releases, converted):
    for folder in (releases["per-expert"].path, releases["fp8"].path, converted["per-expert", "q4"]):
        report = api.verify(folder)
        assert report.ok, [f for f in report.findings if f.severity == "error"]
    rows = {r.runtime: r for r in api.verify(converted["per-expert", "q4"]).runtimes}
    assert rows["mlx-vlm"].backbone_exact.ok and rows["mlx-vlm-drafter"].head_usable.ok
    assert rows["mlx-vlm"].head_usable.ok  # --draft-model OUT: the splitter finds the head at the root
    for runtime in ("mlx-lm>=0.32", "mtplx", "rapid-mlx", "vllm-mlx"):
        assert rows[runtime].backbone_exact.ok is False and not rows[runtime].head_usable.ok
        assert "qwen4_exp" in rows[runtime].backbone_exact.reason


def test_stock_mlx_lm_refuses_the_folder_by_name(converted):
    from mlx_lm.utils import load_model

    with pytest.raises(ValueError, match="qwen4_exp"):
        load_model(converted["per-expert", "float32"])


def test_families_lists_qwen4_exp():
    (family,) = [f for f in api.families() if f["family"] == "qwen4_exp"]
    assert family["backbone_library"] == "mlx-vlm" and family["backbone_modules"] == ["mlx_vlm.models.qwen4_exp"]
    assert set(family["head_runtimes"]) == {"mlx-vlm", "mlx-vlm-drafter"}


def test_the_card_runs_it_in_mlx_vlm_not_mlx_lm(releases, converted, tmp_path):
    """The card's usage follows the folder's runtime table: mlx-vlm with the whole folder as the drafter (the route
    that finds the head), no mlx-lm snippet that would fail on load; without its head the mlx-vlm drafting goes too."""
    from mtpconvert.hub.card import model_card

    card = model_card(converted["per-expert", "q4"], "me/flash-next-4bit")
    use = card.split("## Use")[1]
    assert "from mlx_lm import" not in use
    assert "python -m mlx_vlm.generate --model flash-next-4bit --draft-model flash-next-4bit --draft-kind mtp" in use
    headless = api.convert(releases["per-expert"].path, tmp_path / "headless",
                           ConvertOptions(dtype="float32", quant=QuantOptions(bits=4, group_size=32, mtp="drop")),
                           checks=NO_CHECKS).out
    assert "--draft-model" not in model_card(headless, "me/flash-next-4bit").split("## Use")[1]


def test_add_mtp_grafts_the_head_onto_mlx_vlms_own_conversion(releases, converted, tmp_path):
    """mlx-vlm's convert drops the head; ``add-mtp`` puts back the head the direct conversion keeps (the same
    bytes), verify accepts the folder and mlx-vlm drafts with it equal to plain greedy."""
    from mlx_vlm.convert import convert as vlm_convert
    from mlx_vlm.generate import generate_step
    from mlx_vlm.speculative.drafters import load_drafter
    from safetensors import safe_open
    from safetensors.numpy import load_file

    folder = tmp_path / "vlm-q4"
    vlm_convert(str(releases["per-expert"].path), str(folder), quantize=True, q_bits=4, q_group_size=32)
    assert not any("mtp" in k for f in folder.glob("*.safetensors") for k in safe_open(str(f), "np").keys())
    before = {f.name: f.read_bytes() for f in folder.glob("model*.safetensors")}
    api.add_mtp(str(releases["per-expert"].path), folder, checks=NO_CHECKS)
    grafted, direct = load_file(str(folder / "mtp.safetensors")), load_file(
        str(converted["per-expert", "q4"] / "mtp.safetensors"))
    assert sorted(grafted) == sorted(direct) and all(np.array_equal(grafted[k], direct[k]) for k in grafted)
    assert before == {f.name: f.read_bytes() for f in folder.glob("model*.safetensors")}  # the backbone untouched
    assert api.verify(folder).ok
    model = vlm_model(folder)
    drafter, kind = load_drafter(str(folder / "mtp"), kind="mtp")
    prompt = mx.array([IDS])
    drafted = [int(t) for t, _ in generate_step(prompt, model, None, None, max_tokens=16, temperature=0.0,
                                                 draft_model=drafter, draft_kind=kind)]
    plain = [int(t) for t, _ in generate_step(prompt, model, None, None, max_tokens=16, temperature=0.0)]
    assert drafter.draft_lens and drafted == plain


@pytest.mark.parametrize("fetch", [["--stream"], ["--stream", "--raw-window", "0.0002"]], ids=["shards", "ranges"])
def test_streamed_pull_writes_what_a_local_conversion_writes(releases, tmp_path, monkeypatch, fetch):
    """``pull-and-quantize --stream`` of the release (the head alone in its last shard), by whole shards or by byte
    ranges: every file as a local ``convert`` of the same source and options writes it; with ``--mtp drop`` the
    head's shard is never fetched."""
    from typer.testing import CliRunner

    from mtpconvert.cli import app
    from tests.hubserver import served_hub

    src = releases["per-expert"].path
    head_shard = sorted(src.glob("model-*.safetensors"))[-1].name
    args = ["--bits", "4", "--group-size", "32", "--dtype", "float32", "--no-smoke"]
    local = api.convert(src, tmp_path / "local", OPTIONS["q4"], checks=NO_CHECKS).out
    with served_hub(tmp_path, monkeypatch) as hub:
        hub.add_folder("Qwen/Flash-Next-Tiny", src)
        result = CliRunner().invoke(app, ["pull-and-quantize", "Qwen/Flash-Next-Tiny", str(tmp_path / "pulled"),
                                          *fetch, *args])
        assert result.exit_code == 0, result.output
        assert [r for r in hub.log if r.method == "GET" and r.path.endswith(head_shard)]
        before = len(hub.log)
        result = CliRunner().invoke(app, ["pull-and-quantize", "Qwen/Flash-Next-Tiny", str(tmp_path / "dropped"),
                                          *fetch, *args, "--mtp", "drop"])
        assert result.exit_code == 0, result.output
        assert not [r for r in hub.log[before:] if r.method == "GET" and r.path.endswith(head_shard)]
    for name in ["mtp.safetensors"] + sorted(p.name for p in local.glob("model*.safetensors")):
        assert (tmp_path / "pulled" / name).read_bytes() == (local / name).read_bytes(), name
    assert api.verify(tmp_path / "pulled").ok


@pytest.mark.parametrize("option", ["float32", "q4"])
@pytest.mark.parametrize("depth", [1, 2])
def test_our_runtime_greedy_mtp_equals_plain(converted, option, depth):
    """Through the family's adapter (mlx-vlm's language model for the pre-mixer hidden, its speculative cache
    transaction to undo a pass) and the head built from mlx-vlm's drafter modules: the head's own drafts, then
    drafts replaced by the true token at rate 0.6 (``measure.oracle``), so accepted and partly accepted passes are
    undone too (GatedDeltaNet state, the n-gram history and the attention caches alike)."""
    from mtpconvert.runtime.decoding.load import load
    from mtpconvert.runtime.decoding.speculative import mtp_generate, plain_generate
    from mtpconvert.runtime.measure.oracle import Oracle

    m = load(converted["per-expert", option])
    plain, _ = plain_generate(m, IDS[:10], 16 + depth)
    tokens, stats = mtp_generate(m, IDS[:10], 16, depth=depth, check_offsets=True)
    assert tokens == plain[:16] and stats.proposed[0] > 0
    oracle = Oracle(0.6, m.backbone.vocab_size, {0: plain})
    tokens, stats = mtp_generate(m, IDS[:10], 16, depth=depth, check_offsets=True, draft_hook=oracle.for_stream(0))
    assert tokens == plain[:16] and sum(stats.accepted) > 0 and oracle.stats.wrong > 0


def test_our_plain_greedy_is_mlx_vlms(converted):
    """The adapter's plain decoding is mlx-vlm's own: the same greedy tokens as its ``generate_step``."""
    from mlx_vlm.generate import generate_step

    from mtpconvert.runtime.decoding.load import load
    from mtpconvert.runtime.decoding.speculative import plain_generate

    out = converted["per-expert", "float32"]
    ours, _ = plain_generate(load(out), IDS, 16)
    theirs = [int(t) for t, _ in generate_step(mx.array([IDS]), vlm_model(out), None, None, max_tokens=16,
                                               temperature=0.0)]
    assert ours == theirs


@pytest.mark.parametrize("option", ["float32", "q4"])
def test_layerwise_check_predicts_what_the_loaded_model_predicts(converted, option):
    """One layer resident at a time, the head loaded from the sidecar through the drafter's names: the same tokens
    as the whole model loaded."""
    from mtpconvert.runtime.decoding.load import load
    from mtpconvert.runtime.smoke.layerwise import layerwise_acceptance
    from mtpconvert.runtime.smoke.teacher_forced import teacher_forced_full

    out = converted["per-expert", option]
    ids = [IDS, IDS[3:12]]
    layerwise = layerwise_acceptance(out, token_ids=ids, exact=True)
    full = teacher_forced_full(load(out), ids)
    assert layerwise.backbone_next == full.backbone_next
    assert layerwise.head_next == full.head_next and layerwise.head_next_without_mlp == full.head_next_without_mlp


@pytest.fixture(scope="module")
def bf16(releases, tmp_path_factory):
    return api.convert(releases["per-expert"].path, tmp_path_factory.mktemp("qwen4_exp_bf16") / "out",
                       ConvertOptions(dtype="bfloat16"), checks=NO_CHECKS).out


@pytest.mark.parametrize("option", ["float32", "q4", "bf16"])
def test_batched_rows_equal_solo_greedy(converted, bf16, option, monkeypatch):
    """Batched MTP through the family's adapter (``rows.py``: right-aligned QSA rows, one-token passes over padded
    rows masked by the rows' key validity rather than mlx-vlm's ``left_padded_decode``; mlx-vlm's ArraysCache
    committing each row's prefix of the linear attention and the n-gram embedding's window and token history):
    rows of different prompt lengths, joining at different steps, decode past the QSA indexer's budget, and equal the
    plain batched engine's and their solo plain greedy decodes. The indexer is watched selecting blocks for a padded
    row in a one-token pass (what mlx-vlm's own left-padded batch decodes otherwise than the row alone), so the
    test cannot pass on dense attention only."""
    from mlx_vlm.models.qwen4_exp.language import Qwen4ExpQSAIndexer

    from mtpconvert.runtime.decoding.load import load
    from tests.test_batched import assert_batched_rows_equal_solo

    selected = []
    build_mask = Qwen4ExpQSAIndexer.build_mask

    def watched(indexer, selection):
        sparse = selection.complete_counts > indexer.block_topk
        padded = selection.left_padding > 0
        if selection.selected_blocks.shape[1] == 1 and bool(mx.any(sparse[:, 0] & padded)):
            selected.append(selection.selected_blocks)
        return build_mask(indexer, selection)

    monkeypatch.setattr(Qwen4ExpQSAIndexer, "build_mask", watched)
    m = load(bf16 if option == "bf16" else converted["per-expert", option])
    assert m.family.capabilities.batched
    assert_batched_rows_equal_solo(m, [IDS[i % 3: 5 + i] for i in range(6)], monkeypatch)
    assert selected, "no padded row's one-token pass selected blocks: the rows never outgrew the indexer's budget"


def test_a_padded_rows_one_token_pass_is_that_row_alone(converted):
    """Two rows of 5 and 8 tokens in per-row caches (the first padded by 3), then one-token passes past the indexer's
    budget: each row's logits are its solo decode's, bit for bit. mlx-vlm's own mask for that pass,
    ``"left_padded_decode"``, into which its QSA attention cannot fold the selected blocks' mask, puts the padded
    rows apart from their solo decode from the first pass in which their indexer selects."""
    from mlx_vlm.models.qwen3_5.language import _create_qwen3_5_attention_mask

    from mtpconvert.runtime.decoding.load import load

    m = load(converted["per-expert", "float32"])
    rows = [IDS[1:6], IDS[3:11]]
    fed = [[(7 * i + 3) % 400 + 20, (11 * i + 5) % 400 + 20] for i in range(12)]
    budget = (m.backbone.args.indexer_budget // m.backbone.args.indexer_compress_ratio + 1) * \
        m.backbone.args.indexer_compress_ratio  # the first key count at which a one-token pass selects blocks

    def logits(tokens, cache):
        return m.logits(m.backbone.forward(mx.array(tokens), cache)[1])

    def apart(theirs: bool) -> list:
        solo, batch = [], None
        for r in rows:
            solo.append(m.backbone.make_cache())
            m.backbone.forward(mx.array([r]), solo[-1])
            c = m.backbone.row_cache(max_pass=2, rows=1)
            m.backbone.forward(mx.array([r]), c)
            batch = c if batch is None else [a.extend(b) or a for a, b in zip(batch, c)]
        attention = batch[m.backbone.text.model.fa_idx]
        assert attention.pad == [3, 0]
        out = []
        for step in fed:
            if theirs:
                mask = _create_qwen3_5_attention_mask(mx.zeros((2, 1, 1)), attention)
                assert mask == "left_padded_decode"
                hidden = m.backbone._one_token_rows(mx.array(step)[:, None], batch, attention.positions(1), mask)
                together = m.logits(hidden)[:, 0]
            else:
                together = logits([[t] for t in step], batch)[:, 0]
            alone = [logits([[t]], c)[0, 0] for t, c in zip(step, solo)]
            out.append([(n, mx.max(mx.abs(together[r] - alone[r])).item()) for r, n in
                        enumerate(attention.lengths)])  # the keys the pass read (the row's length after it)
        return out

    ours, theirs = apart(False), apart(True)
    print("max |batch - alone| per step and row (keys read, difference): ours", ours, "mlx-vlm's mask", theirs)
    assert all(d == 0 for step in ours for _, d in step)
    assert all(d == 0 for step in theirs for n, d in step if n < budget)
    assert min(d for step in theirs for n, d in step if n >= budget) > 1e-4


def test_bench_concurrency_is_refused_naming_its_baseline(converted):
    """The batched bench divides by mlx-lm's BatchGenerator, which cannot run an mlx-vlm model: refused before
    loading, naming the baseline (batched MTP itself runs the family)."""
    from mtpconvert.errors import OptionsError
    from mtpconvert.options import BenchOptions

    with pytest.raises(OptionsError, match=r"--concurrency: the batched bench's baseline, mlx-lm's BatchGenerator, "
                                           r"does not run the qwen4_exp backbone \(mlx-vlm's model\)"):
        api.bench(converted["per-expert", "float32"], BenchOptions(concurrency=(1, 2), max_tokens=4))
