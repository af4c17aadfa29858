"""The Nemotron-H fixture's README.md, written from its training.json (export, and the mlx-vlm check with --record)."""

from __future__ import annotations

from pathlib import Path

from tools.fixture_training.folders import readme_method


def write_readme(out: Path, record: dict, manifest: dict, n_params: int, cfg: dict) -> None:
    acc, par = record["acceptance"], record["parity"]["mlx_lm_vs_transformers_float32"]
    held = ", ".join(f["path"] for f in manifest["heldout_files"])
    method = readme_method(record, "`python -m tools.fixture_training.nemotron_h` (this repository)",
                           "python -m tools.fixture_training.nemotron_h", hidden_args=("device", "variant"))
    b = acc["broken"]
    pct = lambda x: f"{x:.0%}"  # noqa: E731
    pattern, head = cfg["hybrid_override_pattern"], cfg["mtp_hybrid_override_pattern"]
    vlm = record.get("acceptance_mlx_vlm")
    vlm_text = "" if not vlm else f"""

Cross-checked in MLX: mlx-vlm {vlm['mlx_vlm']}'s `nemotron_h_mtp` drafter, loading this folder as its drafter root
(`--draft-model FOLDER`, split in memory; run on a float32 copy, as mlx's CPU `gather_mm` takes float32 only),
accepts {pct(vlm['acceptance'])} of its greedy drafts on the same prompts ({vlm['accepted']} of {vlm['proposed']}, one
draft per round; 95% interval {pct(vlm['acceptance_ci95'][0])}-{pct(vlm['acceptance_ci95'][1])}); its output
{"equals" if vlm['lossless'] else "differs from"} plain greedy decoding on every prompt."""
    text = f"""# text-nemotronh-mtp

A small Nemotron-H model (`nemotron_h`, transformers' `NemotronHForCausalLM`) with Nemotron-3 Super's native MTP
head, {n_params / 1e6:.2f} M parameters, hidden {cfg['hidden_size']}. Blocks `{pattern}`: Mamba2 (`M`,
{cfg['mamba_num_heads']} heads x {cfg['mamba_head_dim']}, state {cfg['ssm_state_size']}, {cfg['n_groups']} groups),
latent MoE (`E`, {cfg['n_routed_experts']} routed relu² experts, top {cfg['num_experts_per_tok']}, sigmoid routing whose
`e_score_correction_bias` was balanced during training, 1 shared expert, latent size {cfg['moe_latent_size']}) and one
attention block (`*`, no RoPE). It was trained for mtpconvert's tests of the Nemotron-H family.

It is in the release layout: `backbone.*` as transformers' `save_pretrained` names it (every expert one by one,
`mixer.experts.{{e}}.{{up,down}}_proj.weight`; conv1d `[C, 1, K]`); the head `mtp.layers.{{j}}.*`, one prediction
module of the blocks `{head}` (`mtp_hybrid_override_pattern`) with `enorm`, `hnorm` and `eh_proj` [H, 2H] on block 0
and `final_layernorm` on block {len(head) - 1}, alone in the last shard; `e_score_correction_bias` in F32 and every
other tensor in bf16; Super's config spelling (pattern strings, `num_nextn_predict_layers: 1`).

The head is `eh_proj(concat[enorm(embed(t+1)), hnorm(h_t)])` on the backbone's post-`norm_f` state, its blocks in
order, `final_layernorm` and the backbone's `lm_head`. Its latent size equals the hidden size, so that a conversion
transposing the latent projections still loads. It accepts a realistic share of greedy drafts, measured in torch
on held-out text: {pct(acc['greedy'])} of the tokens of greedy continuations (k=1; 95% interval
{pct(acc['greedy_ci95'][0])}-{pct(acc['greedy_ci95'][1])} over {acc['prompts']} prompts), {pct(acc['teacher_forced'])}
teacher-forced. Broken as a converter can break it: `eh_proj`'s input halves swapped collapse it to
{pct(b['eh_proj_halves_swapped']['greedy'])}; the two blocks run in the other order
({pct(b['blocks_swapped']['greedy'])}) or the latent projections transposed ({pct(b['latent_transposed']['greedy'])})
cost it only a few points, the head's MoE block carrying little, so acceptance does not tell those two from a correct
conversion (`acceptance` in training.json says how each number was measured).{vlm_text}

Loaders: `NemotronHForCausalLM.from_pretrained` loads the backbone (it ignores `mtp.*`). mlx-lm {par['mlx_lm']}'s
`load_model` loads the folder strictly (its sanitize drops `mtp.*`, moves the conv and stacks the experts); its float32
logits differ from transformers' by at most {par['full_max_abs_diff']:.1e} over {par['tokens']} held-out tokens
({par['incremental_max_abs_diff']:.1e} decoding one token at a time; logits up to {par['logit_scale']}).

## Licence of the training text

Trained on the pure-Python modules of CPython {manifest['python']}'s standard library, as installed with the
interpreter ({len(manifest['train_files'])} files, {manifest['train_tokens']} tokens; each file's path and SHA-256 \
are in training.json). That text is under the {manifest['licence']}. The tokenizer (byte-level BPE, vocabulary
{manifest['vocab_size']}, the other text fixtures' own) was trained on the same files. Held out of training (prompts
of the tests and benchmarks): {held}.

{method}"""
    (out / "README.md").write_text(text)
