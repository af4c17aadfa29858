"""DeepSeek-V4-Flash (``deepseek_v4``): tiny releases made with transformers' own classes
(``tests.checkpoints_deepseek_v4``), BF16 and FP8-E8M0 + MXFP4, converted, then checked against the consumers:
mlx-vlm 0.7.10 loads the backbone and matches transformers' float32 logits, its own splitter makes of the raw
source exactly the head the folder holds, its drafter loads ``OUT/mtp`` strictly and MTP-decodes equal to plain
greedy, our runtime's MTP decode through the family's adapter equals plain greedy, the MXFP4 experts are the source's
bytes, and the FP8 release converts to what its exact dequantization converts to."""

from __future__ import annotations

import itertools
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
from tests.checkpoints_deepseek_v4 import build, reference_head_logits, reference_logits

mlx_vlm = pytest.importorskip("mlx_vlm", reason="the deepseek_v4 backbone runs in mlx-vlm (pip install mtpconvert[vlm])")

IDS = [5, 17, 1, 42, 99, 7, 3, 200, 11, 64, 13, 8, 77, 21]
NO_CHECKS = Gate(verify=True, smoke=False)
Q4 = QuantOptions(bits=4, group_size=32)
OPTIONS = {
    "float32": ConvertOptions(dtype="float32"),
    "bfloat16": ConvertOptions(dtype="bfloat16"),
    "q4": ConvertOptions(dtype="float32", quant=Q4),
    "q4-match": ConvertOptions(dtype="float32", quant=QuantOptions(bits=4, group_size=32, mtp="match")),
    # the release's own quantization: FP8 + E8M0 as mxfp8, MXFP4 as mxfp4, the head too
    "mxfp8-match": ConvertOptions(dtype="float32", quant=QuantOptions(bits=8, group_size=32, mode="mxfp8",
                                                                     mtp="match")),
    # the same at the release's float dtype: the head's norms and router stay bfloat16, as the splitter reads them
    "mxfp8-match-bf16": ConvertOptions(dtype="bfloat16", quant=QuantOptions(bits=8, group_size=32, mode="mxfp8",
                                                                           mtp="match")),
}
CONVERSIONS = {"bf16": ("float32", "bfloat16", "q4", "q4-match"), "fp8": ("float32", "q4", "mxfp8-match", "mxfp8-match-bf16"),
               "fp8-dequantized": ("float32", "q4")}


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_v4")
    return {"bf16": build(root / "bf16"), "fp8": build(root / "fp8", form="fp8")}


def source(releases, name: str) -> Path:
    return releases["fp8"].reference if name == "fp8-dequantized" else releases[name].path


@pytest.fixture(scope="module")
def converted(releases, tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_v4_out")
    return {(name, option): api.convert(source(releases, name), root / f"{name}-{option}", OPTIONS[option],
                                        checks=NO_CHECKS).out
            for name, options in CONVERSIONS.items() for option in options}


def vlm_model(path: Path):
    from mlx_vlm.utils import load_model

    return load_model(Path(path))


def vlm_logits(model, ids) -> np.ndarray:
    """Logits of one whole pass over ``ids`` with mlx-vlm's own caches (without them its compressed attention lets
    every query see every pooled window: docs/interop.md)."""
    text = model.language_model
    return np.array(text(mx.array([ids]), cache=text.make_cache()).logits[0])


@pytest.mark.parametrize("name", ["bf16", "fp8"])
def test_mlx_vlm_loads_the_backbone_and_matches_transformers(releases, converted, name):
    reference = reference_logits(releases[name].reference, IDS)
    logits = vlm_logits(vlm_model(converted[name, "float32"]), IDS)
    assert np.abs(logits - reference).max() < 1e-4
    assert (logits.argmax(-1) == reference.argmax(-1)).all()


def test_mlx_vlm_decodes_compressed_layers_apart_from_transformers_as_documented(releases, converted):
    """mlx-vlm 0.7.10 (docs/interop.md): one token at a time, its ratio-4 compressor loses the overlap half of the
    window completed in an earlier call, so decoding drifts from transformers' (whose token-by-token pass equals its
    whole one) once the second window closes; a whole pass matches. What the tests compare is chosen by this."""
    reference = reference_logits(releases["bf16"].reference, IDS)
    text = vlm_model(converted["bf16", "float32"]).language_model
    cache = text.make_cache()
    stepped = np.concatenate([np.array(text(mx.array([[t]]), cache=cache).logits[0]) for t in IDS])
    assert np.abs(stepped[:7] - reference[:7]).max() < 1e-4
    assert np.abs(stepped - reference).max() > 1e-3


def test_the_head_computes_what_transformers_modules_compute(releases, converted, tmp_path):
    """Teacher-forced through our runtime (the family's adapter and head): the head's logits for token t+2 are the
    release's MTP block composed of transformers' deepseek_v4 modules."""
    from mtpconvert.runtime.decoding.load import load

    reference = reference_head_logits(releases["bf16"].reference, IDS, tmp_path / "head")
    m = load(converted["bf16", "float32"])
    tokens = mx.array([IDS])
    _, hidden = m.backbone.forward(tokens, m.backbone.make_cache())
    state = m.head(hidden[:, :-1], m.embed(tokens[:, 1:]), m.head.make_cache())
    logits = np.array(m.draft_logits(state)[0])
    assert logits.shape == reference.shape and np.abs(logits - reference).max() < 1e-4


def _parameters(model) -> dict:
    from mlx.utils import tree_flatten

    return dict(tree_flatten(model.parameters()))


def _same(a: mx.array, b: mx.array) -> bool:
    """The same dtype, shape and bytes."""
    bits = {2: mx.uint16, 4: mx.uint32}.get(a.dtype.size) if a.dtype in (mx.bfloat16, mx.float16, mx.float32) else None
    return a.dtype == b.dtype and a.shape == b.shape and bool(mx.array_equal(a.view(bits), b.view(bits)) if bits
                                                                else mx.array_equal(a, b))


def _values(model) -> dict:
    """Every parameter of a drafter as float32 values, its quantized modules dequantized."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    out = {k: np.array(v.astype(mx.float32)) for k, v in _parameters(model).items()
           if not k.endswith((".scales", ".biases")) and v.dtype != mx.uint32}
    for path, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module):
        if hasattr(m, "scales"):
            w = mx.dequantize(m.weight, m.scales, getattr(m, "biases", None), group_size=m.group_size, bits=m.bits,
                              mode=m.mode, dtype=mx.float32)
            out[path + ".weight"] = np.array(w)
    return out


def test_the_head_is_what_mlx_vlms_splitter_makes_of_the_raw_source(releases, converted):
    """``load_drafter(OUT/mtp)`` against ``load_drafter(RAW)`` (mlx-vlm's splitter over the release): the BF16
    release's head, converted at bfloat16, is the same arrays bit for bit; the FP8 release's head holds the same
    values, dequantized exactly at float32, or as the splitter's own mxfp8 / mxfp4 bytes under --q-mode mxfp8."""
    from mlx_vlm.speculative.drafters import load_drafter

    def drafter(path):
        return load_drafter(str(path), kind="mtp")[0]

    ours, theirs = _parameters(drafter(converted["bf16", "bfloat16"] / "mtp")), _parameters(
        drafter(releases["bf16"].path))
    assert sorted(ours) == sorted(theirs)
    assert all(_same(ours[k], theirs[k]) for k in ours)
    raw = drafter(releases["fp8"].path)
    exact, values = _values(drafter(converted["fp8", "float32"] / "mtp")), _values(raw)
    assert sorted(exact) == sorted(values) and all(np.array_equal(exact[k], values[k]) for k in exact)
    carried, theirs = _parameters(drafter(converted["fp8", "mxfp8-match-bf16"] / "mtp")), _parameters(raw)
    assert sorted(carried) == sorted(theirs) and any(k.endswith(".scales") for k in carried)
    assert all(_same(carried[k], theirs[k]) for k in carried)


DRAFTS = [("bf16", "float32", "mtp"), ("bf16", "float32", "root"), ("bf16", "q4", "mtp"), ("bf16", "q4-match", "mtp"),
          ("fp8", "q4", "mtp"), ("fp8", "q4", "root"), ("fp8", "mxfp8-match", "mtp"), ("fp8", "mxfp8-match", "root")]


@pytest.mark.parametrize("name, option, route", DRAFTS, ids=["-".join(d) for d in DRAFTS])
def test_mlx_vlm_drafts_with_the_folder_equal_to_plain_greedy(converted, name, option, route):
    from mlx_vlm.generate import generate_step
    from mlx_vlm.speculative.drafters import load_drafter

    out = converted[name, option]
    model = vlm_model(out)
    drafter, kind = load_drafter(str(out / "mtp" if route == "mtp" else out), kind="mtp")
    prompt = mx.array([IDS])
    drafted = [int(t) for t, _ in generate_step(prompt, model, None, None, max_tokens=24, temperature=0.0,
                                                 draft_model=drafter, draft_kind=kind)]
    plain = [int(t) for t, _ in generate_step(prompt, model, None, None, max_tokens=24, temperature=0.0)]
    assert drafter.draft_lens, "mlx-vlm fell back to plain decoding: the drafter did not run"
    assert drafted == plain


def test_a_head_quantized_otherwise_than_the_splitter_assumes_loads_only_from_its_drafter_folder(converted):
    """--mtp match at 4-bit affine: ``OUT/mtp`` restates the head's quantization and loads; the root route's splitter
    describes the head by module name (mxfp8 projections) and its load fails, as the runtime table says."""
    from mlx_vlm.speculative.drafters import load_drafter

    out = converted["bf16", "q4-match"]
    rows = {r.runtime: r for r in api.verify(out).runtimes}
    assert rows["mlx-vlm-drafter"].head_usable.ok and not rows["mlx-vlm"].head_usable.ok
    assert "--draft-model OUT/mtp" in rows["mlx-vlm"].head_usable.reason
    load_drafter(str(out / "mtp"), kind="mtp")
    with pytest.raises(ValueError):
        load_drafter(str(out), kind="mtp")


@pytest.mark.parametrize("name, option", [("bf16", "float32"), ("fp8", "q4")])
@pytest.mark.parametrize("depth", [1, 2])
def test_our_runtime_mtp_decode_equals_plain_greedy(converted, name, option, depth):
    """Through the family's adapter: drafts rejected (the random head), then drafts forced right at every other
    position (partial acceptance: a pass of depth + 1 tokens undone in part), and the output is plain greedy's."""
    from mtpconvert.runtime.decoding.load import load
    from mtpconvert.runtime.decoding.speculative import mtp_generate, plain_generate

    m = load(converted[name, option])
    plain, _ = plain_generate(m, IDS, 24)
    got, _ = mtp_generate(m, IDS, 24, depth=depth, check_offsets=True)
    assert got == plain
    calls = itertools.count()  # every fourth draft left to the head (wrong), the others forced right
    oracle = lambda position, draft: draft if next(calls) % 4 == 3 else mx.array([plain[position]])  # noqa: E731
    got, stats = mtp_generate(m, IDS, 24, depth=depth, draft_hook=oracle)
    assert got == plain and 0 < stats.acceptance < 1


def _tensors(folder: Path) -> dict:
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_mxfp4_experts_are_carried_as_the_source_bytes(releases, converted):
    """At 4 bits the routed experts are MLX mxfp4, their codes and scales the release's bytes, beside an affine 4-bit
    backbone (config.json's per-module entries say which); the head's (kept float) are dequantized exactly."""
    out = converted["fp8", "q4"]
    stored, raw = _tensors(out), releases["fp8"].tensors
    quant = json.loads((out / "config.json").read_text())["quantization"]
    assert {k: quant[k] for k in ("bits", "group_size", "mode")} == {"bits": 4, "group_size": 32, "mode": "affine"}
    for i in range(3):
        for proj, w in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            module = f"language_model.model.layers.{i}.ffn.switch_mlp.{proj}"
            codes = np.stack([raw[f"layers.{i}.ffn.experts.{e}.{w}.weight"].numpy() for e in range(4)])
            scales = np.stack([raw[f"layers.{i}.ffn.experts.{e}.{w}.scale"].view(torch.uint8).numpy()
                               for e in range(4)])
            assert quant[module] == {"bits": 4, "group_size": 32, "mode": "mxfp4"}
            assert stored[module + ".weight"].dtype == np.uint32 and module + ".biases" not in stored
            assert stored[module + ".weight"].tobytes() == codes.tobytes()
            assert stored[module + ".scales"].tobytes() == scales.tobytes()
    reference = _tensors(converted["fp8-dequantized", "float32"])
    head = "mtp.decoder.ffn.switch_mlp.down_proj.weight"
    assert np.array_equal(stored[head], reference[head])


@pytest.mark.parametrize("option", ["float32", "q4"])
def test_the_fp8_release_converts_to_what_its_exact_dequantization_converts_to(converted, option):
    """E8M0 FP8 matrices and MXFP4 experts dequantized exactly: every tensor of the float32 output is the dequantized
    release's; at 4 bits every tensor but the carried experts."""
    fp8, reference = _tensors(converted["fp8", option]), _tensors(converted["fp8-dequantized", option])
    carried = lambda k: option == "q4" and ".switch_mlp." in k and not k.startswith("mtp.")  # noqa: E731
    assert any(carried(k) for k in fp8) == (option == "q4")
    assert sorted(k for k in fp8 if not carried(k)) == sorted(k for k in reference if not carried(k))
    assert all(fp8[k].dtype == reference[k].dtype and np.array_equal(fp8[k], reference[k])
               for k in fp8 if not carried(k))


def test_stock_mlx_lm_refuses_the_folder_by_name(converted):
    from mlx_lm.utils import load_model

    with pytest.raises(ValueError, match="deepseek_v4"):
        load_model(converted["bf16", "float32"])


def test_families_lists_deepseek_v4():
    (family,) = [f for f in api.families() if f["family"] == "deepseek_v4"]
    assert family["backbone_library"] == "mlx-vlm" and family["backbone_modules"] == ["mlx_vlm.models.deepseek_v4"]
    assert set(family["head_runtimes"]) == {"mlx-vlm", "mlx-vlm-drafter"}
    assert family["mtp_count_key"] == "num_nextn_predict_layers" and family["head"]["hidden_state"] == "pre_hc_head"


@pytest.mark.parametrize("name, option", [("bf16", "float32"), ("fp8", "q4")])
def test_layerwise_check_predicts_what_the_loaded_model_predicts(converted, name, option):
    """The layerwise check (one block at a time, each with a fresh cache of its kind; hc_head held with the final
    norm) gives the tokens the whole model loaded gives, head and backbone."""
    from mtpconvert.runtime.decoding.load import load
    from mtpconvert.runtime.smoke.layerwise import layerwise_acceptance
    from mtpconvert.runtime.smoke.teacher_forced import teacher_forced_full

    ids = [IDS, IDS[3:10]]
    layerwise = layerwise_acceptance(converted[name, option], token_ids=ids, exact=True)
    full = teacher_forced_full(load(converted[name, option]), ids)
    assert layerwise.backbone_next == full.backbone_next
    assert layerwise.head_next == full.head_next and layerwise.head_next_without_mlp == full.head_next_without_mlp


def test_verify_accepts_sources_and_outputs_and_says_which_runtimes_use_them(releases, converted):
    for folder in (releases["bf16"].path, releases["fp8"].path, converted["bf16", "q4"], converted["fp8", "q4"]):
        report = api.verify(folder)
        assert report.ok, [f for f in report.findings if f.severity == "error"]
    assert api.verify(converted["fp8", "q4"]).mtp_complete
    rows = {r.runtime: r for r in api.verify(converted["fp8", "q4"]).runtimes}
    assert rows["mlx-vlm"].backbone_exact.ok and rows["mlx-vlm-drafter"].head_usable.ok
    assert rows["mlx-vlm"].head_usable.ok  # --draft-model OUT: a float head the splitter reads as it is
    for runtime in ("mlx-lm>=0.32", "mtplx", "rapid-mlx", "vllm-mlx"):
        assert rows[runtime].backbone_exact.ok is False and not rows[runtime].head_usable.ok
        assert "deepseek_v4" in rows[runtime].backbone_exact.reason
    raw = {r.runtime: r for r in api.verify(releases["fp8"].path).runtimes}
    assert not raw["mlx-vlm"].backbone_exact.ok and "convert it first" in raw["mlx-vlm"].backbone_exact.reason


def test_convert_gates_on_the_smoke_through_the_cli(releases, tmp_path, capsys):
    """`mtpconvert convert` of the FP8 release at 4 bits: the decoding smoke runs the head through the family's adapter
    and its output equals plain greedy (the random head's floors set to nothing)."""
    from mtpconvert.cli import run

    out = tmp_path / "cli"
    code = run(["convert", str(releases["fp8"].path), str(out), "--bits", "4", "--group-size", "32",
                "--min-acceptance", "0", "--min-mlp-gain", "-1"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "identical to plain greedy" in captured.out + captured.err


def _damaged(releases, tmp_path, edit) -> Path:
    """A copy of the FP8 release with ``edit(tensors)`` applied to its first shard."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "damaged"
    shutil.copytree(releases["fp8"].path, folder)
    shard = folder / "model-00001-of-00002.safetensors"
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k in tensors or v != shard.name}
    index["weight_map"].update({k: shard.name for k in tensors})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def _poison(key: str, byte: int):
    def edit(tensors):
        codes = tensors[key].view(torch.uint8).clone()
        codes.view(-1)[0] = byte
        tensors[key] = codes.view(torch.float8_e8m0fnu)
    return edit


BAD = {
    # E8M0 255 is NaN: met when the tensor is read (float output: dequantized; 4 bits: carried experts too)
    "fp8-nan": (_poison("layers.0.attn.wq_a.scale", 255), "layers.0.attn.wq_a.scale", "holds NaN", []),
    "mxfp4-nan": (_poison("layers.0.ffn.experts.1.w2.scale", 255), "layers.0.ffn.experts.1.w2.scale", "holds NaN",
                  ["--bits", "4"]),
    "mxfp4-shape": (lambda t: t.__setitem__("layers.2.ffn.experts.0.w1.scale", t["layers.2.ffn.experts.0.w1.scale"][:, :2].contiguous()),
                    "layers.2.ffn.experts.0.w1.scale", "MXFP4 scale of shape", []),
    "scale-on-bf16": (lambda t: t.__setitem__("layers.0.ffn.gate.scale", t["layers.0.attn.wq_a.scale"].clone()),
                      "layers.0.ffn.gate.scale", "beside a BF16 weight", []),
    "fp4-without-scale": (lambda t: t.pop("layers.1.ffn.experts.3.w3.scale"), "layers.1.ffn.experts.3.w3.weight",
                          "I8 weight without an F8_E8M0 scale", []),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_e8m0_and_mxfp4_scales_are_refused_naming_the_tensor(releases, tmp_path, capsys, case):
    from mtpconvert.cli import run

    edit, key, message, options = BAD[case]
    folder = _damaged(releases, tmp_path, edit)
    capsys.readouterr()
    code = run(["convert", str(folder), str(tmp_path / "out"), "--no-smoke", *options])
    err = capsys.readouterr().err
    assert code == 2 and f"key '{key}'" in err and message in err, err
    assert "model-00001-of-00002.safetensors" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


# --- the Hub: a streamed pull within its window, add-mtp ------------------------------------------------------------

TINY = "deepseek-ai/DeepSeek-V4-Tiny"
HUB_ARGS = ["--bits", "4", "--group-size", "32", "--no-smoke"]


@pytest.fixture()
def hub(tmp_path, monkeypatch):
    """A loopback Hub (huggingface_hub's real download code runs against it), as tests/test_hub.py sets one up."""
    from tests.hubserver import FakeHub

    with FakeHub() as h:
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
        monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "cache"))
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.setattr("huggingface_hub.constants.HF_HUB_DISABLE_XET", True)
        yield h


def test_streamed_pull_of_the_fp8_release_holds_its_window_and_writes_a_local_conversions_bytes(hub, releases,
                                                                                                tmp_path, monkeypatch):
    """--stream --raw-window on the FP8-E8M0 + MXFP4 release: no file downloaded whole; the requests are, file by
    file, each header and exactly the bytes of every tensor (weights and their E8M0 scales, the head's shard
    included), none twice; the stream runs at most the window ahead and holds under half of what it reads. The output
    is a local `convert`'s of the same source, byte for byte, MXFP4 experts carried."""
    from mtpconvert.io.header import read_header
    from tests.checkpoints import tree_digest
    from tests.test_hub import merged, pull_by_ranges, shard_digests

    src = releases["fp8"].path
    hub.add_folder(TINY, src)
    headers = {p.name: read_header(p) for p in sorted(src.glob("*.safetensors"))}
    window = min((src / n).stat().st_size for n in headers) // 2
    out = tmp_path / "pulled"
    run = pull_by_ranges(hub, monkeypatch, TINY, out, window, HUB_ARGS)
    data: dict = {}
    for r, (a, b) in zip(run.gets, run.spans()):
        data.setdefault(r.path.rsplit("/", 1)[-1], []).append((a, b + 1))
    for name, header in headers.items():
        want = merged([(0, 8), (8, header.data_start)] + [(t.start, t.end) for t in header.tensors.values()])
        assert merged(data[name]) == merged(want), name
    fetched = sum(b - a for spans in data.values() for a, b in spans)
    stubs = sum(header.data_start for header in headers.values())
    assert fetched == sum(b - a for spans in data.values() for a, b in merged(spans))  # no byte twice
    assert run.ahead <= window and run.feed.peak_bytes < (fetched - stubs) / 2, (run.ahead, run.feed.peak_bytes)
    local = api.convert(src, tmp_path / "local", ConvertOptions(quant=Q4), checks=NO_CHECKS).out
    assert shard_digests(out) == shard_digests(local) and "mtp.safetensors" in shard_digests(out)
    assert tree_digest(out / "mtp") == tree_digest(local / "mtp")
    assert json.loads((out / "config.json").read_text()) == json.loads((local / "config.json").read_text())


def test_add_mtp_grafts_the_fp8_releases_head_onto_a_headless_folder(hub, releases, tmp_path):
    """add-mtp from the release's last shard (only mtp.*: its FP8 matrices with their E8M0 scales, its MXFP4 experts)
    onto a 4-bit folder converted with --mtp drop: read by range, the head a direct `convert` writes, the smoke's
    MTP decode equal to plain greedy, the backbone's shards untouched."""
    from tests.test_hub import graft_onto_headless

    src = releases["fp8"].path
    grafted = graft_onto_headless(hub, TINY, src, src, tmp_path, ["--bits", "4", "--group-size", "32", "--dtype",
                                                                   "bfloat16", "--no-smoke"])
    assert "mtp.decoder.ffn.switch_mlp.gate_proj.weight" in grafted  # stacked, dequantized: no source format left
    assert not {dtype for dtype, _, _ in grafted.values()} & {"F8_E4M3", "F8_E8M0", "I8"}


@pytest.mark.parametrize("option", ["float32", "bfloat16", "q4", "float32-hisa"])
def test_batched_rows_equal_solo_greedy(converted, option, monkeypatch, tmp_path):
    """Batched MTP through the family's adapter (``rows.py``: sliding-window rows at their own RoPE positions, pools
    kept per row and pooled as each row completes a window): rows of different prompt lengths equal the plain
    batched engine's and their solo plain greedy decodes (mlx-vlm's own caches, one stream). The prompts and decodes
    are long enough that every row's window slides, the ratio-4 pools (compressed attention and indexer) pass
    ``index_topk`` (sparse selection) and the ratio-128 pool completes its first window while rows decode; the
    record below asserts that rows of different lengths were cut in one step past the window and back across a pool
    window's end, so the comparison covers what the rows' caches do. ``hisa``: mlx-vlm's HISA fields set to the
    fixture's scale (its hierarchical selection from 6 pools on, as the release's from 1024): a row alone selects
    hierarchically where a batch of rows of different pool counts would score them all, so the indexer runs row by
    row there (``RowsIndexer``)."""
    from mlx_vlm.models.deepseek_v4.language import Indexer

    from mtpconvert.families.deepseek_v4 import rows
    from mtpconvert.families.deepseek_v4.rows import PoolRows, WindowRows
    from mtpconvert.runtime.decoding.load import load
    from tests.checkpoints import VOCAB
    from tests.test_batched import assert_batched_rows_equal_solo

    dtype, _, variant = option.partition("-")
    folder = converted["bf16", dtype]
    if variant:
        folder = Path(shutil.copytree(folder, tmp_path / option))
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(dict(config, index_block=2, index_keep=3)))
    m = load(folder)
    args = m.backbone.args
    seen = {"ragged window cut": 0, "ragged pooling": set(), "pool window taken back": set(), "sparse": 0,
            "hierarchical": 0, "rows indexed apart": 0}
    cut_window, cut_pool, accumulate = WindowRows.trim_rows, PoolRows.trim_rows, PoolRows.accumulate_windows
    hierarchical, one_row = Indexer._hisa_select, rows._OneRowPools.__init__

    def window_trim(self, n):
        if len(set(n)) > 1 and min(self.lengths) > args.sliding_window:
            seen["ragged window cut"] += 1
        cut_window(self, n)

    def pool_trim(self, n):
        if any((length - x) // self.ratio < length // self.ratio for length, x in zip(self.lengths, n)):
            seen["pool window taken back"].add(self.ratio)
        cut_pool(self, n)

    def pool_accumulate(self, kv, gate, offset):
        out = accumulate(self, kv, gate, offset)
        if out[0].shape[1] and len(set(self.lengths)) > 1:
            seen["ragged pooling"].add(self.ratio)
        seen["sparse"] += self.ratio == 4 and max(self.counts) > args.index_topk
        return out

    def hisa(self, *a):
        seen["hierarchical"] += 1
        return hierarchical(self, *a)

    def row_apart(self, *a):
        seen["rows indexed apart"] += 1
        one_row(self, *a)

    monkeypatch.setattr(WindowRows, "trim_rows", window_trim)
    monkeypatch.setattr(PoolRows, "trim_rows", pool_trim)
    monkeypatch.setattr(PoolRows, "accumulate_windows", pool_accumulate)
    monkeypatch.setattr(Indexer, "_hisa_select", hisa)
    monkeypatch.setattr(rows._OneRowPools, "__init__", row_apart)
    # one short prompt (a prefill of single-token passes), the others ending up to 28 tokens before the first
    # ratio-128 window closes
    lengths = [100, 121, 6, 113, 126, 118]
    prompts = [[(7 * i + 3 * j + 1) % VOCAB for i in range(n)] for j, n in enumerate(lengths)]
    assert_batched_rows_equal_solo(m, prompts, monkeypatch)
    assert seen["ragged window cut"] and seen["sparse"], seen
    assert seen["ragged pooling"] == seen["pool window taken back"] == {4, 128}, seen
    assert bool(seen["hierarchical"]) == bool(seen["rows indexed apart"]) == bool(variant), seen


def test_bench_concurrency_is_refused_naming_its_baseline(converted):
    """The batched bench divides by mlx-lm's BatchGenerator, which cannot run an mlx-vlm model: refused before
    loading, naming the baseline (batched MTP itself runs it: the test above)."""
    from mtpconvert.errors import OptionsError
    from mtpconvert.options import BenchOptions

    with pytest.raises(OptionsError, match=r"--concurrency: the batched bench's baseline, mlx-lm's BatchGenerator, "
                                           r"does not run the deepseek_v4 backbone \(mlx-vlm's model\)"):
        api.bench(converted["bf16", "float32"], BenchOptions(concurrency=(1, 2), max_tokens=4))
