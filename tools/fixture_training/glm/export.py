"""GLM-5's export (the raw release layout, acceptance, mlx-lm against transformers, training.json and README.md)
and parity (a folder re-checked)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from tools.fixture_training.folders import (checkpoint_step, load_checkpoint, load_folder, load_into, logged_at,
                                            loading_problems, parity_ids, provenance, readme_method, write_shards,
                                            write_tokenizer_and_generation)
from tools.fixture_training.glm.acceptance import acceptance_glm
from tools.fixture_training.glm.model import (F32_SUFFIXES, FIXTURE, GLM_SHAPE, SHARDS, build_torch_glm,
                                              expected_keys, fused_names, glm_config, nextn_prefix, raw_names,
                                              shape_of, split_state)
from tools.fixture_training.glm.train import set_threads

SCRIPT = "tools/fixture_training/glm"  # training.json's "script": python -m tools.fixture_training.glm


# ---------------------------------------------------------------------------------------------
# mlx-lm against transformers (float32)
# ---------------------------------------------------------------------------------------------
def mlx_lm_parity(folder: Path, hf, ids: np.ndarray, prefill: int = 16) -> dict:
    """mlx-lm's ``load_model`` (strict; it drops layer N itself) on the folder, float32, against transformers' logits.

    ``full``: one forward over the ids. ``incremental``: ``prefill`` ids, then one id at a time through mlx-lm's
    cache (the absorbed-MLA decode path) against the same rows of transformers' full forward.
    """
    import mlx.core as mx
    import torch
    from mlx.utils import tree_map
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    import mlx_lm

    model, _ = load_model(Path(folder), strict=True)
    model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    with torch.no_grad():
        ref = hf(input_ids=torch.from_numpy(ids.astype(np.int64))[None], use_cache=False).logits[0].float().numpy()
    full = np.array(model(mx.array(ids[None].astype(np.int32)))[0])
    cache = make_prompt_cache(model)
    rows = [np.array(model(mx.array(ids[None, :prefill].astype(np.int32)), cache=cache)[0])]
    for i in range(prefill, ids.size):
        rows.append(np.array(model(mx.array(ids[None, i: i + 1].astype(np.int32)), cache=cache)[0]))
    inc = np.concatenate(rows)
    return {"mlx_lm": mlx_lm.__version__, "tokens": int(ids.size), "logit_scale": round(float(np.abs(ref).max()), 2),
            "full_max_abs_diff": float(f"{np.abs(full - ref).max():.3g}"),
            "incremental_max_abs_diff": float(f"{np.abs(inc - ref).max():.3g}"),
            "argmax_agreement": round(float((full.argmax(-1) == ref.argmax(-1)).mean()), 4),
            "method": mlx_lm_parity.__doc__.split("\n\n", 1)[1].strip()}


# ---------------------------------------------------------------------------------------------
# export and parity
# ---------------------------------------------------------------------------------------------
def check_folder(folder: Path, cfg: dict) -> dict:
    """The folder's tensors, checked: the release's key set, dtypes (bf16, F32 bias), shards; returns them."""
    import torch

    raw = load_folder(folder)
    expected = expected_keys(cfg)
    if set(raw) != expected:
        raise SystemExit(f"layout: extra {sorted(set(raw) - expected)[:5]}, missing {sorted(expected - set(raw))[:5]}")
    bad = {k: str(v.dtype) for k, v in raw.items()
           if v.dtype != (torch.float32 if k.endswith(F32_SUFFIXES) else torch.bfloat16)}
    assert not bad, f"dtypes: {bad}"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == split_state(raw, cfg), "shards: the nextn layer is not alone in the last shard"
    pre = nextn_prefix(cfg)
    assert not {pre + "embed_tokens.weight", pre + "shared_head.head.weight"} & set(raw)
    assert raw[pre + "eh_proj.weight"].shape == (cfg["hidden_size"], 2 * cfg["hidden_size"])
    return raw


def export_glm(args) -> None:
    import torch

    set_threads(getattr(args, "threads", None))
    stage, run = Path(args.stage), Path(args.run)
    out = Path(args.out or FIXTURE)
    log = json.loads((run / "log.json").read_text())
    ckpt = args.checkpoint or log["checkpoints"][-1]
    shape = shape_of(log["args"])
    cfg = glm_config(shape)
    state = {k: (v.float() if k.endswith(F32_SUFFIXES) else v.to(torch.bfloat16)).contiguous()
             for k, v in raw_names(load_checkpoint(run / ckpt), cfg).items()}
    expected = expected_keys(cfg)
    if set(state) != expected:
        raise SystemExit(f"layout differs from the release's: extra {sorted(set(state) - expected)[:5]}, "
                         f"missing {sorted(expected - set(state))[:5]}")
    total = write_shards(out, state, split_state(state, cfg), SHARDS)
    for shard in SHARDS:
        (out / shard).chmod(0o644)  # safetensors writes 0600; the fixture's files are for everyone to read
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    write_tokenizer_and_generation(out, stage)
    check_folder(out, cfg)

    from transformers import GlmMoeDsaForCausalLM

    held = np.load(stage / "heldout.npy")
    lm, head, _ = build_torch_glm(shape)  # the acceptance of what was written
    load_into(lm, head, fused_names(load_folder(out), cfg))
    acc = acceptance_glm(lm, head, held, seq=getattr(args, "seq", None) or log["args"]["seq"])
    hf = GlmMoeDsaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    mlx = mlx_lm_parity(out, hf, held[: getattr(args, "tokens", 128)])
    manifest = json.loads((stage / "manifest.json").read_text())
    step = checkpoint_step(ckpt)
    record = {
        **provenance(SCRIPT, args.commands, manifest, log, ckpt),
        "acceptance": dict(acc, measured_with={"torch": torch.__version__,
                                               "transformers": __import__("transformers").__version__}),
        "parity": {"mlx_lm_vs_transformers_float32": mlx},
        "final": logged_at(log, step),
        "e_score_correction_bias": log.get("e_score_correction_bias"),
        "history": log["history"],
    }
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    write_readme(out, record, manifest, sum(v.numel() for v in state.values()), cfg)
    size = sum(f.stat().st_size for f in out.iterdir())
    b = acc["broken"]
    print(f"wrote {out} ({size / 1e6:.2f} MB in all, {total / 1e6:.2f} MB of tensors, "
          f"{sum(v.numel() for v in state.values()) / 1e6:.2f} M parameters, step {step}); acceptance: "
          f"greedy {acc['greedy']:.4f} {acc['greedy_ci95']} ({acc['greedy_drafts']} drafts), "
          f"teacher-forced {acc['teacher_forced']:.4f}; broken: swapped halves "
          f"{b['eh_proj_halves_swapped']['greedy']:.4f}, pre-norm h {b['pre_norm_hidden']['greedy']:.4f}; "
          f"mlx-lm vs transformers f32: {mlx['full_max_abs_diff']:.2e} "
          f"(incremental {mlx['incremental_max_abs_diff']:.2e})")


def write_readme(out: Path, record: dict, manifest: dict, n_params: int, cfg: dict) -> None:
    acc, par = record["acceptance"], record["parity"]["mlx_lm_vs_transformers_float32"]
    a = record["training"]["args"]
    held = ", ".join(f["path"] for f in manifest["heldout_files"])
    script_note = ("`python -m tools.fixture_training.glm` (this repository; `python -m tools.fixture_training --variant\n"
                   "glm5` reaches the same code)")
    method = readme_method(record, script_note, "python -m tools.fixture_training.glm",
                                hidden_args=("device", "variant"))
    b = acc["broken"]
    sw, pre = b["eh_proj_halves_swapped"], b["pre_norm_hidden"]
    n = cfg["num_hidden_layers"]
    pct = lambda x: f"{x:.0%}"  # noqa: E731
    vlm = record.get("acceptance_mlx_vlm")
    vlm_text = "" if not vlm else f"""

Cross-checked in MLX: mlx-vlm {vlm['mlx_vlm']}'s `glm_moe_dsa_mtp` drafter, loading this folder as its drafter
root (`--draft-model FOLDER`, split in memory; run on a float32 copy, as mlx's CPU `gather_mm` takes float32
only), accepts {pct(vlm['acceptance'])} of its greedy drafts on the same prompts ({vlm['accepted']} of
{vlm['proposed']}, one draft per round; 95% interval {pct(vlm['acceptance_ci95'][0])}-{pct(vlm['acceptance_ci95'][1])}),
and its output equals plain greedy decoding: {str(vlm['lossless']).lower()}."""
    text = f"""# text-glm5-mtp

A small GLM-5.x model (`glm_moe_dsa`, transformers' `GlmMoeDsaForCausalLM`) with an MTP ("nextn") head,
{n_params / 1e6:.2f} M parameters, hidden {cfg['hidden_size']}. {n} layers: layer 0 dense, layers 1-{n - 1} MoE
({cfg['n_routed_experts']} routed experts, top {cfg['num_experts_per_tok']}, sigmoid `noaux_tc` routing whose
`e_score_correction_bias` was balanced during training, {cfg['n_shared_experts']} shared expert); MLA attention
({cfg['num_attention_heads']} heads, q_lora {cfg['q_lora_rank']}, kv_lora {cfg['kv_lora_rank']}, nope / rope / v
{cfg['qk_nope_head_dim']} / {cfg['qk_rope_head_dim']} / {cfg['v_head_dim']}) and a DSA indexer in every layer.
It was trained for mtpconvert's tests of the GLM-5 family.

It is in GLM-5's raw release layout: flat `model.*` keys; every expert one by one
(`mlp.experts.{{e}}.{{gate,up,down}}_proj.weight`); `e_score_correction_bias` in F32 and every other tensor in
bf16; the nextn layer at `model.layers.{n}.*` (`enorm`, `hnorm`, `eh_proj` [H, 2H], `shared_head.norm` and a
whole MoE decoder block with its own indexer; no `embed_tokens` and no `shared_head.head`, the head borrows the
backbone's) alone in the last shard; `num_nextn_predict_layers: 1` in config.json.

The head is `eh_proj(concat[enorm(embed(t+1)), hnorm(h_t)])` on the backbone's post-final-norm state, the
decoder block, `shared_head.norm` and the backbone's `lm_head`. It accepts a realistic share of greedy drafts,
measured in torch on held-out text: {pct(acc['greedy'])} of the tokens of greedy continuations (k=1; 95% interval
{pct(acc['greedy_ci95'][0])}-{pct(acc['greedy_ci95'][1])} over {acc['prompts']} prompts), {pct(acc['teacher_forced'])}
teacher-forced. With `eh_proj`'s two input halves swapped it collapses to {pct(sw['greedy'])}. Fed the
backbone's pre-final-norm state instead, it still accepts {pct(pre['greedy'])}: `hnorm` absorbs most of the
final norm's per-channel gain, so acceptance alone does not catch that mistake (`acceptance` in
training.json says how each number was measured).{vlm_text}

Loaders: `GlmMoeDsaForCausalLM.from_pretrained` loads the backbone (it reports the nextn layer's keys as
unexpected and skips them). mlx-lm {par['mlx_lm']}'s `load_model` loads the folder strictly (its sanitize drops
layer {n}); its float32 logits differ from transformers' by at most {par['full_max_abs_diff']:.1e} over
{par['tokens']} held-out tokens ({par['incremental_max_abs_diff']:.1e} decoding one token at a time; logits up to
{par['logit_scale']}).

The indexers are untrained: transformers computes them under `no_grad`, so they keep their initialisation
(`k_norm` weight and bias drawn around 1 and 0). With `index_topk` {cfg['index_topk']} they select every key
up to {cfg['index_topk']} tokens, so attention is dense at the lengths the fixture is meant for; past that they
would pick keys arbitrarily. The model was trained on windows of {a['seq']} tokens (prompt plus continuation
in the tests is shorter). The q_a / kv_a layernorms use transformers' eps 1e-6 (mlx-lm's `deepseek_v32` too);
`rms_norm_eps` 1e-5 applies to the other norms.

## Licence of the training text

Trained on the pure-Python modules of CPython {manifest['python']}'s standard library, as installed with the
interpreter ({len(manifest['train_files'])} files, {manifest['train_tokens']} tokens; each file's path and SHA-256 \
are in training.json). That text is under the {manifest['licence']}. The tokenizer
(byte-level BPE, vocabulary {manifest['vocab_size']}, the Qwen3.5 text fixtures' own) was trained on the same
files. Held out of training (prompts of the tests and benchmarks): {held}.

{method}"""
    (out / "README.md").write_text(text)


def parity_glm(args) -> None:
    """The folder checked: layout, transformers' from_pretrained and save_pretrained, this package's model, mlx-lm."""
    import tempfile

    import torch
    from safetensors import safe_open
    from transformers import GlmMoeDsaForCausalLM

    set_threads(getattr(args, "threads", None))
    src = Path(args.folder)
    cfg = json.loads((src / "config.json").read_text())
    raw = check_folder(src, cfg)
    print(f"layout: {len(raw)} tensors, the release's key set; bf16 but e_score_correction_bias (F32); "
          f"nextn layer {cfg['num_hidden_layers']} alone in {SHARDS[1]}")
    hf, info = GlmMoeDsaForCausalLM.from_pretrained(src, dtype=torch.float32, output_loading_info=True)
    hf.eval()
    pre = nextn_prefix(cfg)
    missing, mismatched, unexpected = loading_problems(info, pre)
    print(f"from_pretrained: {len(missing)} missing, {len(mismatched)} mismatched, {len(unexpected)} unexpected "
          f"keys outside layer {cfg['num_hidden_layers']}")
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        saved = {}
        for f in Path(tmp).glob("*.safetensors"):
            with safe_open(str(f), "pt") as fh:
                saved.update({k: fh.get_slice(k).get_dtype() for k in fh.keys()})
    backbone = {k for k in raw if not k.startswith(pre)}
    same_names = set(saved) == backbone
    print(f"save_pretrained writes the folder's backbone names: {same_names}"
          + ("" if same_names else
             f" (extra {sorted(set(saved) - backbone)[:4]}, missing {sorted(backbone - set(saved))[:4]})"))
    lm, head, _ = build_torch_glm({k: cfg[k] for k in GLM_SHAPE})
    load_into(lm, head, fused_names(raw, cfg))
    lm.eval(), head.eval()
    held, ids = parity_ids(args, cfg["vocab_size"])
    tokens = torch.from_numpy(ids.astype(np.int64))[None]
    with torch.no_grad():
        a = hf(input_ids=tokens, use_cache=False).logits[0]
        b = lm(input_ids=tokens, use_cache=False).logits[0]
    diff = float((a - b).abs().max())
    print(f"backbone logits: max |from_pretrained - this package's model| = {diff:.2e}")
    mlx = mlx_lm_parity(src, hf, ids)
    print(f"mlx-lm {mlx['mlx_lm']} vs transformers, float32, {mlx['tokens']} tokens: "
          f"max |diff| {mlx['full_max_abs_diff']:.2e} "
          f"full, {mlx['incremental_max_abs_diff']:.2e} incremental (logit scale {mlx['logit_scale']}), "
          f"argmax agreement {mlx['argmax_agreement']:.4f}")
    if held is not None and args.acceptance:
        rec = src / "training.json"  # teacher-forced windows of the training length, as export measures them
        seq = json.loads(rec.read_text())["training"]["args"]["seq"] if rec.exists() else 128
        acc = acceptance_glm(lm, head, held, seq=seq)
        bk = acc["broken"]
        print(f"acceptance: greedy {acc['greedy']:.4f} {acc['greedy_ci95']} ({acc['greedy_drafts']} drafts), "
              f"teacher-forced {acc['teacher_forced']:.4f}; broken: swapped halves "
              f"{bk['eh_proj_halves_swapped']['greedy']:.4f}, pre-norm h {bk['pre_norm_hidden']['greedy']:.4f}")
    ok = not missing and not mismatched and not unexpected and same_names and diff < 1e-4 and \
        mlx["full_max_abs_diff"] < 1e-3 and mlx["argmax_agreement"] == 1.0
    sys.exit(0 if ok else 1)
