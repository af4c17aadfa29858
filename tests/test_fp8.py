"""Block-FP8 sources (issue #27) converted end to end: exact against an independent dequantization, planned
visibly, equal to transformers' own FP8 loading, refused cleanly when their scales are bad, and as good at MTP
drafting as the BF16 release they were made from.

The FP8 twins and the reference decoding come from ``tests/fp8.py``, which shares no code with the converter.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from tests import fp8
from tests.checkpoints import convert_folder, without_shift
from tests.test_parity import FP32_ATOL, IDS, mlx_logits
from mtpconvert import api
from mtpconvert.cli import run
from mtpconvert.execute import execute
from mtpconvert.execute import pipeline
from mtpconvert.execute.blocks import is_fp8, item_blocks
from mtpconvert.execute.resume import RESUME_DIR
from mtpconvert.fixture.text import TEXT_DENSE, heldout_prompts, text_fixture_path
from mtpconvert.io.checkpoint import open_checkpoint
from mtpconvert.io.shard_writer import shard_digest
from mtpconvert.options import ConvertOptions, ExecuteOptions, QuantOptions
from mtpconvert.plan import build_plan
from mtpconvert.plan.steps import ShiftNorm
from mtpconvert.runtime.decoding.load import load
from mtpconvert.verify import verify

DEQUANT = "dequant:fp8e4m3/128"


def files_digest(folder: Path) -> dict:
    """sha256 of every file under ``folder`` (the sidecar ``mtp.safetensors`` and ``mtp/`` included), by path."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# --- 1. exactness: the twin converts to the bytes its independently dequantized source converts to ------------------

TWINS = {
    # name: (raw_checkpoints layout or a folder, fp8_twin kwargs)
    "dense-vlm": ("dense-vlm", {}),  # hidden 64: every block partial; in_proj_qkv's 192 rows span two row blocks
    "moe-fp8-head": ("moe-per-expert", {}),
    "moe-bf16-head": ("moe-fused", dict(head_fp8=False, a_log_f32=True)),  # fused source: the twin is per expert
    "text-dense": (TEXT_DENSE, dict(a_log_f32=True)),  # hidden 192: partial columns, up to four 128-row blocks
}
OPTIONS = {"bf16": dict(dtype="bfloat16"), "q4": dict(bits=4), "mxfp8": dict(bits=8, mode="mxfp8")}
MOE_OPTIONS = {"q4-mtp-match": dict(bits=4, mtp="match"), "q4-mtp8": dict(bits=4, mtp_bits=8)}
EXACT_CASES = [(name, opt) for name in TWINS for opt in
               list(OPTIONS) + (list(MOE_OPTIONS) if name.startswith("moe") else [])]


@pytest.fixture(scope="module")
def twins(raw_checkpoints, tmp_path_factory):
    """name -> (FP8 twin, its dequantized raw reference), each built on first use."""
    root = tmp_path_factory.mktemp("fp8")

    @functools.cache
    def get(name):
        source, kw = TWINS[name]
        twin = fp8.fp8_twin(raw_checkpoints(source).path if isinstance(source, str) else source, root / name, **kw)
        keys = fp8.fp8_keys(twin)
        assert keys and any(k.startswith("mtp.") for k in keys) == kw.get("head_fp8", True)
        return twin, fp8.dequantized_twin(twin, root / f"{name}-reference")

    return get


@pytest.fixture(scope="module")
def reference_outputs(twins, tmp_path_factory):
    """(name, option) -> the digest of the reference's conversion (the plain path: no FP8 anywhere)."""
    root = tmp_path_factory.mktemp("fp8ref")

    @functools.cache
    def get(name, opt):
        convert_folder(twins(name)[1], root / f"{name}-{opt}", **{**OPTIONS, **MOE_OPTIONS}[opt])
        return files_digest(root / f"{name}-{opt}")

    return get


@pytest.mark.parametrize("name,opt", EXACT_CASES, ids=[f"{n}-{o}" for n, o in EXACT_CASES])
def test_twin_converts_to_the_bytes_of_its_dequantized_source(twins, reference_outputs, tmp_path, name, opt):
    twin, _ = twins(name)
    convert_folder(twin, tmp_path / "out", **{**OPTIONS, **MOE_OPTIONS}[opt])
    got, want = files_digest(tmp_path / "out"), reference_outputs(name, opt)
    assert "mtp.safetensors" in got and "config.json" in got and "model.safetensors.index.json" in got
    assert got == want, sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))


ROW_CASES = [("text-dense", "bf16"), ("text-dense", "q4"), ("text-dense", "mxfp8"), ("moe-fp8-head", "q4-mtp8"),
             ("moe-fp8-head", "mxfp8"), ("moe-bf16-head", "q4")]
ROW_BLOCK_BYTES = 24 << 10  # cuts every FP8 matrix of the text fixture into 128-row blocks


@pytest.mark.parametrize("name,opt", ROW_CASES, ids=[f"{n}-{o}" for n, o in ROW_CASES])
def test_row_blocks_and_numpy_workers_read_fp8_the_same(twins, reference_outputs, tmp_path, monkeypatch, name, opt):
    """Every FP8 reader on FP8 matrices cut into 128-row blocks, each block with its own scale rows: on a CPU, float
    targets dequantized on the reader threads, mxfp8 through MLX's path, affine quantization in npquant's worker
    processes (forced here, below its size threshold)."""
    twin, _ = twins(name)
    quant = {**OPTIONS, **MOE_OPTIONS}[opt]
    affine = "bits" in quant and "mode" not in quant
    ckpt = open_checkpoint(twin)
    plan = build_plan(ckpt, ConvertOptions(dtype=quant.get("dtype"), quant=QuantOptions(
        **{k: v for k, v in quant.items() if k != "dtype"})))
    split = [it for it in plan.items if is_fp8(it) and len(item_blocks(it, ROW_BLOCK_BYTES)) > 1]
    made = {"fp8 blocks in numpy": 0}
    if affine:
        monkeypatch.setattr(pipeline, "NUMPY_MIN_BYTES", 0)
        real = pipeline.numpy_outputs

        def counted(block, arrays):
            made["fp8 blocks in numpy"] += is_fp8(block.item)
            return real(block, arrays)

        monkeypatch.setattr(pipeline, "numpy_outputs", counted)
    execute(plan, ckpt, tmp_path / "out", ExecuteOptions(block_bytes=ROW_BLOCK_BYTES, workers=2))
    assert files_digest(tmp_path / "out") == reference_outputs(name, opt)
    assert split and (name != "text-dense" or any(len(it.sources[0].shape) == 2 for it in split))
    assert affine == (made["fp8 blocks in numpy"] > 0), made


# --- 2. the plan ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dense-vlm", "moe-bf16-head"])
def test_dry_run_plans_dequantization_on_exactly_the_fp8_tensors(twins, tmp_path, capsys, name):
    twin, _ = twins(name)
    wanted = set(fp8.fp8_keys(twin))
    assert run(["convert", str(twin), str(tmp_path / "out"), "--bits", "4", "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert not (tmp_path / "out").exists()
    planned = set()
    for t in plan["tensors"]:
        fp8_sources = [s for s in t["sources"] if s in wanted]
        if fp8_sources:
            assert fp8_sources == t["sources"], t  # never FP8 and plain sources in one tensor
            assert t["steps"][0] == DEQUANT and t["steps"].count(DEQUANT) == 1, t
            assert t["scales"] == [s + "_scale_inv" for s in t["sources"]], t
            planned.update(fp8_sources)
        else:
            assert DEQUANT not in t["steps"] and "scales" not in t, t
    assert planned == wanted  # every FP8 weight is converted, with its own scale
    assert not any(d["key"] in wanted for d in plan["dropped"])

    for options, quantized in ((ConvertOptions(), False), (ConvertOptions(quant=QuantOptions(bits=4)), True)):
        config = api.plan(twin, options).config
        assert "quantization_config" not in config["text_config"]
        if quantized:  # mlx-lm's own block, under both names; nothing left of the FP8 one
            assert config["quantization_config"] == config["quantization"]
            assert "quant_method" not in config["quantization"]
        else:
            assert "quantization_config" not in config and "quantization" not in config


# --- 3. transformers' FP8 loading -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def aligned_twins(tmp_path_factory):
    """kind -> the FP8 twin of a 128-aligned checkpoint with per-expert experts (what transformers reads right)."""
    root = tmp_path_factory.mktemp("fp8aligned")
    return functools.cache(lambda kind: fp8.fp8_twin(fp8.build_aligned(root / kind, moe=kind == "moe", seed=11),
                                                     root / f"{kind}-fp8"))


def double_shift(plan) -> None:
    """An ``edit``: the +1 applied twice."""
    for it in plan.items:
        if any(isinstance(s, ShiftNorm) for s in it.steps):
            i = next(i for i, s in enumerate(it.steps) if isinstance(s, ShiftNorm))
            it.steps = it.steps[:i] + (ShiftNorm(),) + it.steps[i:]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_float32_conversion_matches_transformers_fp8_loading(aligned_twins, tmp_path, kind):
    twin = aligned_twins(kind)
    ref = fp8.transformers_logits(twin, IDS)[0]
    convert_folder(twin, tmp_path / "out", dtype="float32")
    got = mlx_logits(tmp_path / "out", IDS)
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, atol=FP32_ATOL, rtol=1e-3)
    report = verify(tmp_path / "out")
    assert report.ok and report.norms == {"backbone": "shifted", "mtp": "shifted"}, report.to_json()
    if kind == "moe":
        return
    # the +1 exactly once: without it or twice the logits are far off, and verify says which
    for edit, state in ((without_shift(), "zero-centred"), (double_shift, "double-shifted")):
        out = tmp_path / state
        convert_folder(twin, out, dtype="float32", edit=edit)
        assert np.abs(mlx_logits(out, IDS) - ref).max() > 100 * FP32_ATOL, state
        assert verify(out).norms["backbone"] == state


# --- 4. bad scales ----------------------------------------------------------------------------------------------------

DAMAGE = {
    # case: (damage(folder) -> weight key, the key the error names: "weight" or "scale", checked at plan time)
    "removed": (lambda d: fp8.remove_scale(d), "weight", True),
    "reshaped": (lambda d: fp8.reshape_scale(d), "scale", True),
    "retyped": (lambda d: fp8.retype_scale(d), "scale", True),
    # the backbone's first FP8 weight: its shard is written after the head's sidecar
    "inf": (lambda d: fp8.poison_scale(d, value=float("inf")), "scale", False),
    # the head's last one: found in the first shard written
    "nan": (lambda d: fp8.poison_scale(d, fp8.fp8_keys(d)[-1], value=float("nan")), "scale", False),
}


# how each is converted: a NaN/Inf scale is met by whichever path reads its tensor; on a CPU float targets are
# dequantized on the reader threads, mxfp8 through MLX's path, affine bits in npquant's workers (whose non-finite
# scales go back to MLX's path)
PATHS = {"float": [], "mxfp8": ["--bits", "8", "--q-mode", "mxfp8", "--mtp", "match"],
         "q4-workers": ["--bits", "4", "--mtp", "match"]}
BAD_CASES = [(case, path) for case, (_, _, at_plan) in DAMAGE.items() for path in (["float"] if at_plan else PATHS)]


@pytest.mark.parametrize("case,path", BAD_CASES, ids=[f"{c}-{p}" for c, p in BAD_CASES])
def test_bad_scales_are_refused_naming_the_tensor(twins, tmp_path, capsys, monkeypatch, case, path):
    damage, named, at_plan = DAMAGE[case]
    twin = tmp_path / "twin"
    shutil.copytree(twins("dense-vlm")[0], twin)
    weight = damage(twin)
    key = weight if named == "weight" else weight[: -len("weight")] + fp8.SCALE
    file = twin / json.loads((twin / "model.safetensors.index.json").read_text())["weight_map"][weight]
    before = files_digest(twin)
    capsys.readouterr()

    out = tmp_path / "out"
    if path == "q4-workers":
        monkeypatch.setattr(pipeline, "NUMPY_MIN_BYTES", 0)
    code = run(["convert", str(twin), str(out), *PATHS[path]])
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert f"key '{key}'" in captured.err and f"file {file}" in captured.err, captured.err
    assert "Traceback" not in captured.err + captured.out
    assert not out.exists()
    partial = tmp_path / ".out.partial"
    if partial.exists():  # only where a shard was finished before the bad tensor's: kept for --resume (reliability.md)
        assert not at_plan and "resume with:" in captured.err
        records = {p.name[: -len(".json")]: json.loads(p.read_text()) for p in (partial / RESUME_DIR).glob("*.json")}
        assert records and not (partial / "model.safetensors.index.json").exists()  # nothing claims to be a model
        assert "model-00001-of-00001.safetensors" not in records  # the shard that holds the bad tensor
        for shard, record in records.items():  # what is kept is whole and checked on resume
            assert shard_digest(partial / shard) == record["sha256"]
    assert files_digest(twin) == before

    code = run(["verify", str(twin), "--json"])
    findings = json.loads(capsys.readouterr().out)["findings"]
    if at_plan:
        assert code == 1 and [(f["code"], f["key"], f["file"]) for f in findings] == [("fp8-scale", key, str(file))]
    else:  # a header check passes a finite-looking scale; --deep reads the data and names it
        assert code == 0 and findings == []
        code = run(["verify", str(twin), "--json", "--deep"])
        findings = json.loads(capsys.readouterr().out)["findings"]
        assert code == 1 and [(f["code"], f["key"], f["file"]) for f in findings] == [("non-finite", key, str(file))]
    assert files_digest(twin) == before


# --- 5. MTP draft acceptance on the trained text fixtures -------------------------------------------------------------

PROMPT_TOKENS, NEW_TOKENS, PER_FILE = 32, 64, 3  # 36 prompts: 2304 drafted positions
MAX_DROP = 0.03


def greedy_continuations(m, prompts, n: int) -> np.ndarray:
    """[prompts, prompt + n] tokens: plain greedy decoding of every prompt (same length) at once."""
    cache = m.model.make_cache()
    tok = mx.argmax(m.model(mx.array(prompts), cache=cache)[:, -1], axis=-1)
    out = [tok]
    for _ in range(n - 1):
        tok = mx.argmax(m.model(tok[:, None], cache=cache)[:, -1], axis=-1)
        out.append(tok)
    return np.concatenate([np.array(prompts), np.stack([np.array(t) for t in out], axis=1)], axis=1)


def drafts_and_targets(m, sequences: np.ndarray, start: int):
    """Teacher-forced over ``sequences``: at every position t >= start - 1 whose token t+1 was generated, the head's
    draft of token t+2 (from h_t and token t+1) and the backbone's own choice of it (its argmax at t+1). Greedy
    depth-1 MTP decoding accepts exactly the drafts that equal the backbone's choice."""
    tokens = mx.array(sequences)
    _, h = m.backbone.forward(tokens, m.backbone.make_cache())
    h = h[:, start - 1:]
    states = m.head(h[:, :-1], m.embed(tokens[:, start:]), m.head.make_cache())
    return np.array(mx.argmax(m.logits(states), axis=-1)), np.array(mx.argmax(m.logits(h[:, 1:]), axis=-1))


@pytest.fixture(scope="module")
def acceptance(tmp_path_factory):
    """(variant, precision) -> {"bf16"|"fp8": (drafts, targets)} on one text per variant: the BF16 release's own
    greedy continuations of held-out prompts, so both conversions are judged position by position on the same
    tokens. Decoding each with its own greedy text (``mtp_generate``) mostly measures which text each happened to
    write: on 24 prompts x 64 tokens the same BF16 weights accept 69.3% computed in bfloat16 and 65.1% in float32."""
    root = tmp_path_factory.mktemp("fp8accept")
    twin = functools.cache(lambda variant: fp8.fp8_twin(text_fixture_path(variant), root / variant, a_log_f32=True))

    @functools.cache
    def model(variant, precision, name):
        src = twin(variant) if name == "fp8" else text_fixture_path(variant)
        convert_folder(src, root / f"{variant}-{precision}-{name}", dtype="float32",
                       **({"bits": 4} if precision == "q4" else {}))
        return load(root / f"{variant}-{precision}-{name}")

    @functools.cache
    def text(variant):
        _, prompts, _ = heldout_prompts(text_fixture_path(variant), per_file=PER_FILE, prompt_tokens=PROMPT_TOKENS)
        assert all(len(p) >= PROMPT_TOKENS for p in prompts)
        return greedy_continuations(model(variant, "float", "bf16"), [p[-PROMPT_TOKENS:] for p in prompts], NEW_TOKENS)

    return functools.cache(lambda variant, precision: {name: drafts_and_targets(
        model(variant, precision, name), text(variant), PROMPT_TOKENS) for name in ("bf16", "fp8")})


@pytest.mark.slow  # ~110 s over its four cases (make test-all); the FP8 bytes are asserted exact elsewhere
@pytest.mark.parametrize("variant,precision", [("dense", "float"), ("dense", "q4"), ("moe", "float"), ("moe", "q4")])
def test_fp8_release_drafts_as_well_as_the_bf16_one(acceptance, variant, precision):
    got = acceptance(variant, precision)
    (bf_drafts, bf_targets), (f8_drafts, f8_targets) = got["bf16"], got["fp8"]
    bf_hits, f8_hits = bf_drafts == bf_targets, f8_drafts == f8_targets
    bf16, fp8_ = bf_hits.mean(), f8_hits.mean()
    per_prompt = (f8_hits.astype(float) - bf_hits).mean(axis=1)  # paired, the prompt as the unit
    boots = np.random.default_rng(0).choice(per_prompt, (2000, len(per_prompt))).mean(axis=1)
    print(f"{variant} {precision}: acceptance bf16 {bf16:.1%} fp8 {fp8_:.1%} ({100 * (fp8_ - bf16):+.2f} points, 95% "
          f"[{100 * np.percentile(boots, 2.5):+.2f}, {100 * np.percentile(boots, 97.5):+.2f}]) over {bf_hits.size} "
          f"positions; fp8's backbone picks bf16's token at {(f8_targets == bf_targets).mean():.1%}")
    assert bf_hits.size >= 2000 and 0.55 <= bf16 <= 0.9  # enough positions; a realistic head
    assert (f8_targets == bf_targets).mean() >= 0.8  # the same model, within FP8 noise
    assert abs(fp8_ - bf16) <= MAX_DROP, (bf16, fp8_)
