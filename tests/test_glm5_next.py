"""GLM-5.3-Flash (``glm5_next``): tiny releases made with transformers' own classes (``tests.checkpoints_glm5_next``)
converted, then checked against the consumers: mlx-vlm 0.7.10 loads the backbone and matches transformers' float32
logits, its own splitter makes of the raw source exactly the head the folder holds, its drafter loads the head by
either route (``--draft-model OUT`` and ``OUT/mtp``, one file) strictly and MTP-decodes equal to plain greedy, and
our runtime's MTP decode through the family's adapter equals plain greedy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch

from mtpconvert import api
from mtpconvert.errors import ConfigError, LayoutError
from mtpconvert.gate import Gate
from mtpconvert.options import ConvertOptions, QuantOptions
from tests.checkpoints_glm5_next import build, reference_logits

mlx_vlm = pytest.importorskip("mlx_vlm", reason="the glm5_next backbone runs in mlx-vlm (pip install mtpconvert[vlm])")

IDS = [5, 17, 300, 42, 8, 99, 123, 7, 256, 31, 64, 11, 77, 21]  # longer than index_topk (8): the indexer selects
NO_SMOKE = Gate(verify=True, smoke=False)
OPTIONS = {
    "float32": ConvertOptions(dtype="float32"),
    "bf16": ConvertOptions(),  # the release's dtype
    "q4": ConvertOptions(dtype="float32", quant=QuantOptions(bits=4, group_size=32)),
    "q4-match": ConvertOptions(dtype="float32", quant=QuantOptions(bits=4, group_size=32, mtp="match")),
    "q4-mtpbits8": ConvertOptions(dtype="float32", quant=QuantOptions(bits=4, group_size=32, mtp_bits=8)),
}


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return build(tmp_path_factory.mktemp("glm5_next") / "raw")


@pytest.fixture(scope="module")
def converted(release, tmp_path_factory):
    root = tmp_path_factory.mktemp("glm5_next_out")
    return {name: api.convert(release.path, root / name, opts, checks=NO_SMOKE).out for name, opts in OPTIONS.items()}


def vlm_model(path: Path):
    from mlx_vlm.utils import load_model

    return load_model(Path(path))


def vlm_logits(model, ids) -> np.ndarray:
    return np.array(model.language_model(mx.array([ids])).logits.astype(mx.float32))


def parameters(module) -> dict:
    from mlx.utils import tree_flatten

    return {k: np.array(v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v)
            for k, v in tree_flatten(module.parameters())}


def test_mlx_vlm_loads_the_backbone_and_matches_transformers(release, converted):
    reference, _, _ = reference_logits(release, torch.tensor([IDS]))
    logits = vlm_logits(vlm_model(converted["float32"]), IDS)
    assert np.abs(logits - reference).max() < 1e-4
    assert (logits.argmax(-1) == reference.argmax(-1)).all()


def test_the_4bit_folder_is_mlx_vlms_own_quantization_of_the_float_one(converted):
    """Loaded, the 4-bit folder holds exactly what ``nn.quantize`` makes of the float folder's model under mlx-vlm's
    rules (its ``quant_predicate``: not the hyper-connections or the indexer's pooling tables; a weight whose input
    dimension the group divides): the projections stored apart and fused at load quantize as the fused ones would."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    def predicate(path, module):
        return (hasattr(module, "to_quantized") and module.weight.shape[-1] % 32 == 0
                and not any(s in path for s in ("attn_hc", "ffn_hc", "index_kpool_compress")))

    ours = vlm_model(converted["q4"])
    theirs = vlm_model(converted["float32"])
    nn.quantize(theirs, group_size=32, bits=4, class_predicate=predicate)
    mine, reference = dict(tree_flatten(ours.parameters())), dict(tree_flatten(theirs.parameters()))
    assert sorted(mine) == sorted(reference)
    assert [k for k in mine if not mx.array_equal(mine[k], reference[k]).item()] == []


def test_a_shifted_norm_or_a_raw_conv_is_caught(release, converted, tmp_path):
    """The folder keeps every norm gain as stored (plain RMSNorm); a conversion that added 1 (as Qwen3.5's must) would
    give other logits, and a short convolution left in its raw layout does not load."""
    from safetensors.numpy import load_file, save_file

    reference, _, _ = reference_logits(release, torch.tensor([IDS]))
    for name, change in (("shifted", lambda k, v: v + 1 if k.endswith("layernorm.weight") else v),
                         ("raw-conv", lambda k, v: np.swapaxes(v, 1, 2) if k.endswith("_conv.conv.weight") else v)):
        broken = tmp_path / name
        shutil.copytree(converted["float32"], broken)
        for f in sorted(broken.glob("model-*.safetensors")):
            save_file({k: change(k, v) for k, v in load_file(str(f)).items()}, str(f), metadata={"format": "mlx"})
        if name == "shifted":
            assert np.abs(vlm_logits(vlm_model(broken), IDS) - reference).max() > 1e-2
        else:
            with pytest.raises(ValueError):
                vlm_model(broken)


@pytest.mark.parametrize("option", ["float32", "q4"])
def test_the_head_is_what_mlx_vlms_splitter_makes_of_the_raw_source(release, converted, option):
    """The drafter mlx-vlm builds from ``OUT/mtp`` holds, tensor for tensor, what its splitter makes of the raw
    nextn layer (the q4 folder keeps its head float: ``--mtp keep``)."""
    from mlx_vlm.speculative.drafters import load_drafter

    ours, _ = load_drafter(str(converted[option] / "mtp"), kind="mtp")
    theirs, _ = load_drafter(str(release.path), kind="mtp")
    mine, reference = parameters(ours), parameters(theirs)
    assert sorted(mine) == sorted(reference)
    assert [k for k in mine if not np.array_equal(mine[k], reference[k])] == []


def test_experts_in_another_order_are_caught(release, converted, tmp_path):
    from mlx_vlm.speculative.drafters import load_drafter
    from safetensors.numpy import load_file, save_file

    broken = tmp_path / "reordered"
    shutil.copytree(converted["float32"], broken, symlinks=True)
    head = load_file(str(broken / "mtp.safetensors"))
    key = next(k for k in head if k.endswith("switch_mlp.gate_proj.weight"))
    head[key] = head[key][::-1].copy()
    (broken / "mtp" / "weights.safetensors").unlink()
    save_file(head, str(broken / "mtp.safetensors"), metadata={"format": "mlx"})
    shutil.copy(broken / "mtp.safetensors", broken / "mtp" / "weights.safetensors")
    ours, _ = load_drafter(str(broken / "mtp"), kind="mtp")
    theirs, _ = load_drafter(str(release.path), kind="mtp")
    mine, reference = parameters(ours), parameters(theirs)
    changed = [k for k in mine if not np.array_equal(mine[k], reference[k])]
    assert changed == ["mtp_block.mlp.switch_mlp.gate_proj.weight"]


@pytest.mark.parametrize("route", ["mtp", "root"])
@pytest.mark.parametrize("option", ["float32", "q4", "q4-match", "q4-mtpbits8"])
def test_mlx_vlm_drafts_with_the_folder_equal_to_plain_greedy(converted, route, option):
    from mlx_vlm.generate import generate_step
    from mlx_vlm.speculative.drafters import load_drafter

    out = converted[option]
    model = vlm_model(out)
    drafter, kind = load_drafter(str(out / "mtp" if route == "mtp" else out), kind="mtp")
    prompt = mx.array([IDS])
    drafted = [int(t) for t, _ in generate_step(prompt, model, None, None, max_tokens=16, temperature=0.0,
                                                 draft_model=drafter, draft_kind=kind)]
    plain = [int(t) for t, _ in generate_step(prompt, model, None, None, max_tokens=16, temperature=0.0)]
    assert drafter.draft_lens, "mlx-vlm fell back to plain decoding: the drafter did not run"
    assert drafted == plain


@pytest.mark.parametrize("option", ["float32", "q4"])
@pytest.mark.parametrize("depth", [1, 2])
def test_our_runtime_greedy_mtp_equals_plain(converted, option, depth):
    """Through the family's adapter (mlx-vlm's model, its speculative cache transaction to undo a pass) and the head
    built from mlx-vlm's drafter modules: the head's own drafts, then drafts replaced by the true token at rate 0.6
    (``measure.oracle``) so that accepted and partly accepted passes are undone too."""
    from mtpconvert.runtime.decoding.load import load
    from mtpconvert.runtime.decoding.speculative import mtp_generate, plain_generate
    from mtpconvert.runtime.measure.oracle import Oracle

    m = load(converted[option])
    plain, _ = plain_generate(m, IDS[:10], 16 + depth)
    tokens, stats = mtp_generate(m, IDS[:10], 16, depth=depth, check_offsets=True)
    assert tokens == plain[:16] and stats.proposed[0] > 0
    oracle = Oracle(0.6, m.backbone.vocab_size, {0: plain})
    tokens, stats = mtp_generate(m, IDS[:10], 16, depth=depth, check_offsets=True, draft_hook=oracle.for_stream(0))
    assert tokens == plain[:16] and sum(stats.accepted) > 0 and oracle.stats.wrong > 0


@pytest.mark.parametrize("option", ["q4", "bf16"])
def test_layerwise_check_predicts_what_the_loaded_model_predicts(converted, option):
    """One layer resident at a time (a shared indexer layer takes its prompt's top-k from the layer before), the head
    loaded from the sidecar through the drafter's names: the same tokens as the whole model loaded. bf16: mlx-vlm's
    float expert stacks run in float32 on the CPU (its gather_mm takes no other), in both."""
    from mtpconvert.runtime.decoding.load import load
    from mtpconvert.runtime.smoke.layerwise import layerwise_acceptance
    from mtpconvert.runtime.smoke.teacher_forced import teacher_forced_full

    ids = [IDS, IDS[3:12]]
    layerwise = layerwise_acceptance(converted[option], token_ids=ids, exact=True)
    full = teacher_forced_full(load(converted[option]), ids)
    assert layerwise.backbone_next == full.backbone_next
    assert layerwise.head_next == full.head_next and layerwise.head_next_without_mlp == full.head_next_without_mlp


def test_streamed_layerwise_check_fed_shard_by_shard_equals_the_post_hoc_one(release, tmp_path):
    """The check a streamed publish runs, each output shard freed as soon as it is returned: with shards so small
    that the parts of one projection mlx-vlm fuses at load (``q_a_proj`` / ``kv_a_proj_with_mqa``) land in two, the
    layer is fused when it is loaded, from what was held of each shard."""
    from mtpconvert.families import family_for
    from mtpconvert.hub.publish import stub_in_place
    from mtpconvert.runtime.smoke.layerwise import layerwise_acceptance
    from mtpconvert.runtime.smoke.streamed import StreamedLayerwise

    out = tmp_path / "small-shards"
    api.convert(release.path, out, ConvertOptions(quant=QuantOptions(bits=4, group_size=32), max_shard_bytes=20_000),
                checks=Gate(verify=False, smoke=False))
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    split = [i for i in (1, 2) if weight_map[f"language_model.model.layers.{i}.self_attn.q_a_proj.weight"]
             != weight_map[f"language_model.model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight"]]
    assert split, "no fused pair spans two shards: the test would not test it"
    posthoc = layerwise_acceptance(out, token_ids=[IDS])
    streamed = StreamedLayerwise(weight_map, family_for(json.loads((out / "config.json").read_text())),
                                 token_ids=[IDS])
    for shard in sorted(set(weight_map.values())):
        for done in streamed.feed(shard, out / shard):
            stub_in_place(out / done)
    result = streamed.finish()
    assert result.backbone_next == posthoc.backbone_next and result.head_next == posthoc.head_next


def test_verify_accepts_source_and_output_and_both_drafter_routes(release, converted):
    for folder in (release.path, converted["bf16"], converted["q4-match"]):
        report = api.verify(folder)
        assert report.ok, [f.message for f in report.findings if f.severity == "error"]
        assert report.mtp_layers_found == 1 and report.mtp_complete
    rows = {r.runtime: r for r in api.verify(converted["q4"]).runtimes}
    assert rows["mlx-vlm"].backbone_exact.ok and rows["mlx-vlm"].head_usable.ok  # --draft-model OUT
    assert rows["mlx-vlm-drafter"].head_usable.ok  # --draft-model OUT/mtp
    assert "mtp.safetensors" in rows["mlx-vlm"].head_usable.reason
    for runtime in ("mlx-lm>=0.32", "mtplx", "rapid-mlx", "vllm-mlx"):
        assert rows[runtime].backbone_exact.ok is False and "glm5_next" in rows[runtime].backbone_exact.reason
    # the nextn layer's tensors, kv_b_proj split in two, the experts stacked into three
    nextn = [k for k in release.tensors if ".layers.4." in k and ".mlp.experts." not in k]
    head = json.loads((converted["q4"] / "config.json").read_text())["mlx_lm_extra_tensors"]
    assert head == {"mtp_file": "mtp.safetensors", "mtp_tensor_count": len(nextn) + 1 + 3}


def test_a_head_at_other_bits_is_named_under_the_drafters_module_paths(converted, tmp_path):
    """mlx-vlm's drafter looks a module's quantization up by its own path (``mtp_block.self_attn.qkv_a_proj``): the
    config names the 8-bit head there too; without those entries the table says the drafter cannot use it."""
    from mtpconvert.compat import check_folder

    out = converted["q4-mtpbits8"]
    block = json.loads((out / "config.json").read_text())["quantization"]
    assert block["mtp_block.self_attn.qkv_a_proj"] == block["language_model.model.layers.4.self_attn.q_a_proj"]
    assert block["mtp_block.self_attn.qkv_a_proj"]["bits"] == 8 and block["bits"] == 4
    assert block["eh_proj"] is False  # never quantized
    broken = tmp_path / "unnamed"
    shutil.copytree(out, broken)
    for name in ("config.json", "mtp/config.json"):
        config = json.loads((broken / name).read_text())
        for b in ("quantization", "quantization_config"):
            config[b] = {k: v for k, v in config[b].items() if not k.startswith(("mtp_block.", "eh_proj"))}
        (broken / name).write_text(json.dumps(config))
    rows = {r.runtime: r for r in check_folder(broken).runtimes}
    for runtime in ("mlx-vlm", "mlx-vlm-drafter"):
        assert not rows[runtime].head_usable.ok and "default bits" in rows[runtime].head_usable.reason


def test_the_sidecar_holds_the_nextn_layer_under_the_names_mlx_vlms_splitter_selects(converted):
    """One file, two names (``mtp/weights.safetensors`` is the same inode); its keys are the nextn layer's MLX names,
    which mlx-vlm's backbone loader drops and its splitter selects, and ``mtp/config.json`` is the model's config."""
    out = converted["float32"]
    keys = mx.load(str(out / "mtp.safetensors")).keys()
    assert keys and all(k.startswith("language_model.model.layers.4.") for k in keys)
    assert "language_model.model.layers.4.shared_head.norm.weight" in keys
    assert (out / "mtp.safetensors").stat().st_ino == (out / "mtp" / "weights.safetensors").stat().st_ino
    assert json.loads((out / "mtp" / "config.json").read_text()) == json.loads((out / "config.json").read_text())
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert not any(".layers.4." in k for k in index)


def test_the_card_runs_it_in_mlx_vlm_drafting_from_the_folder_itself(converted):
    from mtpconvert.hub.card import model_card

    card = model_card(converted["q4"], "me/glm5-4bit").split("## Use")[1]
    assert "mlx-vlm loads it and drafts with its MTP head (`--draft-model glm5-4bit`" in card
    assert "Stock mlx-lm" not in card


def test_stock_mlx_lm_refuses_the_folder_by_name(converted):
    from mlx_lm.utils import load_model

    with pytest.raises(ValueError, match="glm5_next"):
        load_model(converted["float32"])


def test_families_lists_glm5_next(capsys):
    from mtpconvert.cli import run

    assert run(["families", "--json"]) == 0
    (family,) = [f for f in json.loads(capsys.readouterr().out) if f["family"] == "glm5_next"]
    assert family["backbone_library"] == "mlx-vlm" and family["backbone_modules"] == ["mlx_vlm.models.glm5_next"]
    assert family["mtp_count_key"] == "num_nextn_predict_layers" and family["head"]["shares"] == ["embed_tokens",
                                                                                               "lm_head"]
    assert set(family["head_runtimes"]) == {"mlx-vlm", "mlx-vlm-drafter"}


def _config(release) -> dict:
    return json.loads((release.path / "config.json").read_text())


@pytest.mark.parametrize("edit, key, message", [
    (lambda c: c.update(c.pop("text_config"), model_type="glm5_next"), "text_config", "nests the text model"),
    (lambda c: c["text_config"].update(qk_rope_head_dim=64), "text_config.qk_rope_head_dim", "no RoPE"),
    (lambda c: c["text_config"].update(num_key_value_heads=1), "text_config.num_key_value_heads", "one key head"),
    (lambda c: c["text_config"].update(num_nextn_predict_layers=2), "text_config.num_nextn_predict_layers",
     "one nextn layer"),
    (lambda c: c["text_config"].update(indexer_types=["full", "shared", "full", "full"]),
     "text_config.indexer_types", "none before it"),
    (lambda c: c["text_config"].update(mlp_layer_types=["dense", "sparse"]), "text_config.mlp_layer_types",
     "must list 4 entries"),
])
def test_a_config_mlx_vlm_would_misread_is_refused_by_key(release, edit, key, message):
    from mtpconvert.families import family_for

    config = _config(release)
    edit(config)
    with pytest.raises(ConfigError, match=message) as e:
        family_for(config).spec(config)
    assert e.value.key == key


def test_a_nextn_layer_with_its_own_vocabulary_or_past_the_count_is_refused(release, tmp_path):
    """GLM-4.x's nextn layer carries embed_tokens and shared_head.head; mlx-vlm's glm5_next drafter has no parameter
    for them (its strict load fails), so the conversion names the tensor instead of writing it."""
    from mtpconvert.families import family_for
    from safetensors.torch import load_file, save_file

    family = family_for(_config(release))
    with pytest.raises(LayoutError, match="past the nextn layer"):
        family.contributions("model.language_model.layers.5.enorm.weight")
    src = tmp_path / "own-vocab"
    shutil.copytree(release.path, src)
    last = sorted(src.glob("model-*.safetensors"))[-1]
    tensors = load_file(str(last))
    extra = "model.language_model.layers.4.shared_head.head.weight"
    tensors[extra] = torch.zeros(512, 64, dtype=torch.bfloat16)
    save_file(tensors, str(last), metadata={"format": "pt"})
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"][extra] = last.name
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(LayoutError, match="own embed_tokens / shared_head.head") as e:
        api.plan(src, OPTIONS["float32"])
    assert e.value.key == extra



@pytest.mark.parametrize("option", ["float32", "q4", "bf16"])
def test_batched_rows_equal_solo_greedy(converted, option, monkeypatch):
    """Batched MTP through the family's adapter (``rows.py``: right-aligned sparse-attention rows, mlx-vlm's
    ArraysCache committing each row's prefix): rows of different prompt lengths, longer than ``index_topk`` as they
    decode (the indexer selects pools), equal the plain batched engine's and their solo plain greedy decodes."""
    from mtpconvert.runtime.decoding.load import load
    from tests.test_batched import assert_batched_rows_equal_solo

    assert_batched_rows_equal_solo(load(converted[option]), [IDS[i % 3: 5 + i] for i in range(6)], monkeypatch)


def test_batched_prefill_runs_one_prompt_length_at_a_time(converted):
    """mlx-vlm's recurrent caches keep a state per position of a recorded pass, so prompts of different lengths are
    not padded into one pass (whose padding would then be recorded a state per prompt token): one pass per length,
    none longer than its prompts."""
    from mtpconvert.runtime.decoding import batched
    from mtpconvert.runtime.decoding.batched import Stream
    from mtpconvert.runtime.decoding.load import load

    m = load(converted["float32"])
    assert not m.backbone.pads_prefill
    passes = []
    forward = m.backbone.forward
    m.backbone.forward = lambda tokens, cache: passes.append(tokens.shape) or forward(tokens, cache)
    engine = batched.BatchedMTP(m, depth=1)
    engine.add_many([Stream(IDS[:5], 4), Stream(IDS[:7], 4), Stream(IDS[1:6], 4)], [0, 1, 2])
    assert sorted(passes) == [(1, 7), (2, 5)]


def test_bench_concurrency_is_refused_naming_its_baseline(converted):
    """The batched bench divides by mlx-lm's BatchGenerator, which cannot run an mlx-vlm model (it reads logits off
    the model's call, and mlx-vlm's returns an output object): refused before loading, naming the baseline."""
    from mtpconvert.errors import OptionsError
    from mtpconvert.options import BenchOptions

    with pytest.raises(OptionsError, match=r"--concurrency: the batched bench's baseline, mlx-lm's BatchGenerator, "
                                           r"does not run the glm5_next backbone \(mlx-vlm's model\)"):
        api.bench(converted["float32"], BenchOptions(concurrency=(1, 2), max_tokens=4))
