"""The GLM-5 head's acceptance, measured in torch: greedy (k=1) with a bootstrap interval over prompts,
teacher-forced, and with the head fed wrongly (a broken conversion's mistakes)."""

from __future__ import annotations

import time

import numpy as np

from tools.fixture_training.heads import head_positions


def head_logits(lm, head, tokens, hidden: str = "post-norm"):
    """(backbone logits [B, L, V], head logits [B, L-1, V]); row t drafts token t+2 from (h_t, token t+1).

    ``hidden="pre-norm"`` feeds the head the backbone's state before ``model.norm`` (a broken converter's mistake).
    """
    import torch
    import torch.nn as nn

    with torch.no_grad():
        h = lm.model(input_ids=tokens).last_hidden_state
        h_in = h
        if hidden == "pre-norm":
            norm, lm.model.norm = lm.model.norm, nn.Identity()
            try:
                h_in = lm.model(input_ids=tokens).last_hidden_state
            finally:
                lm.model.norm = norm
        B, L = tokens.shape
        pe = lm.model.rotary_emb(h, head_positions(lm.config, B, L - 1, tokens.device))
        m = head(h_in[:, :-1], lm.model.embed_tokens(tokens[:, 1:]), pe)
        return lm.lm_head(h), lm.lm_head(m)


def bootstrap_ci(hits: np.ndarray, totals: np.ndarray, n: int = 2000, seed: int = 0) -> list:
    """95% percentile-bootstrap interval of sum(hits)/sum(totals), resampling the units (prompts)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, hits.size, size=(n, hits.size))
    est = hits[idx].sum(1) / np.maximum(totals[idx].sum(1), 1)
    return [round(float(np.percentile(est, 2.5)), 4), round(float(np.percentile(est, 97.5)), 4)]


def greedy_prompts(held: np.ndarray, eot: int = 0, prompt: int = 64, per_file: int = 3) -> list:
    """``per_file`` prompts of ``prompt`` held-out tokens from each held-out file, at 1/(per_file+1), 2/..., of it."""
    out = []
    for doc in np.split(held, np.flatnonzero(held == eot) + 1):
        if doc.size < 2 * prompt:
            continue
        for j in range(per_file):
            s = min(int(doc.size * (j + 1) / (per_file + 1)), doc.size - prompt)
            out.append(doc[s: s + prompt].astype(np.int64))
    return out


def continuations(lm, prompts: list, generate: int = 64, eot: int = 0):
    """The backbone's greedy continuations (``generate()``, KV cache, one batch) of the prompts:
    [P, prompt + generate]."""
    import torch

    lm.eval()
    ids = torch.from_numpy(np.stack(prompts))  # prompts of one length: one batch, no padding
    with torch.no_grad():
        return lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=generate,
                           min_new_tokens=generate, do_sample=False, eos_token_id=None, pad_token_id=eot)


def greedy_acceptance(lm, head, seqs, prompt: int, hidden: str = "post-norm") -> dict:
    """Share of generated tokens t+2 (t+1 the prompt's last token or later) that the head's argmax from (h_t, t+1)
    equals."""
    import torch

    lm.eval(), head.eval()
    _, mtp = head_logits(lm, head, seqs, hidden)
    draft = mtp.argmax(-1)  # [P, L-1]: row t drafts token t+2
    t = torch.arange(prompt - 1, seqs.shape[1] - 2)
    hits = (draft[:, t] == seqs[:, t + 2]).sum(1).numpy()
    totals = np.full(hits.size, t.numel())
    return {"greedy": round(float(hits.sum() / max(totals.sum(), 1)), 4), "greedy_ci95": bootstrap_ci(hits, totals),
            "greedy_drafts": int(totals.sum()), "greedy_by_prompt": [round(h / t, 4) for h, t in zip(hits, totals)]}


def teacher_forced(lm, head, held: np.ndarray, seq: int, batch: int = 16) -> dict:
    """Share of positions t of held-out windows where the head's argmax (h_t, true t+1) equals the backbone's
    argmax at t+1."""
    import torch

    lm.eval(), head.eval()
    starts = np.arange(0, held.size - seq, seq)
    hits = []
    for i in range(0, len(starts), batch):
        tokens = torch.from_numpy(np.stack([held[s: s + seq] for s in starts[i: i + batch]]).astype(np.int64))
        logits, mtp = head_logits(lm, head, tokens)
        hits += (mtp[:, :-1].argmax(-1) == logits[:, 1:-1].argmax(-1)).sum(1).tolist()
    hits = np.array(hits)
    totals = np.full(hits.size, seq - 2)
    return {"teacher_forced": round(float(hits.sum() / totals.sum()), 4),
            "teacher_forced_ci95": bootstrap_ci(hits, totals),
            "teacher_forced_positions": int(totals.sum()), "teacher_forced_windows": int(hits.size)}


def swapped_halves(head):
    """A context manager: eh_proj's two input halves swapped (a bad conversion's concat order [hnorm(h), enorm(e)])."""
    import contextlib

    import torch

    @contextlib.contextmanager
    def cm():
        w = head.eh_proj.weight
        H = w.shape[0]
        keep = w.detach().clone()
        with torch.no_grad():
            w.copy_(torch.cat([keep[:, H:], keep[:, :H]], dim=1))
        try:
            yield
        finally:
            with torch.no_grad():
                w.copy_(keep)
    return cm()


def acceptance_glm(lm, head, held: np.ndarray, seq: int, eot: int = 0, prompt: int = 64, generate: int = 64,
                   per_file: int = 3, broken: bool = True) -> dict:
    """Torch measurements of the head on held-out text (the stage's heldout.npy):

    greedy          ``per_file`` ``prompt``-token prompts from each held-out file (at 1/4, 1/2 and 3/4 of it),
                    continued greedily by the backbone (``generate()``, KV cache, the prompts in one batch) for
                    ``generate`` tokens; share of the generated tokens t+2 (t+1 the prompt's last token or later)
                    that the head's argmax from (h_t, t+1) equals: the greedy acceptance of one draft per step
                    (k=1). 95% interval: percentile bootstrap over prompts (2000 resamples)
    teacher_forced  every window of ``seq`` held-out tokens: share of positions t where the head's argmax (from h_t
                    and the true token t+1) equals the backbone's argmax at t+1 (its greedy token t+2); the
                    training log's "agree". Interval: bootstrap over windows
    broken          the greedy measurement with the head fed wrongly: eh_proj's halves swapped (concat order
                    reversed), and the backbone's pre-final-norm state as h_t
    """
    t0 = time.time()
    prompts = greedy_prompts(held, eot, prompt, per_file)
    seqs = continuations(lm, prompts, generate, eot)
    out = {**greedy_acceptance(lm, head, seqs, prompt), **teacher_forced(lm, head, held, seq),
           "prompts": len(prompts), "prompt_tokens": prompt, "generated_tokens": generate}
    if broken:
        with swapped_halves(head):
            sw = greedy_acceptance(lm, head, seqs, prompt)
        pre = greedy_acceptance(lm, head, seqs, prompt, hidden="pre-norm")
        out["broken"] = {"eh_proj_halves_swapped": {k: sw[k] for k in ("greedy", "greedy_ci95")},
                         "pre_norm_hidden": {k: pre[k] for k in ("greedy", "greedy_ci95")}}
    out["seconds"] = round(time.time() - t0, 1)
    out["method"] = acceptance_glm.__doc__.split("\n\n", 1)[1].strip()
    return out
