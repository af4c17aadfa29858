"""The Nemotron-H fixture's README.md, written from its training.json (export, and the mlx-vlm check with --record)."""

from __future__ import annotations

from pathlib import Path

from tools.fixture_training.folders import readme_method
from tools.fixture_training.nemotron_h.model import SHAPE_OPTS


def write_readme(out: Path, record: dict, manifest: dict, n_params: int, cfg: dict) -> None:
    acc, par = record["acceptance"], record["parity"]["mlx_lm_vs_transformers_float32"]
    held = ", ".join(f["path"] for f in manifest["heldout_files"])
    method = _method(record)
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
teacher-forced. Broken as a converter can break it, it collapses: `eh_proj`'s input halves swapped
{pct(b['eh_proj_halves_swapped']['greedy'])}, the two blocks run in the other order
{pct(b['blocks_swapped']['greedy'])},
the latent projections transposed {pct(b['latent_transposed']['greedy'])} (`acceptance` in training.json says how each
number was measured).{_contrast_text(record)}{vlm_text}

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


def _contrast_text(record: dict) -> str:
    """Why the last two collapse, where the head was retrained with the contrast (head.py)."""
    if "backbone_training" not in record:
        return ""
    a, before = record["training"]["args"], record["backbone_training"]["acceptance"]
    pct = lambda x: f"{x:.0%}"  # noqa: E731
    return f"""

The last two collapse by design. A head trained only to predict (as this one first was, next to the backbone) came out
with two blocks that nearly commute and a latent MoE that carries little: run in the other order or with its latent
projections transposed it still accepted about as much ({pct(before['broken']['blocks_swapped']['greedy'])} and
{pct(before['broken']['latent_transposed']['greedy'])} against {pct(before['greedy'])} in torch, measured as below),
so a fixture like that cannot catch a converter that makes either mistake, where a real Super's head would break
(its blocks do not commute) or not load (its latent projections are 4096 -> 1024, not square). The head was
therefore retrained on the frozen backbone (`tools/fixture_training/nemotron_h/head.py`) with, next to its
cross-entropy, a hinge at every position that pushes the cross-entropy of each of those two broken heads at least
{a['margin']} nats above the correct head's (weight {a['contrast']}). `eh_proj`'s halves swapped were never in that
loss."""


def _method(record: dict) -> str:
    """The "How it was made" section: the backbone's training run, and the head's retraining where there was one."""
    script = "`python -m tools.fixture_training.nemotron_h` (this repository)"
    command = "python -m tools.fixture_training.nemotron_h"
    bt = record.get("backbone_training")
    if not bt:
        return readme_method(record, script, command, hidden_args=("device", "variant"))
    method = readme_method({"training": bt["training"], "commands": record["commands"], "checkpoint": bt["checkpoint"]},
                           script, command, hidden_args=("device", "variant", "command"))
    tr = record["training"]
    opts = " ".join(f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                    for k, v in tr["args"].items() if v is not None and k not in SHAPE_OPTS and
                    k not in ("device", "variant", "command"))
    return method + f"""
The head was then retrained on that backbone, frozen (`head`, arguments as parsed; the model's sizes are read from
`--source`):

```
{command} head {opts}
```

{tr['steps']} steps, {tr['tokens_seen']} tokens seen, {tr['wall_s']} s on the CPU (torch {tr['torch']}, transformers
{tr['transformers']}); exported checkpoint `{record['checkpoint']['file']}` of that run. `backbone_training` in
training.json is the first run's record (its commands, arguments, losses), `training` and `history` the head run's.
"""
