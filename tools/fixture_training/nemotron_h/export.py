"""The Nemotron-H fixture's export: the release layout, the head's acceptance in torch (and with the head broken the
ways a converter can break it), mlx-lm against transformers, training.json and README.md."""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from tools.fixture_training.folders import (checkpoint_step, load_checkpoint, load_folder, logged_at, provenance,
                                            readme_method, write_shards, write_tokenizer_and_generation)
from tools.fixture_training.glm.acceptance import bootstrap_ci, continuations, greedy_prompts
from tools.fixture_training.glm.export import mlx_lm_parity
from tools.fixture_training.glm.train import set_threads
from tools.fixture_training.nemotron_h.model import (F32_SUFFIXES, FIXTURE, SHARDS, build_torch, head_names,
                                                     module_names, nemotron_config, shape_of, split_state)

SCRIPT = "tools/fixture_training/nemotron_h"  # training.json's "script": python -m tools.fixture_training.nemotron_h


# the GLM comparison's own method text names its MLA decode path; the same measurement here steps Mamba2 and attention
PARITY_METHOD = ("``full``: one forward over the ids. ``incremental``: ``prefill`` ids, then one id at a time through "
                 "mlx-lm's cache (Mamba2's conv window and SSM state, attention's KV cache) against the same rows of "
                 "transformers' full forward.")


def head_logits(lm, head, tokens):
    """(backbone logits [B, L, V], head logits [B, L-1, V]); row t drafts token t+2 from (h_t, token t+1)."""
    import torch

    with torch.no_grad():
        h = lm.model(input_ids=tokens).last_hidden_state
        return lm.lm_head(h), lm.lm_head(head(h[:, :-1], lm.model.embeddings(tokens[:, 1:])))


def greedy_acceptance(lm, head, seqs, prompt: int) -> dict:
    """Share of generated tokens t+2 (t+1 the prompt's last token or later) that the head's argmax from (h_t, t+1)
    equals."""
    import torch

    lm.eval(), head.eval()
    _, mtp = head_logits(lm, head, seqs)
    t = torch.arange(prompt - 1, seqs.shape[1] - 2)
    hits = (mtp.argmax(-1)[:, t] == seqs[:, t + 2]).sum(1).numpy()
    totals = np.full(hits.size, t.numel())
    return {"greedy": round(float(hits.sum() / max(totals.sum(), 1)), 4), "greedy_ci95": bootstrap_ci(hits, totals),
            "greedy_drafts": int(totals.sum())}


def teacher_forced(lm, head, held: np.ndarray, seq: int, batch: int = 16) -> dict:
    """Share of positions t of held-out windows where the head's argmax (h_t, true t+1) equals the backbone's argmax
    at t+1 (its greedy token t+2)."""
    import torch

    lm.eval(), head.eval()
    starts = np.arange(0, held.size - seq, seq)
    hits = []
    for i in range(0, len(starts), batch):
        tokens = torch.from_numpy(np.stack([held[s: s + seq] for s in starts[i: i + batch]]).astype(np.int64))
        logits, mtp = head_logits(lm, head, tokens)
        hits += (mtp[:, :-1].argmax(-1) == logits[:, 1:-1].argmax(-1)).sum(1).tolist()
    hits, totals = np.array(hits), np.full(len(hits), seq - 2)
    return {"teacher_forced": round(float(hits.sum() / totals.sum()), 4),
            "teacher_forced_ci95": bootstrap_ci(hits, totals), "teacher_forced_positions": int(totals.sum())}


@contextlib.contextmanager
def broken(head, how: str):
    """The head as a broken conversion writes it, while inside: ``eh_proj_halves_swapped`` (the concat order
    reversed), ``blocks_swapped`` (the MoE block run before the attention block), ``latent_transposed`` (each latent
    projection replaced by the other's transpose; square here, so it still runs)."""
    import torch

    moe = next(b.mixer for b in head.model.layers if hasattr(b.mixer, "fc1_latent_proj"))
    kept = {"eh": head.eh_proj.weight.detach().clone(), "fc1": moe.fc1_latent_proj.weight.detach().clone(),
            "fc2": moe.fc2_latent_proj.weight.detach().clone(), "layers": head.model.layers}
    with torch.no_grad():
        if how == "eh_proj_halves_swapped":
            H = kept["eh"].shape[0]
            head.eh_proj.weight.copy_(torch.cat([kept["eh"][:, H:], kept["eh"][:, :H]], dim=1))
        elif how == "blocks_swapped":
            head.model.layers = torch.nn.ModuleList(list(kept["layers"])[::-1])
        elif how == "latent_transposed":
            moe.fc1_latent_proj.weight.copy_(kept["fc2"].T)
            moe.fc2_latent_proj.weight.copy_(kept["fc1"].T)
        else:
            raise ValueError(how)
    try:
        yield
    finally:
        with torch.no_grad():
            head.eh_proj.weight.copy_(kept["eh"])
            moe.fc1_latent_proj.weight.copy_(kept["fc1"])
            moe.fc2_latent_proj.weight.copy_(kept["fc2"])
            head.model.layers = kept["layers"]


BROKEN = ("eh_proj_halves_swapped", "blocks_swapped", "latent_transposed")


def acceptance(lm, head, held: np.ndarray, seq: int, prompt: int = 64, generate: int = 64, per_file: int = 3) -> dict:
    """Torch measurements of the head on held-out text (the stage's heldout.npy):

    greedy          ``per_file`` ``prompt``-token prompts from each held-out file (at 1/4, 1/2 and 3/4 of it),
                    continued greedily by the backbone (``generate()``, the prompts in one batch) for ``generate``
                    tokens; share of the generated tokens t+2 (t+1 the prompt's last token or later) that the head's
                    argmax from (h_t, t+1) equals: the greedy acceptance of one draft per step (k=1). 95% interval:
                    percentile bootstrap over prompts (2000 resamples)
    teacher_forced  every window of ``seq`` held-out tokens: share of positions t where the head's argmax (from h_t
                    and the true token t+1) equals the backbone's argmax at t+1. Interval: bootstrap over windows
    broken          the greedy measurement with the head broken as a converter can break it: eh_proj's input halves
                    swapped, the two blocks run in the other order, the latent projections transposed
    """
    t0 = time.time()
    prompts = greedy_prompts(held, 0, prompt, per_file)
    seqs = continuations(lm, prompts, generate, 0)
    out = {**greedy_acceptance(lm, head, seqs, prompt), **teacher_forced(lm, head, held, seq),
           "prompts": len(prompts), "prompt_tokens": prompt, "generated_tokens": generate, "broken": {}}
    for how in BROKEN:
        with broken(head, how):
            res = greedy_acceptance(lm, head, seqs, prompt)
        out["broken"][how] = {k: res[k] for k in ("greedy", "greedy_ci95")}
    out["seconds"] = round(time.time() - t0, 1)
    out["method"] = acceptance.__doc__.split("\n\n", 1)[1].strip()
    return out


def release_state(lm, head, cfg: dict) -> dict:
    """The release's tensors: the backbone as transformers' save_pretrained names it, the head as mtp.layers.{j}.*
    (head_names), every tensor bf16 but the routers' F32 e_score_correction_bias."""
    import torch
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        lm.save_pretrained(tmp)
        state = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            state.update(load_file(str(f)))
    state.update(head_names(head.state_dict(), len(cfg["mtp_hybrid_override_pattern"]) - 1))
    return {k: (v.float() if k.endswith(F32_SUFFIXES) else v.to(torch.bfloat16)).contiguous() for k, v in state.items()}


def load_release(lm, head, raw: dict, cfg: dict) -> None:
    """The folder's tensors into the torch models (the backbone through transformers' own key mapping)."""
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        from safetensors.torch import save_file

        save_file({k: v for k, v in raw.items() if not k.startswith("mtp.")}, str(Path(tmp) / "model.safetensors"))
        (Path(tmp) / "config.json").write_text(json.dumps(cfg))
        from transformers import NemotronHForCausalLM

        loaded = NemotronHForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    lm.load_state_dict(loaded.state_dict(), strict=True)
    head.load_state_dict({k: v.float() for k, v in module_names({k: v for k, v in raw.items() if k.startswith("mtp.")},
                                                                len(cfg["mtp_hybrid_override_pattern"]) - 1).items()},
                         strict=True)


def export_nemotron(args) -> None:
    import torch
    from transformers import NemotronHForCausalLM

    set_threads(getattr(args, "threads", None))
    stage, run = Path(args.stage), Path(args.run)
    out = Path(args.out or FIXTURE)
    log = json.loads((run / "log.json").read_text())
    ckpt = args.checkpoint or log["checkpoints"][-1]
    shape = shape_of(log["args"])
    cfg = nemotron_config(shape)
    lm, head, _ = build_torch(shape)
    trained = load_checkpoint(run / ckpt)
    lm.load_state_dict({k: v.float() for k, v in trained.items() if not k.startswith("mtp.")}, strict=True)
    head.load_state_dict({k[4:]: v.float() for k, v in trained.items() if k.startswith("mtp.")}, strict=True)
    state = release_state(lm, head, cfg)
    total = write_shards(out, state, split_state(state), SHARDS)
    for shard in SHARDS:
        (out / shard).chmod(0o644)  # safetensors writes 0600; the fixture's files are for everyone to read
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    write_tokenizer_and_generation(out, stage)

    held = np.load(stage / "heldout.npy")
    lm, head, _ = build_torch(shape)  # the acceptance of what was written
    load_release(lm, head, load_folder(out), cfg)
    acc = acceptance(lm, head, held, seq=getattr(args, "seq", None) or log["args"]["seq"])
    hf = NemotronHForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    mlx = dict(mlx_lm_parity(out, hf, held[: getattr(args, "tokens", 128)]), method=PARITY_METHOD)
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
    if "backbone" in log:  # a head run (head.py): the record of the folder whose backbone it kept
        record["backbone_training"] = log["backbone"]
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    from tools.fixture_training.nemotron_h.readme import write_readme

    write_readme(out, record, manifest, sum(v.numel() for v in state.values()), cfg)
    b = acc["broken"]
    print(f"wrote {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.2f} MB in all, {total / 1e6:.2f} MB of "
          f"tensors, step {step}); acceptance: greedy {acc['greedy']:.4f} {acc['greedy_ci95']} "
          f"({acc['greedy_drafts']} drafts), teacher-forced {acc['teacher_forced']:.4f}; broken: "
          + ", ".join(f"{k} {v['greedy']:.4f}" for k, v in b.items())
          + f"; mlx-lm vs transformers f32: {mlx['full_max_abs_diff']:.2e} (incremental "
          f"{mlx['incremental_max_abs_diff']:.2e})")
