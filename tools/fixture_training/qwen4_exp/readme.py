"""The qwen4_exp fixture's README.md, from its training.json."""

from __future__ import annotations

from pathlib import Path

from tools.fixture_training.folders import readme_method
from tools.fixture_training.qwen4_exp.model import TEXT


BROKEN_WORDS = {"fc_swapped": "`fc_embedding` and `fc_hidden` swapped",
                "head_norms_plus_one": "the head's norms shifted by +1",
                "all_norms_plus_one": "every zero-centred norm shifted by +1"}


def measured(record: dict) -> str:
    """The acceptance paragraph: torch's, and mtpconvert's and mlx-vlm's once ``check`` recorded them."""
    acc = record["acceptance"]
    text = (f"In torch on held-out text (`acceptance` in training.json says how) the head accepts "
            f"{acc['greedy']:.0%} of greedy drafts (one draft a step; {acc['teacher_forced']:.0%} teacher-forced); "
            f"with `fc_embedding` and `fc_hidden` swapped it accepts "
            f"{acc['broken']['fc_halves_swapped']['greedy']:.0%}, "
            f"with its norms shifted by +1 {acc['broken']['head_norms_shifted_plus_one']['greedy']:.0%}")
    rolled = acc["broken"].get("input_streams_rolled")
    text += (f", with the backbone's hyper-connection streams fed to it one place round {rolled['greedy']:.0%}."
             if rolled else ".")
    ours = record.get("acceptance_mtpconvert")
    if ours:
        text += (" Converted, mtpconvert's smoke (its default prompts) accepts "
                 + ", ".join(f"{v['acceptance']:.0%} ({k})" for k, v in ours["conversions"].items()) + ".")
        verdict = {True: "passed", False: "refused"}
        text += (" On the float32 conversion broken on purpose (`tools/fixture_training/qwen4_exp/broken.py`) it "
                 "accepts " + ", ".join(f"{v['acceptance']:.0%} with {BROKEN_WORDS.get(k, k)} "
                                        f"({verdict[v['ok']]})" for k, v in ours["broken"].items()) + ".")
    vlm = record.get("acceptance_mlx_vlm")
    if vlm:
        text += (f" mlx-vlm {vlm['mlx_vlm']}'s `{vlm['drafter']}` on `OUT/mtp` accepts "
                 f"{vlm['one_draft']['acceptance']:.0%} of its drafts at one draft a round and "
                 f"{vlm['default']['acceptance']:.0%} with its default block size, on held-out prompts.")
    return text


def write_readme(out: Path, record: dict, manifest: dict, n_params: float) -> None:
    a = record["training"]["args"]
    held = ", ".join(f["path"] for f in manifest["heldout_files"])
    script_note = "`python -m tools.fixture_training.qwen4_exp` (this repository: `tools/fixture_training/qwen4_exp/`)"
    method = readme_method(record, script_note, "python -m tools.fixture_training.qwen4_exp", hidden_args=("out",))
    text = f"""# text-qwen4_exp-mtp

A small Qwen3.8-Flash-Next (`qwen4_exp`) model with its MTP head ({n_params / 1e6:.2f} M parameters), trained for
mtpconvert's tests of the `qwen4_exp` family. transformers' own `Qwen4ExpForCausalLM`: hidden size
{a.get('hidden_size') or 96}, four hyper-connection streams, GatedDeltaNet in layers 0-2 and indexed (sparse) attention
in layer 3, MoE in every layer ({a.get('experts') or 4} experts, top {a.get('top_k') or 2}, a shared expert), a
per-layer n-gram embedding in layer 1 (its table in four `shard_N` parts, the hashing buffers int64). The head is
the release's design, composed of transformers' qwen4_exp modules as mlx-vlm's `qwen4_exp_mtp` drafter runs it: it
reads the backbone's last hyper-connection streams before their mixer, one RMS norm over all of them, `fc_embedding`
and `fc_hidden`, one indexed-attention MoE layer and its own mixer, then the shared `lm_head`. Trained next to the
backbone (next-token cross-entropy plus the head's on token t+2, plus a router balancing term).

The folder is the raw release layout: `Qwen4ExpForConditionalGeneration.save_pretrained` of the trained weights
(`model.language_model.*`, an untrained one-block `model.visual.*` tower, `lm_head`), all bf16 but the int64
hashing buffers, zero-centred norms, conv1d `[C, 1, K]`; `mtp.*` in the last shard; `mtp_num_hidden_layers` 1.
`Qwen4ExpForConditionalGeneration.from_pretrained` loads it (it skips `mtp.*`). The indexer's budget
(`indexer_budget` {TEXT['indexer_budget']}) exceeds every length the fixture is trained and tested at, so
its attention is dense there; the indexers were not trained (their selection has no gradient).

{measured(record)} Swapped input projections or norms shifted throughout collapse the acceptance; the head's
norms alone shifted by +1, or its input streams reordered, lower it far less (the torch numbers above), so
acceptance does not catch those conversions on this fixture.

## Licence of the training text

Trained on the pure-Python modules of CPython {manifest['python']}'s standard library, as installed with the
interpreter ({len(manifest['train_files'])} files, {manifest['train_tokens']} tokens; each file's path and SHA-256
are in training.json). That text is under the {manifest['licence']}. The tokenizer (byte-level BPE, vocabulary
{manifest['vocab_size']}, the other text fixtures' own) was trained on the same files. Held out of training (prompts
of the tests): {held}.

{method}"""
    (out / "README.md").write_text(text)
