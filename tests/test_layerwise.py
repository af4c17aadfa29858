"""The layer-by-layer acceptance check: the same predictions as the loaded model, broken heads
fall, and only one layer's weights are resident at a time."""

import gc
import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from mtpconvert.demo import fixture_prompts
from mtpconvert.errors import LayoutError
from mtpconvert.fixture import fixture_path
from mtpconvert.runtime.smoke import compute
from mtpconvert.runtime.smoke.layerwise import layerwise_acceptance
from mtpconvert.runtime.smoke.sizing import folder_weight_bytes, smoke_mode, stored_bytes_by_unit
from mtpconvert.runtime.smoke.decode import encode_prompts
from mtpconvert.runtime.smoke.floors import LAYERWISE_MIN_ACCEPTANCE
from mtpconvert.runtime.smoke.teacher_forced import teacher_forced_full
from mtpconvert.runtime.decoding.load import load
from mtpconvert.runtime.decoding.locate import locate_mtp

VARIANTS = {  # name: (fixture, convert options)
    "dense-f32": ("dense", ["--dtype", "float32"]),
    "dense-q4": ("dense", ["--bits", "4", "--group-size", "32"]),  # MTP kept in bf16
    "moe-f32": ("moe", ["--dtype", "float32"]),
    "moe-q4": ("moe", ["--bits", "4", "--group-size", "32"]),  # bf16 MTP experts: cast to f32 on the CPU
    "moe-q4-match": ("moe", ["--bits", "4", "--group-size", "32", "--mtp", "match"]),
    "moe-bf16": ("moe", []),  # float experts: both sides hold them in float32 on the CPU
}


def convert(out: Path, variant: str, *extra: str) -> Path:
    fixture, opts = VARIANTS[variant]
    cmd = [sys.executable, "-m", "mtpconvert", "convert", str(fixture_path(fixture)), str(out), "--no-smoke",
           *opts, *extra]
    subprocess.run(cmd, check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("layerwise")
    cache = {}

    def get(variant):
        if variant not in cache:
            cache[variant] = convert(root / variant, variant)
        return cache[variant]

    return get


def token_ids(path, n=4, length=40):
    return encode_prompts(path, fixture_prompts(n, length=length))


def reference(path, ids, hidden="post-norm"):
    m = load(path)  # float experts already in float32 on the CPU (gather_mm is float32-only)
    r = teacher_forced_full(m, ids, hidden)
    del m
    gc.collect()
    return r


def rewrite(src: Path, dst: Path, fn, config_fn=None) -> Path:
    """A copy of a converted folder with its tensors (shards and MTP sidecar) and config changed."""
    shutil.copytree(src, dst)
    for f in glob.glob(str(dst / "model*.safetensors")) + glob.glob(str(dst / "mtp.safetensors")):
        mx.save_safetensors(f, fn(dict(mx.load(f))), metadata={"format": "mlx"})
    if (dst / "mtp" / "weights.safetensors").exists():  # the link vllm-mlx reads: the same bytes, as convert writes it
        (dst / "mtp" / "weights.safetensors").unlink()
        os.link(dst / "mtp.safetensors", dst / "mtp" / "weights.safetensors")
    index = dst / "model.safetensors.index.json"
    if index.exists():
        idx = json.loads(index.read_text())
        keys = set()
        for f in glob.glob(str(dst / "model*.safetensors")):
            keys |= set(mx.load(f))
        idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if k in keys}
        index.write_text(json.dumps(idx, indent=2))
    if config_fn:
        cfg = dst / "config.json"
        cfg.write_text(json.dumps(config_fn(json.loads(cfg.read_text())), indent=2))
    return dst


# ---------------------------------------------------------------------------------------------
# exactness


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_layerwise_predictions_equal_the_loaded_model(folders, variant):
    path = folders(variant)
    ids = token_ids(path)
    # 4 KiB vocabulary blocks: lm_head is read in many blocks (512 rows in all)
    lw = layerwise_acceptance(path, token_ids=ids, exact=True, vocab_block_bytes=4096)
    ref = reference(path, ids)
    assert lw.backbone_next == ref.backbone_next
    assert lw.head_next == ref.head_next
    assert lw.head_next_without_mlp == ref.head_next_without_mlp  # the MLP gain's second pass, too
    assert lw.acceptance == ref.acceptance and lw.compared == sum(len(i) - 1 for i in ids)
    assert lw.acceptance >= 0.9 and lw.ok  # a correct head on the fixture: ~97-99% teacher-forced
    assert lw.head_source == "sidecar"


def test_pre_norm_hidden_equals_the_loaded_model(folders):
    path = folders("dense-q4")
    ids = token_ids(path, n=2)
    lw = layerwise_acceptance(path, token_ids=ids, exact=True, hidden="pre-norm")
    ref = reference(path, ids, hidden="pre-norm")
    assert (lw.backbone_next, lw.head_next) == (ref.backbone_next, ref.head_next)


@pytest.mark.parametrize("quantized", [False, True])
def test_tied_embeddings_equal_the_loaded_model(folders, tmp_path, quantized):
    """lm_head dropped, tie_word_embeddings on: logits through the (quantized) embedding's as_linear."""
    src = folders("dense-q4" if quantized else "dense-f32")

    def tie(cfg):
        cfg["tie_word_embeddings"] = True
        cfg.get("text_config", cfg)["tie_word_embeddings"] = True
        return cfg

    path = rewrite(src, tmp_path / "tied", lambda w: {k: v for k, v in w.items() if "lm_head" not in k}, tie)
    ids = token_ids(path, n=2)
    lw = layerwise_acceptance(path, token_ids=ids, exact=True, vocab_block_bytes=4096)
    ref = reference(path, ids)
    assert (lw.backbone_next, lw.head_next) == (ref.backbone_next, ref.head_next)


@pytest.mark.parametrize("variant", ["dense-q4", "moe-q4"])
@pytest.mark.parametrize("dtype", [None, "float32"])
def test_dequantized_cpu_path_agrees_with_exact(folders, monkeypatch, variant, dtype):
    """exact=False (the CPU default): float matmuls of the dequantized weights, a block of rows at
    a time (16-row blocks here), same predictions up to rounding."""
    monkeypatch.setattr(compute, "LINEAR_BLOCK_BYTES", 16 * 96 * 4)
    path = folders(variant)
    ids = token_ids(path)
    exact = layerwise_acceptance(path, token_ids=ids, exact=True)
    fast = layerwise_acceptance(path, token_ids=ids, exact=False, compute_dtype=dtype, vocab_block_bytes=4096)
    assert fast.compute_dtype == (dtype or fast.compute_dtype) and not fast.exact
    pairs = [(a, b) for x, y in zip(exact.head_next + exact.backbone_next, fast.head_next + fast.backbone_next)
             for a, b in zip(x, y)]
    assert sum(a == b for a, b in pairs) >= 0.97 * len(pairs)
    assert abs(exact.acceptance - fast.acceptance) <= 0.03


def test_in_model_head_gives_the_same_numbers(folders, tmp_path):
    """The head inside the shards (--mtp-layout in-model, per-expert float experts): same predictions."""
    src = folders("moe-q4")
    path = convert(tmp_path / "in-model", "moe-q4", "--mtp-layout", "in-model")
    assert locate_mtp(path).source == "in-model" and locate_mtp(src).source == "sidecar"
    ids = token_ids(path, n=2)
    a = layerwise_acceptance(path, token_ids=ids, exact=True)
    b = layerwise_acceptance(src, token_ids=ids, exact=True)
    assert a.head_source == "in-model"
    assert (a.backbone_next, a.head_next) == (b.backbone_next, b.head_next)


def test_no_head_is_an_error(tmp_path):
    path = convert(tmp_path / "dropped", "dense-f32", "--mtp", "drop")
    assert locate_mtp(path) is None
    with pytest.raises(LayoutError, match="no MTP head"):
        layerwise_acceptance(path, token_ids=[[1, 2, 3]])


# ---------------------------------------------------------------------------------------------
# broken heads


def _swap_fc_halves(w):
    """The head's concat order reversed ([hidden, embedding] instead of [embedding, hidden])."""
    return {k: (mx.concatenate([v[:, v.shape[1] // 2:], v[:, :v.shape[1] // 2]], axis=1)
                if k.endswith("mtp.fc.weight") else v) for k, v in w.items()}


_NORMS = ("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight", "mtp.norm.weight",
          "pre_fc_norm_hidden.weight", "pre_fc_norm_embedding.weight")


def _unshift_all_norms(w):
    """The zero-centred RMSNorm +1 never applied."""
    return {k: (v - 1 if k.endswith(_NORMS) else v) for k, v in w.items()}


def _unshift_head_norms(w):
    return {k: (v - 1 if k.startswith(("mtp.", "language_model.mtp.")) and k.endswith("norm.weight") else v)
            for k, v in w.items()}


def _reverse_experts(w):
    return {k: (v[::-1] if ".switch_mlp." in k else v) for k, v in w.items()}


@pytest.mark.parametrize("variant,breakage", [("dense-f32", _swap_fc_halves), ("dense-q4", _unshift_all_norms),
                                              ("moe-f32", _swap_fc_halves), ("moe-q4", _unshift_all_norms)])
def test_broken_head_collapses(folders, tmp_path, variant, breakage):
    path = rewrite(folders(variant), tmp_path / "broken", breakage)
    r = layerwise_acceptance(path, token_ids=token_ids(path))
    print(variant, breakage.__name__, r.acceptance)
    assert r.acceptance < 0.1 and not r.ok  # measured 0-4%


@pytest.mark.parametrize("variant,breakage", [("dense-q4", _unshift_head_norms), ("moe-f32", _reverse_experts)])
def test_partly_broken_head_drops_and_still_matches_the_loaded_model(folders, tmp_path, variant, breakage):
    """Breakages the fixture's easy language partly forgives (~47-61% against ~98%): still far below
    the correct head, and still the loaded model's numbers exactly."""
    good = folders(variant)
    path = rewrite(good, tmp_path / "broken", breakage)
    ids = token_ids(path)
    bad = layerwise_acceptance(path, token_ids=ids, exact=True)
    ref = reference(path, ids)
    assert (bad.backbone_next, bad.head_next) == (ref.backbone_next, ref.head_next)
    assert bad.acceptance <= layerwise_acceptance(good, token_ids=ids).acceptance - 0.3


# ---------------------------------------------------------------------------------------------
# memory


def _synthetic_folder(root: Path, layers=12, hidden=256, intermediate=1024, vocab=8192) -> Path:
    """A converted-layout float32 folder ~15x larger than one decoder layer (random weights,
    norms at 1), from mlx-lm's own model class and our MTP head, written in 4 shards."""
    from mlx.utils import tree_flatten
    from mlx_lm.models.qwen3_5 import Model, ModelArgs

    from mtpconvert.families import QWEN3_5

    src = fixture_path("dense")
    cfg = json.loads((src / "config.json").read_text())
    tc = cfg["text_config"]
    tc.update(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers, vocab_size=vocab,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_value_heads=4,
              linear_num_key_heads=2, linear_key_head_dim=64, linear_value_head_dim=64,
              layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)])
    mx.random.seed(0)
    model = Model(ModelArgs.from_dict(cfg))
    head = QWEN3_5.backbone_class()(model, QWEN3_5, cfg).make_head(1)
    tensors = dict(tree_flatten(model.parameters()))
    tensors.update({"language_model.mtp." + k: v for k, v in tree_flatten(head.parameters())})
    tensors = {k: (v * 0.05 if v.ndim > 1 else v).astype(mx.float32) for k, v in tensors.items()}
    out = root / "synthetic"
    out.mkdir()
    keys = sorted(tensors)
    for i in range(4):
        part = {k: tensors[k] for k in keys[i::4]}
        mx.eval(part)
        mx.save_safetensors(str(out / f"model-{i + 1:05d}-of-00004.safetensors"), part, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, out / f)
    del model, head, tensors, part
    gc.collect()
    mx.clear_cache()
    return out


def test_peak_memory_is_one_layer_not_the_model(tmp_path):
    path = _synthetic_folder(tmp_path)
    model_bytes = sum(Path(f).stat().st_size for f in glob.glob(str(path / "model*.safetensors")))
    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    r = layerwise_acceptance(path, token_ids=token_ids(path, n=4, length=60), exact=True,
                             vocab_block_bytes=1 << 20)
    peak = r.peak_mlx_bytes - base
    layer_bytes = max(b for name, b in r.stages if name.startswith(("layer", "mtp")))
    print(f"model {model_bytes >> 10} KiB, largest layer {layer_bytes >> 10} KiB, peak {peak >> 10} KiB, "
          f"read {r.read_bytes >> 10} KiB")
    assert model_bytes > 12 * layer_bytes
    # one layer, its temporaries and the activations; loading the model would need > 12 layers
    assert peak < 3 * layer_bytes < model_bytes / 4
    # every weight byte is read once (embedding rows and lm_head blocks: only what is used)
    assert r.read_bytes <= model_bytes
    assert r.largest_stage_bytes == layer_bytes


# ---------------------------------------------------------------------------------------------
# the full-or-layerwise decision


def test_smoke_mode():
    gib = 1 << 30
    assert smoke_mode(4 * gib, 16 * gib) == "full"
    assert smoke_mode(14 * gib, 16 * gib) == "layerwise"  # 27B at 4 bits on a 16 GB runner
    assert smoke_mode(4 * gib, 16 * gib, full_runs_here=False) == "layerwise"
    assert smoke_mode(4 * gib, None) == "layerwise"
    assert LAYERWISE_MIN_ACCEPTANCE == 0.30


def test_stored_bytes_by_unit(folders):
    path = folders("moe-q4")
    units = stored_bytes_by_unit(path)
    assert {"embed_tokens", "lm_head", "mtp", "layer 0", "layer 3"} <= set(units)
    assert units["mtp"] == locate_mtp(path).nbytes
    assert sum(units.values()) < folder_weight_bytes(path)  # the rest is headers
