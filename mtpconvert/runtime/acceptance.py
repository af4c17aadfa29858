"""Greedy draft acceptance of the MTP head, measured against the backbone's own greedy text.

For greedy decoding at depth 1 a draft for position t+2 is accepted exactly when the
head's argmax equals the token the backbone emits there. So generating greedily once
and scoring every (h_t, token t+1) pair in one batched head pass gives the same
per-draft acceptance a decode loop would, at a fraction of the cost. (The decode
loop with rollback and timings is ``bench``'s job.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import mlx.core as mx

from .load import MTPModel


@dataclass
class Acceptance:
    proposed: int
    accepted: int

    @property
    def rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


def greedy_continuation(m: MTPModel, prompt: Sequence[int], n_new: int) -> List[int]:
    cache = m.model.make_cache()
    tokens = list(prompt)
    logits = m.model(mx.array([tokens]), cache=cache)
    for _ in range(n_new):
        nxt = int(mx.argmax(logits[0, -1]))
        tokens.append(nxt)
        logits = m.model(mx.array([[nxt]]), cache=cache)
    return tokens


def backbone_hidden(m: MTPModel, tokens: mx.array, hidden: str = "post-norm") -> mx.array:
    """h_t for every position: after the final norm (default) or before it (PR #990)."""
    inner = m.lm.model
    if hidden == "post-norm":
        return inner(tokens)
    x = inner.embed_tokens(tokens)
    from mlx_lm.models.base import create_attention_mask, create_ssm_mask

    fa_mask = create_attention_mask(x, None)
    ssm_mask = create_ssm_mask(x, None)
    for layer in inner.layers:
        x = layer(x, mask=ssm_mask if layer.is_linear else fa_mask, cache=None)
    return x


def greedy_acceptance(m: MTPModel, prompt: Sequence[int], n_new: int = 48, hidden: str = "post-norm") -> Acceptance:
    seq = greedy_continuation(m, prompt, n_new)
    tokens = mx.array([seq])
    h = backbone_hidden(m, tokens, hidden)
    draft_state = m.head(h[:, :-1], m.embed(tokens[:, 1:]))
    drafts = mx.argmax(m.logits(draft_state), axis=-1)[0]  # drafts[t] guesses seq[t + 2]
    start = len(prompt) - 1  # first draft made after the first generated token
    pred = drafts[start: len(seq) - 2]
    target = mx.array(seq[start + 2:])
    accepted = int(mx.sum(pred == target))
    return Acceptance(int(target.size), accepted)
